/* kvserve.c - a pool node's GET path in XDP (hostagent/pool/xdpserve.py loads it on the node's
 * interface): GETs for staged blocks are answered at the driver layer, everything else goes up
 * to `hostagent serve` untouched.
 *
 * The pool node's staging arena is this program's memory: kvs_arena, an mmapable array of
 * KV_SERVE_SEGS segments of KV_SERVE_SEG bytes, contiguous in memory, which the Python server
 * uses as its arena (stores read whole blocks into it: get_into, put_from, PUT assembly). A
 * staged block lies in a run of the arena laid out as hostagent/pool/blockfmt.py stores it (any
 * chunk size): chunk i is `len` bytes at arena offset `off`. For every block that may be served
 * Python writes (hostagent/pool/xdpserve.py)
 *
 *   kvs_slots[first+i]  per chunk, mmapped: the chunk it describes (namespace, key, index), the
 *                       block's chunk count, the chunk's length, CRC-32 and arena offset, and
 *                       the slot's generation (unique per staged block, written last; 0: not
 *                       servable),
 *   kvs_index[(ns,key)] the block's first slot and chunk count (written after).
 *
 * The index only says where to look: a slot is served only if it names the very chunk asked
 * for, and only if its generation is the same after the copy as before (as the switch checks a
 * cache entry's owner). When a block leaves (evicted, replaced, a failed write) Python deletes
 * its index entry and zeroes its slots' generations before its slots or its arena bytes can be
 * reused, so a chunk freed or rewritten while it was copied is never sent (the half-made reply
 * is dropped, the asker retransmits). Python's stores are ordered as x86 orders them (TSO).
 * The verifier must see every copy inside one map value: a chunk starting in the last
 * KV_MAX_PAYLOAD bytes of a segment is left to the server (one in ~1,000 at 3 KiB chunks).
 *
 *  - GET to this node (its IPv4 address, not a broadcast frame), a UDP checksum its kernel
 *    accepts whatever the skb's offload state (reply.h), from a UDP port other than 0, for a chunk
 *    of a block in kvs_index whose length fits the room the GET carried: the GET becomes the
 *    GET_REPLY in place (reply.h: payload from kvs_arena, addresses swapped) and goes back out
 *    with XDP_TX, as `hostagent serve` would have sent it (flags 0: not KV_F_FROM_SWITCH, so a
 *    switch learns it as a pool reply and clients count it as from the pool).
 *  - a GET from UDP port 0 is dropped (the server could not answer it either);
 *  - everything else passes untouched: PUTs, GETs for blocks not staged (the server fills them
 *    from its store, then they are served here), too little room, non-KV and malformed frames.
 *
 * Constants and structs are in kvserve.h, the maps in kvserve_maps.h (katran's consts/structs/maps
 * split, as the switch's kvswitch.h/kvmaps.h and the fetch engine's kvfetch.h/kvfetch_maps.h).
 */
#include <linux/bpf.h>
#include "parse.h"
#include "kvserve_maps.h"
#define KV_REPLY_MAX KV_MAX_PAYLOAD
#include "reply.h"

static __always_inline int count(__u32 idx, __u64 n, int verdict)
{
    __u64 *c = kvs_stats.lookup(&idx);
    if (c)
        *c += n;
    return verdict;
}

static __always_inline __u32 gen_of(struct kv_serve_slot *slot)
{
    __u32 g = *(volatile __u32 *)&slot->gen;   /* read again, never a value clang kept */
    asm volatile("" ::: "memory");             /* and before (after) what follows (precedes) */
    return g;
}

/* Whether the slot describes chunk `chunk` of block `bk`. */
static __always_inline int holds(struct kv_serve_slot *slot, struct kv_serve_key *bk,
                                 __u32 chunk)
{
    const __u32 *a = (const __u32 *)slot->key, *b = (const __u32 *)bk->key;
    return slot->ns == bk->ns && slot->chunk == chunk && a[0] == b[0] && a[1] == b[1] &&
           a[2] == b[2] && a[3] == b[3];
}

static __always_inline int serve_get(struct xdp_md *ctx, struct kv_frame *f)
{
    if ((f->eth->h_dest[0] & 1) || !kvs_addrs.lookup(&f->ip->daddr))
        return count(KV_SERVE_STAT_NOT_MINE, 1, XDP_PASS);
    if (!kv_get_answerable(f))
        return count(KV_SERVE_STAT_PORT_ZERO, 1, XDP_DROP);
    if (!kv_get_udp_csum_ok(f))
        return count(KV_SERVE_STAT_BAD_UDP_CSUM, 1, XDP_PASS);
    struct kv_serve_key bk = {};
    bk.ns = bpf_ntohl(f->kv->ns);
    __builtin_memcpy(bk.key, f->kv->key, sizeof(bk.key));
    struct kv_serve_block *b = kvs_index.lookup(&bk);
    if (!b)
        return count(KV_SERVE_STAT_PASSED, 1, XDP_PASS);
    __u32 chunk = bpf_ntohl(f->kv->chunk);
    if (chunk >= b->nchunks)
        return count(KV_SERVE_STAT_BAD_CHUNK, 1, XDP_PASS);
    __u32 idx = b->first + chunk;
    struct kv_serve_slot *slot = kvs_slots.lookup(&idx);
    if (!slot)
        return count(KV_SERVE_STAT_REUSED, 1, XDP_PASS);
    __u32 gen = gen_of(slot);
    if (!gen || !holds(slot, &bk, chunk))
        return count(KV_SERVE_STAT_REUSED, 1, XDP_PASS);   /* leaving, or an index in flux */
    __u32 len = slot->len, nchunks = slot->nchunks, crc = slot->crc;
    __u64 off = slot->off;
    if (len == 0 || len > KV_MAX_PAYLOAD)
        return count(KV_SERVE_STAT_REUSED, 1, XDP_PASS);
    if (len > f->payload_len)
        return count(KV_SERVE_STAT_NO_ROOM, 1, XDP_PASS);
    __u32 seg = off >> KV_SERVE_SEG_SHIFT;
    __u64 at = off & (KV_SERVE_SEG - 1);
    if (at > KV_SERVE_SEG - KV_MAX_PAYLOAD)
        return count(KV_SERVE_STAT_SEG_END, 1, XDP_PASS);
    struct kv_serve_seg *p = kvs_arena.lookup(&seg);
    if (!p)
        return count(KV_SERVE_STAT_REUSED, 1, XDP_PASS);
    int r = kv_reply_in_place(ctx, p->b + at, len, nchunks, crc, 0, 0);
    if (r != XDP_TX)
        return count(KV_SERVE_STAT_FAILED, 1, r);
    if (gen_of(slot) != gen)       /* freed (and maybe rewritten) while we copied */
        return count(KV_SERVE_STAT_REUSED, 1, XDP_DROP);
    if (chunk == 0)
        slot->last_ns = bpf_ktime_get_ns();   /* recency, for the server's eviction order */
    count(KV_SERVE_STAT_HIT_BYTES, len, 0);
    return count(KV_SERVE_STAT_HIT, 1, XDP_TX);
}

int kv_serve(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct kv_frame f = {};

    count(KV_SERVE_STAT_PACKETS, 1, 0);
    int r = kv_parse(data, data_end, &f);
    if (r == KV_NOT_KV)
        return count(KV_SERVE_STAT_NON_KV, 1, XDP_PASS);
    if (r == KV_BAD)
        return count(KV_SERVE_STAT_MALFORMED, 1, XDP_PASS);
    if (f.kv->op != KV_OP_GET || f.udp->dest != bpf_htons(KV_UDP_PORT))
        return count(KV_SERVE_STAT_OTHER_KV, 1, XDP_PASS);
    return serve_get(ctx, &f);
}


/* Put back on the interface when the server stops (a veth end needs a program to receive
 * XDP_TX'd frames; this one holds no map). */
int kv_serve_pass(struct xdp_md *ctx)
{
    return XDP_PASS;
}
