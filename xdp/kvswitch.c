/* kvswitch.c - the switch's ingress XDP program, attached to every switch port.
 *
 *  - GET whose chunk is cached: the request is rewritten in place into the reply (payload from
 *    kv_cache, room trimmed, addresses swapped, KV_F_FROM_SWITCH set) and sent back with XDP_TX.
 *  - GET_REPLY from a pool-node port for an admitted block: copied into kv_cache as it passes.
 *  - everything else (misses, PUTs, malformed KV frames, non-KV traffic): XDP_PASS, untouched,
 *    so the kernel bridge forwards it.
 */
#include <linux/bpf.h>
#include "kvmaps.h"
#include "parse.h"

BPF_PERCPU_ARRAY(kv_fill_scratch, struct kv_cache_val, 1);

static __always_inline void count(__u32 idx, __u64 n)
{
    __u64 *c = kv_stats.lookup(&idx);
    if (c)
        *c += n;
}

static __always_inline int verdict(int v)
{
    count(KV_STAT_XDP_ABORTED + v, 1);
    return v;
}

/* Helpers taking a size need it proven in [1, KV_CHUNK_MAX] in the very register passed; a
 * 64-bit copy hidden from clang keeps it from range-checking a zero-extended twin instead. */
static __always_inline __u64 opaque_len(__u32 len)
{
    __u64 n = len;
    asm volatile("" : "+r"(n));
    return n;
}

static __always_inline void swap_bytes(__u8 *a, __u8 *b, int n)
{
#pragma unroll
    for (int i = 0; i < 6; i++) {
        if (i < n) {
            __u8 t = a[i];
            a[i] = b[i];
            b[i] = t;
        }
    }
}

/* Turn the GET in ctx into the reply carrying `v`. Returns the XDP verdict. */
static __always_inline int answer_get(struct xdp_md *ctx, struct kv_cache_val *v, __u32 room)
{
    __u32 len = v->len;
    if (len == 0 || len > KV_CHUNK_MAX)
        return XDP_PASS;           /* never happens for entries we wrote; be safe */
    if (len > room) {
        count(KV_STAT_NO_ROOM, 1);
        return XDP_PASS;
    }
    /* 1. drop the unused room (only zeroed bytes go) */
    if (len < room && bpf_xdp_adjust_tail(ctx, (int)len - (int)room))
        return XDP_PASS;

    /* 2. headers again: adjust_tail invalidated the packet pointers */
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    struct kvhdr *kv = (void *)(udp + 1);
    if ((void *)(kv + 1) > data_end)
        return XDP_DROP;           /* cannot happen: the frame only lost trailing room */

    swap_bytes(eth->h_dest, eth->h_source, ETH_ALEN);
    __be32 addr = ip->saddr;
    ip->saddr = ip->daddr;
    ip->daddr = addr;
    ip->ttl = 64;
    ip->tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct udphdr) + KV_HDR_LEN + len);
    ip->check = 0;
    ip->check = kv_ip_csum(ip);
    __be16 port = udp->source;
    udp->source = udp->dest;
    udp->dest = port;
    udp->len = bpf_htons(sizeof(struct udphdr) + KV_HDR_LEN + len);
    udp->check = 0;                /* optional in IPv4; the payload carries its own CRC */
    kv->op = KV_OP_GET_REPLY;
    kv->flags |= bpf_htons(KV_F_FROM_SWITCH);
    kv->status = 0;
    kv->nchunks = bpf_htonl(v->nchunks);
    kv->len = bpf_htons(len);
    kv->csum = bpf_htonl(v->csum);

    /* 3. the payload, from the map value into the room the request carried */
    __u64 n = opaque_len(len);
    if (n < 1 || n > KV_CHUNK_MAX)
        return XDP_DROP;
    if (bpf_xdp_store_bytes(ctx, KV_PAYLOAD_OFF, v->data, n))
        return XDP_DROP;           /* headers already rewritten: never send half a reply */

    __sync_fetch_and_add(&v->hits, 1);
    v->last_hit_ns = bpf_ktime_get_ns();
    count(KV_STAT_GET_HIT, 1);
    count(KV_STAT_HIT_BYTES, len);
    return XDP_TX;
}

static __always_inline void chunk_key(struct kv_cache_key *k, struct kvhdr *kv)
{
    k->ns = bpf_ntohl(kv->ns);
    k->chunk = bpf_ntohl(kv->chunk);
    __builtin_memcpy(k->key, kv->key, sizeof(k->key));
}

static __always_inline int handle_get(struct xdp_md *ctx, struct kv_frame *f)
{
    if (f->kv->flags & bpf_htons(KV_F_NO_CACHE)) {
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    struct kv_cache_key k = {};
    chunk_key(&k, f->kv);
    struct kv_cache_val *v = kv_cache.lookup(&k);
    if (!v) {
        count(KV_STAT_GET_MISS, 1);
        return XDP_PASS;
    }
    return answer_get(ctx, v, f->payload_len);
}

/* A pool node's reply passing through: learn it if its block is admitted. Never alters it. */
static __always_inline void learn_reply(struct xdp_md *ctx, struct kv_frame *f)
{
    struct kvhdr *kv = f->kv;
    if (kv->status != 0 || kv->flags & bpf_htons(KV_F_FROM_SWITCH))
        return;
    struct kv_block_key bk = {};
    bk.ns = bpf_ntohl(kv->ns);
    __builtin_memcpy(bk.key, kv->key, sizeof(bk.key));
    struct kv_admit_val *a = kv_admit.lookup(&bk);
    if (!a)
        return;
    if (a->expires_ns && a->expires_ns < bpf_ktime_get_ns())
        return;
    __u32 ifindex = ctx->ingress_ifindex;
    struct kv_port_cfg *port = kv_ports.lookup(&ifindex);
    if (!port || port->role != KV_ROLE_POOL) {
        count(KV_STAT_FORGED, 1);  /* replies from inference-node ports are never learned */
        return;
    }
    __u64 len = opaque_len(f->payload_len);
    __u32 zero = 0;
    struct kv_cache_val *s = kv_fill_scratch.lookup(&zero);
    if (!s || len < 1 || len > KV_CHUNK_MAX) {
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    s->len = len;
    s->flags = KV_CF_FILLED;
    s->csum = bpf_ntohl(kv->csum);
    s->nchunks = bpf_ntohl(kv->nchunks);
    s->reserved = 0;
    s->hits = 0;
    s->last_hit_ns = bpf_ktime_get_ns();
    struct kv_cache_key k = {};
    chunk_key(&k, kv);             /* read before load_bytes: helpers invalidate packet pointers */
    if (bpf_xdp_load_bytes(ctx, KV_PAYLOAD_OFF, s->data, len) ||
        kv_cache.update(&k, s)) {
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    count(KV_STAT_FILL, 1);
}

int kv_ingress(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct kv_frame f = {};

    count(KV_STAT_PACKETS, 1);
    int r = kv_parse(data, data_end, &f);
    if (r == KV_NOT_KV) {
        count(KV_STAT_NON_KV, 1);
        return verdict(XDP_PASS);
    }
    if (r == KV_BAD) {
        count(KV_STAT_MALFORMED, 1);
        return verdict(XDP_PASS);
    }
    if (f.kv->op == KV_OP_GET && f.udp->dest == bpf_htons(KV_UDP_PORT))
        return verdict(handle_get(ctx, &f));
    if (f.kv->op == KV_OP_GET_REPLY && f.udp->source == bpf_htons(KV_UDP_PORT)) {
        learn_reply(ctx, &f);
        return verdict(XDP_PASS);
    }
    count(KV_STAT_OTHER_KV, 1);
    return verdict(XDP_PASS);
}
