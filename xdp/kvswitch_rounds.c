/* kvswitch_rounds.c - coalescing and replication, a part of kvswitch.c (pasted where kvswitch.c
 * includes it, as xdp/loader.py compiles a program: BCC rewrites map calls in its main file
 * only), so it sees what kvswitch.c includes and defines above it.
 *
 * A GET miss opens a round (kv_pending) and goes upstream; GETs for the same chunk from other
 * ports while it is open are held (kv_waiters) and join it; a round older than the round
 * timeout (measured here: round_estimate, round_sample) is asked again. The reply closes the
 * round and reaches every waiter through one devmap broadcast (release_waiters), the round's
 * generation carried in the frame for kv_egress to check. A lone reader's round costs one entry:
 * its first asker stays inline in kv_pending until a second port waits too (share_round). */

/* A new round for the chunk, going upstream to where this GET is addressed. */
static __always_inline void open_round(struct kv_pending *p, struct kv_frame *f, __u64 now,
                                       __u32 ifindex)
{
    p->gen = now;
    p->sent = now;
    p->waiters = 1;
    p->first_ifindex = ifindex;
    p->daddr = f->ip->daddr;
    p->dport = f->udp->dest;
    __builtin_memcpy(p->dmac, f->eth->h_dest, ETH_ALEN);
}

static __always_inline int same_dest(struct kv_pending *p, struct kv_frame *f)
{
    return p->daddr == f->ip->daddr && p->dport == f->udp->dest && mac_eq(p->dmac, f->eth->h_dest);
}

/* How long a round's reply takes lately (SRTT + 4 RTTVAR of rounds the data plane closed),
 * never more than KV_ROUND_CAP pending timeouts. */
static __always_inline __u64 round_estimate(__u64 pending)
{
    __u64 est = setting(KV_SET_ROUND_SRTT_NS) + 4 * setting(KV_SET_ROUND_VAR_NS);
    return est < KV_ROUND_CAP * pending ? est : KV_ROUND_CAP * pending;
}

/* One round's time from its upstream GET to its reply, into the estimate (RFC 6298's gains;
 * not atomic: a concurrent update may lose a sample, which an estimate can afford). */
static __always_inline void round_sample(__u64 rtt)
{
    __u32 si = KV_SET_ROUND_SRTT_NS, vi = KV_SET_ROUND_VAR_NS;
    __u64 *srtt = kv_settings.lookup(&si), *var = kv_settings.lookup(&vi);
    if (!srtt || !var)
        return;
    __u64 s = *srtt;
    if (!s) {
        *srtt = rtt;
        *var = rtt / 2;
        return;
    }
    __u64 d = rtt > s ? rtt - s : s - rtt;
    *var = *var - (*var >> 2) + (d >> 2);
    *srtt = s - (s >> 3) + (rtt >> 3);
}

/* The first asker's place in kv_waiters, written once another port is about to wait in the round
 * too: a lone reader's round keeps it inline (KV_RF_SHARED says where it is). */
static __always_inline void share_round(struct kv_pending *p, struct kv_cache_key *k)
{
    if (p->flags & KV_RF_SHARED)
        return;
    struct kv_waiter_key fk = {};
    fk.chunk = *k;
    fk.ifindex = p->first_ifindex;
    struct kv_waiter first = p->first;
    first.gen = p->gen;
    kv_waiters.update(&fk, &first);
    p->flags |= KV_RF_SHARED;
}

/* Port `wk`'s waiter in round `p`, wherever it is kept (NULL: none). */
static __always_inline struct kv_waiter *round_waiter(struct kv_pending *p,
                                                      struct kv_waiter_key *wk)
{
    if (wk->ifindex == p->first_ifindex && !(p->flags & KV_RF_SHARED))
        return &p->first;
    return kv_waiters.lookup(wk);
}

/* Put the waiter `w` of port `wk` into round `p`: a port already waiting in it has its request
 * id updated (the same asker again: answer its latest request), a new one is counted. Returns
 * whether the port was already waiting. */
static __always_inline int add_waiter(struct kv_pending *p, struct kv_waiter_key *wk,
                                      struct kv_waiter *w, __u32 coalesced)
{
    struct kv_waiter *old = round_waiter(p, wk);
    if (old && old->gen == p->gen) {
        old->req_id = w->req_id;
        return 1;
    }
    share_round(p, &wk->chunk);
    w->gen = p->gen;
    w->coalesced = coalesced;
    kv_waiters.update(wk, w);
    __sync_fetch_and_add(&p->waiters, 1);
    return 0;
}

/* Hold this GET in the open round `p`: remember where its replica goes. Only a GET addressed
 * where the round's went may wait in it: a round sent to an address nobody answers (by mistake
 * or to stall others) must not capture the GETs of the chunk's real pool node. A port that
 * already waits and asks again once the round's reply is due (its GET or the reply may have
 * been lost on a link) is let through upstream; the round keeps its timers, so asking again
 * never prolongs a hold. */
static __always_inline int join_round(struct kv_pending *p, struct kv_frame *f,
                                      struct kv_waiter_key *wk, struct kv_waiter *w,
                                      __u64 now, __u64 due)
{
    if (!same_dest(p, f)) {
        count(KV_STAT_OTHER_DEST, 1);
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    struct kv_waiter *old = round_waiter(p, wk);
    if (old && old->gen == p->gen) {
        if (old->ip != w->ip || old->port != w->port) {
            count(KV_STAT_UNCOALESCED, 1);  /* one waiter per port: let this one through */
            count(KV_STAT_GET_MISS, 1);
            return XDP_PASS;
        }
        old->req_id = w->req_id;  /* the same asker again: answer its latest request */
        if (now - p->sent > due) {
            count(KV_STAT_REASKED, 1);
            count(KV_STAT_GET_MISS, 1);
            return XDP_PASS;
        }
        count(KV_STAT_COALESCED, 1);
        return XDP_DROP;
    }
    share_round(p, &wk->chunk);
    w->gen = p->gen;
    w->coalesced = 1;
    kv_waiters.update(wk, w);
    __sync_fetch_and_add(&p->waiters, 1);
    count(KV_STAT_COALESCED, 1);
    return XDP_DROP;
}

/* A GET miss: the first asker of a round goes upstream, later askers on other ports wait. */
static __always_inline int hold_or_forward(struct xdp_md *ctx, struct kv_frame *f,
                                           struct kv_cache_key *k)
{
    count_miss(k);                 /* held or forwarded, it is demand the cache did not meet */
    __u64 now = bpf_ktime_get_ns();
    struct kv_waiter w = {};
    __builtin_memcpy(w.mac, f->eth->h_source, ETH_ALEN);
    w.ip = f->ip->saddr;
    w.port = f->udp->source;
    w.req_id = f->kv->req_id;
    w.gen = now;
    if (!setting(KV_SET_COALESCE)) {
        struct kv_pending open = {};   /* outstanding, so its reply may be learned; no holding */
        open_round(&open, f, now, ctx->ingress_ifindex);
        open.first = w;
        kv_pending.update(k, &open);
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    struct kv_waiter_key wk = {};
    wk.chunk = *k;
    wk.ifindex = ctx->ingress_ifindex;

    struct kv_pending *p = kv_pending.lookup(k);
    if (p && (p->flags & KV_RF_PROBATION)) {
        /* Its last round went unanswered: nobody is held here until a reply for the chunk
         * passes (it closes the round). This GET goes upstream, and its port gets a copy of
         * that reply too if the round is replicated (else the copy meant for this port, which
         * may be the very reply to this GET, would be dropped as nobody's). */
        if (same_dest(p, f))
            add_waiter(p, &wk, &w, 0);
        count(KV_STAT_UNHELD, 1);
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    __u64 pending = setting(KV_SET_PENDING_NS);
    __u64 est = round_estimate(pending);
    __u64 timeout = est > pending ? est : pending;
    if (p && now - p->sent < timeout)
        return join_round(p, f, &wk, &w, now, est > pending / 2 ? est : pending / 2);
    /* (No second look into the cache when no round is open: a reply learned on another CPU
     * just now is a rare race, and the look cost every lone reader's GET a lookup.) */
    if (p && same_dest(p, f)) {
        /* A stale round: its reply did not come within the round timeout. This GET asks
         * upstream again for the round, whose waiters keep waiting for whichever reply comes
         * (the first may only be late), this GET's port among them; until a reply passes
         * nobody more is held for the chunk: a requester that keeps re-arming rounds its pool
         * never answers holds others one round timeout at most. */
        count(KV_STAT_EXPIRED, 1);
        p->sent = now;
        p->flags |= KV_RF_PROBATION;
        add_waiter(p, &wk, &w, 0);
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    struct kv_pending np = {};
    open_round(&np, f, now, wk.ifindex);
    np.first = w;                  /* inline until another port waits too */
    if (p) {
        /* A stale round that went elsewhere: replaced by this GET's (on probation, as above). */
        count(KV_STAT_EXPIRED, 1);
        np.flags = KV_RF_PROBATION;
        kv_pending.update(k, &np);
    } else if (kv_pending.insert(k, &np)) {
        /* another CPU opened a round between our lookup and now: wait in it */
        p = kv_pending.lookup(k);
        if (p && !(p->flags & KV_RF_PROBATION))
            return join_round(p, f, &wk, &w, now, ~0ULL);
    }
    count(KV_STAT_GET_MISS, 1);
    return XDP_PASS;
}

/* Close the chunk's pending round `p` (looked up by the caller): one waiter gets the reply the ordinary way, several get it
 * through a devmap broadcast. The round's generation rides in the frame itself, in the two
 * fields kv_egress rewrites for every copy it lets out (IPv4 destination: its high 32 bits,
 * request id: its low 32), so it never leaves the switch and needs no XDP metadata (which
 * kernels may refuse: bpf_xdp_adjust_meta). */
static __always_inline int release_waiters(struct xdp_md *ctx, struct kv_cache_key *k,
                                           struct kv_pending *p)
{
    __u64 gen = p->gen;
    __u32 waiters = p->waiters;
    __u16 flags = p->flags;
    /* asked once: the reply is that GET's (Karn); a lone round one chunk in KV_ROUND_SAMPLE
     * (the estimate is shared by every CPU: a sample per reply kept its line bouncing) */
    if (!(flags & KV_RF_PROBATION) && (waiters > 1 || k->chunk % KV_ROUND_SAMPLE == 0))
        round_sample(bpf_ktime_get_ns() - p->sent);
    struct kv_waiter_key wk = {};
    wk.chunk = *k;
    wk.ifindex = p->first_ifindex;
    kv_pending.delete(k);
    if (waiters <= 1) {
        if (flags & KV_RF_SHARED)
            kv_waiters.delete(&wk);
        return XDP_PASS;
    }
    void *data = (void *)(long)ctx->data;      /* learning invalidated the frame's pointers */
    void *data_end = (void *)(long)ctx->data_end;
    struct iphdr *ip = data + KV_ETH_LEN;
    struct kvhdr *kv = data + KV_HDR_OFF;
    if ((void *)(kv + 1) > data_end)
        return XDP_DROP;           /* parsed before: cannot happen */
    ip->daddr = bpf_htonl((__u32)(gen >> 32));
    ip->check = 0;
    ip->check = kv_ip_csum(ip);    /* a valid frame: kv_egress parses it as any other */
    kv->req_id = bpf_htonl((__u32)gen);
    count(KV_STAT_REPLICATED, 1);
    return kv_devmap.redirect_map(0, BPF_F_BROADCAST | BPF_F_EXCLUDE_INGRESS);
}
