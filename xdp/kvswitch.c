/* kvswitch.c - the switch's ingress XDP program, attached to every switch port.
 *
 *  - GET whose chunk is cached: the request is rewritten in place into the reply (payload from
 *    its kv_cache slot, found through the block index kv_blocks; room trimmed, addresses swapped, KV_F_FROM_SWITCH set) and sent back with XDP_TX.
 *  - GET miss: goes on to the pool node and opens a pending round (an outstanding request). With
 *    coalescing on, GETs for the same chunk from other ports while the round is open are held
 *    (dropped here, remembered in kv_waiters); a waiting port asking again once the reply is due
 *    goes upstream (its GET or the reply may be lost). A round older than the round timeout
 *    (the pending timeout, or longer while replies take longer: a link's queue; measured here)
 *    is asked again and keeps its waiters, and until a reply for its chunk passes nobody more is
 *    held for it (KV_RF_PROBATION). A GET the pool's kernel would drop (reply.h: its UDP
 *    checksum) is forwarded, never held or answered; one from UDP port 0 is dropped.
 *  - GET_REPLY from a pool-node port that answers an open round (on an uplink to another
 *    switch, KV_PF_TRUNK, also one that switch made from its cache): written into its block's
 *    kv_cache slot (kvslot.h's protocol) if its payload matches its CRC and its block is
 *    admitted (or switchd's speculative-fill budget has room: switchd then keeps or evicts it
 *    at its next step); a block with no slots yet gets them from the fill region switchd
 *    granted (carve); if several ports wait for it, broadcast
 *    through kv_devmap, where kv_egress rewrites each copy for the waiter on its port and drops
 *    the copies for ports that did not ask. A NACK closing a round reaches its waiters the same
 *    way (never learned).
 *  - replies (GET_REPLY, PUT_ACK, NACK, ERROR, anything from the KV port) pass only from pool
 *    ports; elsewhere they are dropped and counted.
 *  - port checks, set by switchd per port: a secured port's frames must carry its bound source
 *    (Ethernet source, IPv4 source, ARP sender), one no other port owns (kv_src_macs,
 *    kv_src_ips; docs/security.md); a port limited to some namespaces may send only
 *    what the data plane can check (see limited_port_may_pass) and requests of any kind (GET,
 *    PUT, ...) only for its namespaces. Anything else from such a port is dropped and counted.
 *  - everything else (PUTs, malformed KV frames, non-KV traffic): XDP_PASS, untouched, so the
 *    kernel bridge forwards it. PUTs are never learned: the cache fills only from pool replies.
 */
#include <linux/bpf.h>
#include <linux/if_arp.h>
#include <linux/ipv6.h>
#include "kvmaps.h"
#include "kvslot.h"
#include "parse.h"
#define KV_REPLY_MAX KV_CHUNK_MAX
#include "reply.h"

/* every switch port, with kv_egress as its egress program (filled by switchd) */
BPF_XDP_REDIRECT_MAP("devmap", struct kv_devport, kv_devmap, KV_DEVMAP_SLOTS);

static __always_inline void count(__u32 idx, __u64 n)
{
    __u64 *c = kv_stats.lookup(&idx);
    if (c)
        *c += n;
}

static __always_inline __u64 setting(__u32 idx)
{
    __u64 *v = kv_settings.lookup(&idx);
    return v ? *v : 0;
}

static __always_inline int verdict(int v)
{
    count(KV_STAT_XDP_ABORTED + v, 1);
    return v;
}

/* CRC-32 (IEEE, reflected, as zlib.crc32), sliced: 16 bytes a step through KV_CRC_SLICES
 * tables of 256 entries (table k takes a byte k more zero bytes along; table 0 is the classic
 * byte-at-a-time one), written by switchd when it loads the program (an empty table fails
 * every check, so nothing is learned, never anything wrong). One byte at a time, a 3 KiB reply
 * took 7.6 us here, most of a cold fetch's time through the switch; sliced it takes 1.45
 * (docs/throughput.md). Words are read little-endian, as BPF runs on this host. */
struct kv_crc_table {
    __u32 t[KV_CRC_SLICES * 256];
};
BPF_ARRAY(kv_crc_table, struct kv_crc_table, 1);

/* bytes the tail loop covers: what whole steps leave (fewer when a chunk is that small) */
#define KV_CRC_TAIL (KV_CHUNK_MAX < KV_CRC_SLICES ? KV_CHUNK_MAX : KV_CRC_SLICES)

/* CRC of p[0..len), len <= KV_CHUNK_MAX, p 8-byte aligned. Run only when learning a reply, so
 * what the cache holds always matches its CRC. The loops always run their full counts and keep
 * the CRC of the first len bytes with arithmetic, not a branch on len: a branch would make the
 * verifier walk the rest of the loop once per possible length. The step loop takes the whole
 * 16-byte steps below len; the tail loop then takes the len % 16 bytes after them, one at a
 * time, from a window kept inside p. (Sign-mask idioms such as -(x & 1) or (s64)x >> 63 are
 * avoided on purpose: they crashed this kernel's verifier in maybe_fork_scalars.) */
static __always_inline __u32 crc32_ieee(const struct kv_crc_table *tab, const __u8 *p, __u32 len)
{
    const __u32 *t = tab->t;
    __u32 c = 0xffffffff;
#pragma clang loop unroll(disable)
    for (__u32 i = 0; i < KV_CHUNK_MAX / 16; i++) {
        __u64 w0 = *(const __u64 *)(p + 16 * i), w1 = *(const __u64 *)(p + 16 * i + 8);
        __u32 a = (__u32)w0 ^ c, b = (__u32)(w0 >> 32), e = (__u32)w1, f = (__u32)(w1 >> 32);
        __u32 d = t[15 * 256 + (a & 0xff)] ^ t[14 * 256 + ((a >> 8) & 0xff)] ^
                  t[13 * 256 + ((a >> 16) & 0xff)] ^ t[12 * 256 + (a >> 24)] ^
                  t[11 * 256 + (b & 0xff)] ^ t[10 * 256 + ((b >> 8) & 0xff)] ^
                  t[9 * 256 + ((b >> 16) & 0xff)] ^ t[8 * 256 + (b >> 24)] ^
                  t[7 * 256 + (e & 0xff)] ^ t[6 * 256 + ((e >> 8) & 0xff)] ^
                  t[5 * 256 + ((e >> 16) & 0xff)] ^ t[4 * 256 + (e >> 24)] ^
                  t[3 * 256 + (f & 0xff)] ^ t[2 * 256 + ((f >> 8) & 0xff)] ^
                  t[256 + ((f >> 16) & 0xff)] ^ t[f >> 24];
        __u32 take = (16 * i + 15 - len) >> 31;   /* 1 while all 16 bytes are below len */
        c ^= (c ^ d) * take;
    }
    /* the window's start, 64-bit: a 32-bit one is compared on a zero-extended copy, and the
     * verifier cannot carry that bound back to the register that addresses p */
    __u32 whole = len & ~15u;
    __u64 base = whole;
    if (base > KV_CHUNK_MAX - KV_CRC_TAIL)
        base = KV_CHUNK_MAX - KV_CRC_TAIL;
#pragma clang loop unroll(disable)
    for (__u32 j = 0; j < KV_CRC_TAIL; j++) {
        __u32 pos = base + j;
        __u32 d = (c >> 8) ^ t[(c ^ p[base + j]) & 0xff];
        __u32 take = ((pos - len) >> 31) & ((whole - 1 - pos) >> 31);  /* whole <= pos < len */
        c ^= (c ^ d) * take;
    }
    return ~c;
}

static __always_inline struct kv_ns_stats *ns_stats(__u32 ns)
{
    if (ns < KV_NS_LOW)
        return kv_ns_low.lookup(&ns);
    struct kv_ns_stats *st = kv_ns_stats.lookup(&ns);
    if (st)
        return st;
    struct kv_ns_stats zero = {};
    kv_ns_stats.update(&ns, &zero);
    return kv_ns_stats.lookup(&ns);
}

static __always_inline __u64 le64(const __u8 *b)
{
    __u64 x = 0;
#pragma unroll
    for (int i = 7; i >= 0; i--)
        x = (x << 8) | b[i];
    return x;
}

static __always_inline void sketch_add(__u32 row, __u64 a, __u64 b, __u64 x)
{
    struct kv_sketch_row *r = kv_sketch.lookup(&row);
    if (r) {
        __u32 col = ((a * x + b) >> (64 - KV_SKETCH_BITS)) & (KV_SKETCH_WIDTH - 1);
        if (r->c[col] != 0xffffffff)
            r->c[col]++;
    }
}

static __always_inline void block_key(struct kv_block_key *bk, const struct kv_cache_key *k)
{
    bk->ns = k->ns;
    __builtin_memcpy(bk->key, k->key, sizeof(bk->key));
}

/* A miss: demand for the block goes into the sketch (once per fetch: on chunk 0). */
static __always_inline void count_miss(struct kv_cache_key *k)
{
    struct kv_ns_stats *st = ns_stats(k->ns);
    if (st)
        st->misses++;
    if (k->chunk != 0)
        return;
    __u64 x = le64(k->key) ^ (le64(k->key + 8) * KV_SKETCH_HI_MUL) ^
              ((__u64)k->ns * KV_SKETCH_NS_MUL);
    sketch_add(0, KV_SKETCH_A0, KV_SKETCH_B0, x);
    sketch_add(1, KV_SKETCH_A1, KV_SKETCH_B1, x);
    sketch_add(2, KV_SKETCH_A2, KV_SKETCH_B2, x);
    sketch_add(3, KV_SKETCH_A3, KV_SKETCH_B3, x);
    struct kv_block_key bk = {};
    block_key(&bk, k);
    struct kv_recent *rec = kv_recent.lookup(&bk);
    if (rec) {
        rec->last_ns = bpf_ktime_get_ns();
    } else {
        struct kv_recent fresh = {};
        fresh.last_ns = bpf_ktime_get_ns();
        kv_recent.update(&bk, &fresh);
    }
}

/* k's slot, if its block has slots and the one for k holds k's chunk, finished (kvslot.h);
 * *seq: the slot's sequence word as read, for the check after the copy. */
static __always_inline struct kv_cache_val *cached(struct kv_cache_key *k, __u64 *seq)
{
    struct kv_block_key bk = {};
    block_key(&bk, k);
    struct kv_block *b = kv_blocks.lookup(&bk);
    if (!b)
        return 0;
    __u32 gen = b->gen, idx = b->base + k->chunk;
    if (k->chunk >= b->slots)
        return 0;
    struct kv_cache_val *v = kv_cache.lookup(&idx);
    if (!v)
        return 0;
    __u64 q = kv_slot_seq(v);
    if (!kv_slot_holds(v, q, gen, k)) {
        if ((q & 1) || (v->gen == gen && v->len))  /* being written, or for another chunk */
            count(KV_STAT_REUSED, 1);
        return 0;                  /* else not filled yet: a plain miss */
    }
    *seq = q;
    return v;
}

/* Turn the GET in ctx into the reply carrying slot `v`, found for `k` at sequence `seq`.
 * Returns the XDP verdict. */
static __always_inline int answer_get(struct xdp_md *ctx, struct kv_cache_val *v,
                                      struct kv_cache_key *k, __u64 seq, __u32 room)
{
    __u32 ns = k->ns;
    __u32 len = v->len;
    if (len == 0 || len > KV_CHUNK_MAX)
        return XDP_PASS;           /* never happens for slots we wrote; be safe */
    if (len > room) {
        count(KV_STAT_NO_ROOM, 1);
        return XDP_PASS;
    }
    int r = kv_reply_in_place(ctx, v->data, len, v->nchunks, v->csum, 0xffff,
                              bpf_htons(KV_F_FROM_SWITCH));
    if (r != XDP_TX)
        return r;
    if (kv_slot_seq(v) != seq) {   /* written again (for another chunk?) while we copied */
        count(KV_STAT_REUSED, 1);
        return XDP_DROP;           /* the asker retransmits */
    }

    v->hits++;                     /* not atomic: a popularity count may lose a concurrent hit */
    count(KV_STAT_GET_HIT, 1);
    count(KV_STAT_HIT_BYTES, len);
    struct kv_ns_stats *st = ns_stats(ns);
    if (st) {
        st->hits++;
        st->hit_bytes += len;
    }
    return XDP_TX;
}

static __always_inline void chunk_key(struct kv_cache_key *k, struct kvhdr *kv)
{
    k->ns = bpf_ntohl(kv->ns);
    k->chunk = bpf_ntohl(kv->chunk);
    __builtin_memcpy(k->key, kv->key, sizeof(k->key));
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
    return *(const __u32 *)a == *(const __u32 *)b && *(const __u16 *)(a + 4) == *(const __u16 *)(b + 4);
}

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

/* Put the waiter `w` of port `wk` into round `p`: a port already waiting in it has its request
 * id updated (the same asker again: answer its latest request), a new one is counted. Returns
 * whether the port was already waiting. */
static __always_inline int add_waiter(struct kv_pending *p, struct kv_waiter_key *wk,
                                      struct kv_waiter *w, __u32 coalesced)
{
    struct kv_waiter *old = kv_waiters.lookup(wk);
    if (old && old->gen == p->gen) {
        old->req_id = w->req_id;
        return 1;
    }
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
    struct kv_waiter *old = kv_waiters.lookup(wk);
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
    if (!setting(KV_SET_COALESCE)) {
        struct kv_pending open = {};   /* outstanding, so its reply may be learned; no holding */
        open_round(&open, f, now, ctx->ingress_ifindex);
        kv_pending.update(k, &open);
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    struct kv_waiter_key wk = {};
    wk.chunk = *k;
    wk.ifindex = ctx->ingress_ifindex;
    struct kv_waiter w = {};
    __builtin_memcpy(w.mac, f->eth->h_source, ETH_ALEN);
    w.ip = f->ip->saddr;
    w.port = f->udp->source;
    w.req_id = f->kv->req_id;

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
    if (!p) {
        /* No round open: maybe one just closed on another CPU, whose reply was learned before
         * the round was deleted. Look again rather than send a needless request upstream. */
        __u64 seq;
        struct kv_cache_val *v = cached(k, &seq);
        if (v)
            return answer_get(ctx, v, k, seq, f->payload_len);
    }
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
    w.gen = now;
    kv_waiters.update(&wk, &w);
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

/* Tenant isolation: a port limited to some namespaces never gets (or causes) anything else. */
static __always_inline int ns_allowed(struct xdp_md *ctx, struct kv_port_cfg *port, __u32 ns)
{
    if (!port || !(port->flags & KV_PF_NS_LIMITED))
        return 1;
    __u32 n = port->nns;
    if (n <= KV_PORT_NS_INLINE) {      /* the usual case: a few tenants, no second lookup */
#pragma unroll
        for (int i = 0; i < KV_PORT_NS_INLINE; i++)
            if (i < n && port->ns[i] == ns)
                return 1;
        return 0;
    }
    struct kv_port_ns_key pk = {};
    pk.ifindex = ctx->ingress_ifindex;
    pk.ns = ns;
    return kv_port_ns.lookup(&pk) != 0;
}

/* What a limited port may send besides valid KV requests for its namespaces: frames that cannot
 * be KV requests in disguise. ARP; IPv4 without options, unfragmented, and not UDP to the KV port
 * (those parse as KV, valid or not); IPv6 whose next header is TCP, ICMPv6, or UDP not to the KV
 * port. VLAN tags, IP options and fragments, IPv6 extension headers, other protocols and invalid
 * KV frames are dropped: a pool node's stack would strip or reassemble them and answer. */
static __always_inline int limited_port_may_pass(void *data, void *data_end, int parsed)
{
    struct ethhdr *eth = data;
    if (parsed != KV_NOT_KV || (void *)(eth + 1) > data_end)
        return 0;
    if (eth->h_proto == bpf_htons(ETH_P_ARP))
        return 1;
    if (eth->h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = (void *)(eth + 1);
        return (void *)(ip + 1) <= data_end && ip->ihl == 5 && !(ip->frag_off & bpf_htons(0x3fff));
    }
    if (eth->h_proto != bpf_htons(ETH_P_IPV6))
        return 0;
    struct ipv6hdr *ip6 = (void *)(eth + 1);
    if ((void *)(ip6 + 1) > data_end)
        return 0;
    if (ip6->nexthdr == IPPROTO_TCP || ip6->nexthdr == IPPROTO_ICMPV6)
        return 1;
    struct udphdr *udp = (void *)(ip6 + 1);
    return ip6->nexthdr == IPPROTO_UDP && (void *)(udp + 1) <= data_end &&
           udp->dest != bpf_htons(KV_UDP_PORT);
}

static __always_inline __u64 mac_key(const __u8 *mac)
{
    __u64 k = 0;
    __builtin_memcpy(&k, mac, ETH_ALEN);
    return k;
}

/* Whether a source is bound to a port other than `ifindex` (kv_src_macs, kv_src_ips). */
static __always_inline int mac_taken(__u64 mac, __u32 ifindex)
{
    __u32 *owner = kv_src_macs.lookup(&mac);
    return owner && *owner != ifindex;
}

static __always_inline int ip_taken(__be32 ip, __u32 ifindex)
{
    __u32 *owner = kv_src_ips.lookup(&ip);
    return owner && *owner != ifindex;
}

/* Bind an unbound secured port to (mac, ip), unless another port owns either: the owner entries
 * are claimed first (an insert that fails means someone else has it), then the port's config.
 * Runs once per port (or once after an operator's relearn), never on the hit path. */
static __always_inline int bind_port(struct kv_port_cfg *port, __u32 ifindex, const __u8 *src,
                                     __be32 ip)
{
    if (__sync_fetch_and_or(&port->flags, KV_PF_BINDING) & KV_PF_BINDING)
        return 0;                  /* another CPU is binding it right now */
    __u64 mk = mac_key(src);
    int ok = 0;
    if (kv_src_macs.insert(&mk, &ifindex) && mac_taken(mk, ifindex)) {
        count(KV_STAT_SRC_TAKEN, 1);
    } else if (kv_src_ips.insert(&ip, &ifindex) && ip_taken(ip, ifindex)) {
        count(KV_STAT_SRC_TAKEN, 1);
        __u32 *owner = kv_src_macs.lookup(&mk);
        if (owner && *owner == ifindex)
            kv_src_macs.delete(&mk);
    } else {
        __builtin_memcpy(port->mac, src, ETH_ALEN);
        port->ip = ip;
        __sync_fetch_and_or(&port->flags, KV_PF_BOUND);
        count(KV_STAT_SRC_LEARNED, 1);
        ok = 1;
    }
    __sync_fetch_and_and(&port->flags, ~(__u64)KV_PF_BINDING);
    return ok;
}

/* Port security: a secured port's frames carry its bound source, or are dropped; every frame
 * type is checked (its Ethernet source; an ARP's sender too; an IPv4 packet's source too). A
 * port whose source switchd left unset binds to the source of its first ARP or IPv4 frame with a
 * sender address, unless another port owns that MAC or address (a pool port is bound before any
 * frame is seen); until then its frames pass only if their sources belong to nobody else. The
 * binding is sticky: only the operator unbinds a port (switchd port relearn). */
static __always_inline int source_ok(struct xdp_md *ctx, struct kv_port_cfg *port, void *data,
                                     void *data_end)
{
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end || (eth->h_source[0] & 1))
        return 0;                  /* no frame comes from a group address */
    __be32 ip = 0;
    int learnable = 0;
    if (eth->h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *iph = (void *)(eth + 1);
        if ((void *)(iph + 1) > data_end)
            return 0;
        ip = iph->saddr;
        learnable = 1;
    } else if (eth->h_proto == bpf_htons(ETH_P_ARP)) {
        struct arphdr *arp = (void *)(eth + 1);
        __u8 *sha = (void *)(arp + 1);
        if ((void *)(sha + ETH_ALEN + 4) > data_end || arp->ar_hln != ETH_ALEN ||
            arp->ar_pln != 4 || !mac_eq(sha, eth->h_source))
            return 0;              /* an ARP sender other than the frame's source: a spoof */
        __builtin_memcpy(&ip, sha + ETH_ALEN, 4);
        learnable = 1;             /* address probes (sender 0.0.0.0) are checked, not learned */
    } else if (eth->h_proto == bpf_htons(ETH_P_8021Q) || eth->h_proto == bpf_htons(ETH_P_8021AD)) {
        return 0;                  /* the inner source cannot be checked here */
    }
    if (port->flags & KV_PF_BOUND) {
        if (!mac_eq(eth->h_source, port->mac))
            return 0;
        if (eth->h_proto == bpf_htons(ETH_P_IP))
            return ip == port->ip;
        return eth->h_proto != bpf_htons(ETH_P_ARP) || ip == port->ip || !ip;
    }
    if (port->flags & KV_PF_BINDING)
        return 0;                  /* another CPU is binding the port right now */
    __u32 ifindex = ctx->ingress_ifindex;
    __u64 mk = mac_key(eth->h_source);
    if (mac_taken(mk, ifindex) || (ip && ip_taken(ip, ifindex))) {
        count(KV_STAT_SRC_TAKEN, 1);
        return 0;                  /* another port's source: never passed, never learned */
    }
    if (!learnable || !ip)
        return 1;                  /* nothing to bind to yet (IPv6, a probe): its MAC is free */
    return bind_port(port, ifindex, eth->h_source, ip);
}

static __always_inline int handle_get(struct xdp_md *ctx, struct kv_frame *f)
{
    if (!kv_get_answerable(f)) {
        count(KV_STAT_PORT_ZERO, 1);       /* no reply can reach UDP port 0: nobody waits for one */
        return XDP_DROP;
    }
    if (!kv_get_udp_csum_ok(f)) {
        count(KV_STAT_BAD_UDP_CSUM, 1);    /* the pool node's stack decides: never held here */
        return XDP_PASS;
    }
    if (f->kv->flags & bpf_htons(KV_F_NO_CACHE)) {
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    struct kv_cache_key k = {};
    chunk_key(&k, f->kv);
    __u64 seq;
    struct kv_cache_val *v = cached(&k, &seq);
    if (!v)
        return hold_or_forward(ctx, f, &k);
    return answer_get(ctx, v, &k, seq, f->payload_len);
}

/* Slots for a block of n chunks that has none: n of them, or as many as are left (its first
 * chunks: the ones every fetch starts with), from the fill region switchd granted (kv_settings
 * KV_SET_FILL_NEXT..KV_SET_FILL_END), under a new data-plane generation. switchd owns the
 * allocator: it grants the region, takes what was carved into its books from kv_blocks, and
 * never hands out what the index or the region holds. If two CPUs carve for the same block,
 * one index entry wins and the other range is left for switchd to take back. */
static __always_inline struct kv_block *carve(struct kv_block_key *bk, __u32 n)
{
    __u32 ni = KV_SET_FILL_NEXT, ei = KV_SET_FILL_END, gi = KV_SET_DP_GEN;
    __u64 *next = kv_settings.lookup(&ni), *end = kv_settings.lookup(&ei);
    __u64 *gens = kv_settings.lookup(&gi);
    if (!next || !end || !gens || n == 0 || n > KV_CACHE_ENTRIES)
        return 0;
    __u64 e = *(volatile __u64 *)end, at = *(volatile __u64 *)next;
    if (at >= e)
        return 0;                  /* the region is used up until switchd grants another */
    __u64 want = e - at < n ? e - at : n;
    __u64 base = __sync_fetch_and_add(next, want);
    if (base + want > e)
        return 0;                  /* another CPU carved it first */
    struct kv_block nb = {};
    nb.base = base;
    nb.nchunks = n;
    nb.slots = want;
    nb.gen = KV_GEN_DATAPLANE | (__u32)__sync_fetch_and_add(gens, 1);
    kv_blocks.insert(bk, &nb);
    return kv_blocks.lookup(bk);
}

/* Write a pool reply's payload into its slot if its block is admitted. Leaves the frame as it
 * was, but invalidates packet pointers. */
static __always_inline void learn_reply(struct xdp_md *ctx, struct kv_frame *f,
                                        struct kv_cache_key *k)
{
    struct kvhdr *kv = f->kv;
    struct kv_block_key bk = {};
    block_key(&bk, k);
    struct kv_admit_val *a = kv_admit.lookup(&bk);
    __u16 flags = KV_CF_FILLED;
    if (a && a->expires_ns && a->expires_ns < bpf_ktime_get_ns())
        return;
    if (!a) {
        __u64 share_n = setting(KV_SET_SHARE_N);
        if (share_n > 1 && le64(k->key) % share_n != setting(KV_SET_SHARE_K))
            return;                /* another switch's share of the hot set */
        /* Not admitted: learn it anyway while switchd's speculative budget lasts, so a block
         * is cached from its first miss and switchd decides at its next step whether it stays
         * (as an offline policy would on the miss itself) instead of waiting for a second. */
        __u32 idx = KV_SET_SPEC_FILL;
        __s64 *budget = (__s64 *)kv_settings.lookup(&idx);
        if (!budget || *budget <= 0 || __sync_fetch_and_add(budget, -1) <= 0)
            return;
        flags |= KV_CF_SPECULATIVE;
    }
    __u64 len = kv_opaque_len(f->payload_len);
    __u32 nchunks = bpf_ntohl(kv->nchunks), csum = bpf_ntohl(kv->csum);
    struct kv_block *b = kv_blocks.lookup(&bk);
    if (!b)
        b = carve(&bk, nchunks);
    if (!b || len < 1 || len > KV_CHUNK_MAX || b->nchunks != nchunks || k->chunk >= b->slots) {
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    __u32 gen = b->gen, idx = b->base + k->chunk;
    struct kv_cache_val *s = kv_cache.lookup(&idx);
    if (!s || !kv_slot_claim(s)) {     /* being written by someone else right now */
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    s->len = 0;                        /* empty until the payload is in and checked */
    __u32 zero = 0;
    struct kv_crc_table *tab = kv_crc_table.lookup(&zero);
    if (bpf_xdp_load_bytes(ctx, KV_PAYLOAD_OFF, s->data, len)) {
        s->gen = 0;
        kv_slot_release(s);
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    if (!tab || crc32_ieee(tab, s->data, len) != csum) {
        s->gen = 0;
        kv_slot_release(s);
        count(KV_STAT_FILL_CORRUPT, 1);  /* never cache bytes that fail their own checksum */
        return;
    }
    kv_slot_label(s, gen, len, flags, csum, nchunks, k, bpf_ktime_get_ns());
    __u16 stored = s->flags;           /* not `flags`: a register live across the CRC loop
                                          would double the states the verifier walks */
    kv_slot_release(s);
    count(KV_STAT_FILL, 1);
    if (stored & KV_CF_SPECULATIVE)
        count(KV_STAT_SPEC_FILL, 1);
}

/* Close the chunk's pending round: one waiter gets the reply the ordinary way, several get it
 * through a devmap broadcast carrying the round's generation in XDP metadata. */
static __always_inline int release_waiters(struct xdp_md *ctx, struct kv_cache_key *k)
{
    struct kv_pending *p = kv_pending.lookup(k);
    if (!p)
        return XDP_PASS;
    if (!(p->flags & KV_RF_PROBATION))  /* asked once: the reply is that GET's (Karn) */
        round_sample(bpf_ktime_get_ns() - p->sent);
    __u64 gen = p->gen;
    __u32 waiters = p->waiters;
    struct kv_waiter_key wk = {};
    wk.chunk = *k;
    wk.ifindex = p->first_ifindex;
    kv_pending.delete(k);
    if (waiters <= 1) {
        kv_waiters.delete(&wk);
        return XDP_PASS;
    }
    if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(struct kv_meta)))
        return XDP_PASS;           /* the first asker still gets it; the others retransmit */
    void *data = (void *)(long)ctx->data;
    struct kv_meta *meta = (void *)(long)ctx->data_meta;
    if ((void *)(meta + 1) > data)
        return XDP_PASS;
    meta->gen = gen;
    count(KV_STAT_REPLICATED, 1);
    return kv_devmap.redirect_map(0, BPF_F_BROADCAST | BPF_F_EXCLUDE_INGRESS);
}

/* A reply from a pool port passing through (kv_ingress drops replies from other ports): learn
 * it, then hand it to whoever waits. On an uplink (KV_PF_TRUNK) a reply the switch above made
 * from its cache answers the round as the pool node's would; it reaches the waiters marked
 * KV_F_REPLICA too: it crossed links at the network's pace, not within the asker's call. */
static __always_inline int handle_reply(struct xdp_md *ctx, struct kv_frame *f,
                                        struct kv_port_cfg *port)
{
    struct kvhdr *kv = f->kv;
    if (kv->status != 0)
        return XDP_PASS;
    if (kv->flags & bpf_htons(KV_F_FROM_SWITCH)) {
        if (!(port->flags & KV_PF_TRUNK))
            return XDP_PASS;
        kv->flags |= bpf_htons(KV_F_REPLICA);
        f->udp->check = 0;         /* optional in IPv4; the payload carries its own CRC */
    }
    struct kv_cache_key k = {};
    chunk_key(&k, kv);
    if (!kv_pending.lookup(&k)) {
        count(KV_STAT_UNSOLICITED, 1);  /* nobody asked through this switch: never learned */
        return XDP_PASS;
    }
    if (k.chunk == 0) {            /* tell switchd how large a recently missed block is */
        struct kv_block_key bk = {};
        block_key(&bk, &k);
        struct kv_recent *rec = kv_recent.lookup(&bk);
        if (rec)
            rec->nchunks = bpf_ntohl(kv->nchunks);
    }
    learn_reply(ctx, f, &k);
    return release_waiters(ctx, &k);
}

/* A NACK from a pool node passing through: the block or chunk is not there, for whoever asked
 * where the round's GET went, so every waiter of the round gets it (never learned). An ERROR
 * may answer one request's own fault and is not replicated: its round times out. */
static __always_inline int handle_nack(struct xdp_md *ctx, struct kv_frame *f)
{
    struct kv_cache_key k = {};
    chunk_key(&k, f->kv);
    if (!kv_pending.lookup(&k))
        return XDP_PASS;
    count(KV_STAT_NACK_CLOSED, 1);
    return release_waiters(ctx, &k);
}

/* Whether a KV frame (parsed, or KV_BAD: its UDP header was read) is or may be a reply: it comes
 * from the KV port, or its op is one only a pool node sends. GETs (the hit path) are neither. */
static __always_inline int may_be_reply(struct kv_frame *f, int parsed)
{
    if (f->udp->source == bpf_htons(KV_UDP_PORT))
        return 1;
    if (parsed != KV_OK)
        return 0;
    __u8 op = f->kv->op;
    return op == KV_OP_GET_REPLY || op == KV_OP_PUT_ACK || op == KV_OP_NACK || op == KV_OP_ERROR;
}

/* The config of the port the frame came in on (`port`: if already looked up) if it is a pool
 * port, else NULL. */
static __always_inline struct kv_port_cfg *pool_port(struct xdp_md *ctx,
                                                     struct kv_port_cfg *port)
{
    if (!port) {
        __u32 ifindex = ctx->ingress_ifindex;
        port = kv_ports.lookup(&ifindex);
    }
    return port && port->role == KV_ROLE_POOL ? port : 0;
}

int kv_ingress(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct kv_frame f = {};

    count(KV_STAT_PACKETS, 1);
    struct kv_port_cfg *port = 0;
    __u32 ifindex = ctx->ingress_ifindex;
    __u32 *clear = kv_port_clear.lookup(&ifindex);   /* NULL past the array: look it up */
    if (setting(KV_SET_PORT_CHECKS) && !(clear && *clear)) {  /* spare the hit path a lookup */
        port = kv_ports.lookup(&ifindex);
        if (port && (port->flags & KV_PF_SECURED) && !source_ok(ctx, port, data, data_end)) {
            count(KV_STAT_SPOOFED, 1);
            return verdict(XDP_DROP);
        }
    }
    int r = kv_parse(data, data_end, &f);
    if (r != KV_NOT_KV && may_be_reply(&f, r)) {
        port = pool_port(ctx, port);
        if (!port) {
            count(KV_STAT_NOT_FROM_POOL, 1);   /* replies come from pool nodes, nowhere else */
            return verdict(XDP_DROP);
        }
    }
    if (r != KV_OK && port && (port->flags & KV_PF_NS_LIMITED) &&
        !limited_port_may_pass(data, data_end, r)) {
        count(KV_STAT_UNCHECKED, 1);
        return verdict(XDP_DROP);
    }
    if (r == KV_NOT_KV) {
        count(KV_STAT_NON_KV, 1);
        return verdict(XDP_PASS);
    }
    if (r == KV_BAD) {
        count(KV_STAT_MALFORMED, 1);
        return verdict(XDP_PASS);
    }
    if (f.udp->dest == bpf_htons(KV_UDP_PORT) && !ns_allowed(ctx, port, bpf_ntohl(f.kv->ns))) {
        count(KV_STAT_DENIED, 1);  /* any request (GET, PUT, ...) outside the port's tenants */
        return verdict(XDP_DROP);
    }
    if (f.kv->op == KV_OP_GET && f.udp->dest == bpf_htons(KV_UDP_PORT))
        return verdict(handle_get(ctx, &f));
    if (f.kv->op == KV_OP_GET_REPLY && f.udp->source == bpf_htons(KV_UDP_PORT) && port)
        return verdict(handle_reply(ctx, &f, port));
    if (f.kv->op == KV_OP_NACK && f.udp->source == bpf_htons(KV_UDP_PORT))
        return verdict(handle_nack(ctx, &f));
    count(KV_STAT_OTHER_KV, 1);
    return verdict(XDP_PASS);
}

/* Devmap egress program: runs on each copy of a broadcast reply as it leaves a port. The copy
 * goes out rewritten for the waiter on that port (MAC, IP, UDP port, request id) if that waiter
 * joined this round; every other copy is dropped, so each waiter gets exactly one. */
int kv_egress(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct kv_meta *meta = (void *)(long)ctx->data_meta;
    struct kv_frame f = {};
    if ((void *)(meta + 1) > data || kv_parse(data, data_end, &f) != KV_OK)
        return XDP_DROP;
    struct kv_waiter_key wk = {};
    chunk_key(&wk.chunk, f.kv);
    wk.ifindex = ctx->egress_ifindex;
    struct kv_waiter *w = kv_waiters.lookup(&wk);
    if (!w || w->gen != meta->gen) {
        count(KV_STAT_REPLICA_SKIP, 1);
        return XDP_DROP;
    }
    __builtin_memcpy(f.eth->h_dest, w->mac, ETH_ALEN);
    f.ip->daddr = w->ip;
    f.ip->check = 0;
    f.ip->check = kv_ip_csum(f.ip);
    f.udp->dest = w->port;
    f.udp->check = 0;
    f.kv->req_id = w->req_id;
    if (w->coalesced)
        f.kv->flags |= bpf_htons(KV_F_REPLICA);
    kv_waiters.delete(&wk);
    count(KV_STAT_REPLICAS, 1);
    return XDP_PASS;
}
