/* kvfetch.c - the inference node's block fetch engine in XDP (hostagent/inference/fetch drives it).
 *
 * Attached natively to the node's interface in place of the XDP_PASS program a veth end needs
 * anyway, it receives: a GET_REPLY addressed to the engine's UDP port that answers a chunk of an
 * active transfer (request id = transfer index << 24 | 24-bit generation, both drawn at random
 * per transfer by the driver; sent from the MAC, IPv4 address and UDP port the transfer's GETs
 * went to, to the engine's MAC and address; namespace, key, chunk index, chunk count and payload
 * length all as the transfer expects) is copied straight into the transfer's slot of kvf_arena,
 * an mmapable array Python views with numpy; the slot's word in kvf_meta (also mmapable) then
 * gets the payload's CRC, the generation and the reply flags, and the transfer's received count
 * goes up. NACK/ERROR for an active transfer set its status. Every frame to the engine's port is
 * dropped (nothing else listens there); bad or stale ones are counted, never written. Everything
 * else passes untouched. The program never transmits: it returns XDP_PASS or XDP_DROP for every
 * frame, so nothing that arrives can make it send. The engine sends its GETs from userspace in
 * batches (hostagent/common/packet_ring.py).
 *
 * Slot word (kvf_meta, u64): bits 0-31 the CRC-32 the reply carried, 32-55 the generation of the
 * transfer that wrote it, 56-63 the low 8 bits of the reply's flags (FROM_SWITCH, REPLICA). A
 * slot holds a received chunk of transfer T iff bits 32-55 equal T's generation; Python clears
 * the word (one aligned 64-bit store, never a read-modify-write shared with this program) to ask
 * for a chunk again after a CRC failure. The arena's and the slot words' sizes are the maps'
 * (chosen by the engine when it creates them), not compiled in: a lookup past them finds nothing.
 *
 * Constants and structs are in kvfetch.h, the maps in kvfetch_maps.h (katran's consts/structs/maps
 * split, as the switch's kvswitch.h/kvmaps.h).
 */
#include <linux/bpf.h>
#include "parse.h"
#include "verifier.h"
#include "kvfetch_maps.h"

static __always_inline void count(__u32 idx)
{
    __u64 *c = kvf_stats.lookup(&idx);
    if (c)
        *c += 1;
}

static __always_inline int mac_equal(const __u8 *a, const __u8 *b)
{
    return *(const __u32 *)a == *(const __u32 *)b &&
           *(const __u16 *)(a + 4) == *(const __u16 *)(b + 4);
}

/* A reply comes from where its GET went: the switch answers a hit in the pool node's name (its
 * reply swaps the GET's addresses, reply.h; a replica keeps the pool's source), so the pool
 * node's (or its gateway's) MAC, its IPv4 address and port, to the engine's MAC and address. */
static __always_inline int from_route(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp,
                                      const struct kv_fetch_route *r)
{
    return mac_equal(eth->h_source, r->hdr + KV_FETCH_R_DMAC) &&
           mac_equal(eth->h_dest, r->hdr + KV_FETCH_R_SMAC) &&
           ip->saddr == *(const __be32 *)(r->hdr + KV_FETCH_R_DADDR) &&
           ip->daddr == *(const __be32 *)(r->hdr + KV_FETCH_R_SADDR) &&
           udp->source == *(const __be16 *)(r->hdr + KV_FETCH_R_DPORT);
}

static __always_inline int key_equal(const __u8 *a, const __u8 *b)
{
    const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
    return x[0] == y[0] && x[1] == y[1];
}

/* ---- receiver ------------------------------------------------------------------------------- */
static __always_inline int lossy(struct kv_fetch_ctl *c)
{
    return c->loss_ppm && bpf_get_prandom_u32() % 1000000 < c->loss_ppm;
}

static __always_inline int bad(struct kv_fetch_xfer *x, __u32 stat)
{
    __sync_fetch_and_add(&x->bad, 1);
    count(stat);
    return XDP_DROP;
}

static __always_inline int receive(struct xdp_md *ctx, struct kv_fetch_ctl *c)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    struct kv_frame f = {};
    if ((void *)(udp + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 ||
        ip->protocol != IPPROTO_UDP || udp->dest != (__be16)c->port) {
        /* not for the engine; the loss injector this program stands in for drops KV frames */
        if (c->loss_ppm && kv_parse(data, data_end, &f) == KV_OK && lossy(c)) {
            count(KV_FETCH_STAT_LOSS);
            return XDP_DROP;
        }
        count(KV_FETCH_STAT_PASSED);
        return XDP_PASS;
    }
    if (kv_parse(data, data_end, &f) != KV_OK) {
        count(KV_FETCH_STAT_MALFORMED);
        return XDP_DROP;
    }
    if (lossy(c)) {
        count(KV_FETCH_STAT_LOSS);
        return XDP_DROP;
    }
    struct kvhdr *kv = f.kv;
    __u32 rid = bpf_ntohl(kv->req_id);
    __u32 xi = rid >> 24, gen = rid & KV_FETCH_GEN_MASK;
    struct kv_fetch_xfer *x = kvf_xfers.lookup(&xi);
    if (!x || !gen || x->gen != gen) {
        count(KV_FETCH_STAT_STALE);
        return XDP_DROP;
    }
    __u32 ri = x->route & 0xffff;
    struct kv_fetch_route *r = kvf_routes.lookup(&ri);
    if (!r || !from_route(f.eth, f.ip, f.udp, r)) {
        count(KV_FETCH_STAT_WRONG_SOURCE);   /* not counted in x->bad: anyone may send it */
        return XDP_DROP;
    }
    if (x->ns != bpf_ntohl(kv->ns) || !key_equal(x->key, kv->key))
        return bad(x, KV_FETCH_STAT_WRONG_BLOCK);
    if (kv->op == KV_OP_NACK || kv->op == KV_OP_ERROR) {
        x->err = bpf_ntohs(kv->status);
        /* racing NACKs set the same bits */
        x->status |= kv->op == KV_OP_NACK ? KV_FETCH_XS_NACK : KV_FETCH_XS_ERROR;
        count(KV_FETCH_STAT_NACK);
        return XDP_DROP;
    }
    if (kv->op != KV_OP_GET_REPLY || kv->status != 0) {
        count(KV_FETCH_STAT_OTHER_OP);
        return XDP_DROP;
    }
    __u32 chunk = bpf_ntohl(kv->chunk);
    __u32 said = bpf_ntohl(kv->nchunks);
    __u32 n = x->nchunks;
    if (n == 0) {                  /* block size unknown: the first fetch asks for chunk 0 only */
        if (chunk != 0 || said == 0)
            return bad(x, KV_FETCH_STAT_BAD_CHUNK);
        x->seen_nchunks = said;
        n = said;
    } else if (said != n) {
        x->status |= KV_FETCH_XS_NCHUNKS;
        x->seen_nchunks = said;
        return bad(x, KV_FETCH_STAT_BAD_CHUNK);
    }
    if (chunk >= n || chunk >= x->nslots)
        return bad(x, KV_FETCH_STAT_BAD_CHUNK);
    __u32 len = f.payload_len;
    int last = chunk + 1 == n;
    if (last ? (len < 1 || len > KV_CHUNK) : len != KV_CHUNK)
        return bad(x, KV_FETCH_STAT_BAD_LEN);
    __u32 slot = x->base + chunk;
    __u64 *m = kvf_meta.lookup(&slot);
    struct kv_fetch_slot *s = kvf_arena.lookup(&slot);
    if (!m || !s) {                /* past the arena: the driver never reserves that */
        count(KV_FETCH_STAT_LOAD_FAIL);
        return XDP_DROP;
    }
    if (((*m >> 32) & KV_FETCH_GEN_MASK) == gen) {
        count(KV_FETCH_STAT_DUPLICATE);  /* never rewrite a chunk Python may have checked */
        return XDP_DROP;
    }
    __u64 crc = bpf_ntohl(kv->csum);
    __u64 tag = gen | ((__u64)(bpf_ntohs(kv->flags) & 0xff) << 24);
    __u64 n64 = kv_opaque_len(len);
    if (n64 < 1 || n64 > KV_CHUNK || bpf_xdp_load_bytes(ctx, KV_PAYLOAD_OFF, s->b, n64)) {
        count(KV_FETCH_STAT_LOAD_FAIL);
        return XDP_DROP;
    }
    if (last)
        x->tail_len = n64;
    *m = crc | (tag << 32);        /* after the payload: a set tag means the bytes are there */
    __sync_fetch_and_add(&x->received, 1);
    count(KV_FETCH_STAT_ACCEPTED);
    return XDP_DROP;
}

int kv_fetch(struct xdp_md *ctx)
{
    __u32 zero = 0;
    struct kv_fetch_ctl *c = kvf_ctl.lookup(&zero);
    if (!c)
        return XDP_PASS;
    return receive(ctx, c);
}
