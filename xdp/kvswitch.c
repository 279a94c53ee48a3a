/* kvswitch.c - the switch's ingress XDP program, attached to every switch port.
 *
 *  - GET whose chunk is cached: the request is rewritten in place into the reply (payload from
 *    its kv_cache slot, found through the block index kv_blocks; room trimmed, addresses
 *    swapped, KV_F_FROM_SWITCH set) and sent back with XDP_TX.
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
 *    the copies for ports that did not ask (the round's generation rides in the frame). A NACK closing a round reaches its waiters the same
 *    way (never learned).
 *  - replies (GET_REPLY, PUT_ACK, NACK, ERROR, anything from the KV port) pass only from pool
 *    ports; elsewhere they are dropped and counted.
 *  - port checks, set by switchd per port: a secured port's frames must carry its bound source
 *    (Ethernet source, IPv4 source, ARP sender), one no other port owns (kv_src_macs,
 *    kv_src_ips; docs/security.md); a trunk that owns its sources carries only its own, every
 *    source becoming the trunk's the first time it is seen (KV_PF_SOURCES); a port limited to some namespaces may send only
 *    what the data plane can check (see limited_port_may_pass) and requests of any kind (GET,
 *    PUT, ...) only for its namespaces. Anything else from such a port is dropped and counted.
 *  - everything else (PUTs, malformed KV frames, non-KV traffic): XDP_PASS, untouched, so the
 *    kernel bridge forwards it. PUTs are never learned: the cache fills only from pool replies.
 *
 * The program is this file and three parts it includes, pasted in place when it is compiled
 * (xdp/loader.py): kvswitch_cache.c (hits, misses' demand, learning replies), kvswitch_rounds.c
 * (coalescing: rounds, held GETs, their release to every waiter) and kvswitch_ports.c (tenant
 * isolation and port security). Here: the helpers they share, and the program's entry points.
 */
#include <linux/bpf.h>
#include <linux/if_arp.h>
#include <linux/ipv6.h>
#include "kvmaps.h"
#include "kvslot.h"
#include "parse.h"
#define KV_REPLY_MAX KV_CHUNK
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

/* the parts, in this order: each uses what is above it */
#include "kvswitch_cache.c"
#include "kvswitch_rounds.c"
#include "kvswitch_ports.c"

static __always_inline int handle_get(struct xdp_md *ctx, struct kv_frame *f)
{
    if (f->eth->h_dest[0] & 1) {
        count(KV_STAT_GROUP_DEST, 1);      /* a reply needs the pool node's own MAC */
        return XDP_PASS;
    }
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
    struct kv_pending *p = kv_pending.lookup(&k);
    if (!p) {
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
    return release_waiters(ctx, &k, p);
}

/* A NACK from a pool node passing through: the block or chunk is not there, for whoever asked
 * where the round's GET went, so every waiter of the round gets it (never learned). An ERROR
 * may answer one request's own fault and is not replicated: its round times out. */
static __always_inline int handle_nack(struct xdp_md *ctx, struct kv_frame *f)
{
    struct kv_cache_key k = {};
    chunk_key(&k, f->kv);
    struct kv_pending *p = kv_pending.lookup(&k);
    if (!p)
        return XDP_PASS;
    count(KV_STAT_NACK_CLOSED, 1);
    return release_waiters(ctx, &k, p);
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
        if (port && (port->flags & KV_PF_SOURCES) && !trunk_source_ok(ctx, data, data_end)) {
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
 * joined the round the copy closes (its generation in the frame: release_waiters); every other
 * copy is dropped, so each waiter gets exactly one, and never one of an older round. */
int kv_egress(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct kv_frame f = {};
    if (kv_parse(data, data_end, &f) != KV_OK)
        return XDP_DROP;
    __u64 gen = ((__u64)bpf_ntohl(f.ip->daddr) << 32) | bpf_ntohl(f.kv->req_id);
    struct kv_waiter_key wk = {};
    chunk_key(&wk.chunk, f.kv);
    wk.ifindex = ctx->egress_ifindex;
    struct kv_waiter *w = kv_waiters.lookup(&wk);
    if (!w || w->gen != gen) {
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
