/* reply.h - answering a GET from XDP: its UDP checksum check and turning it into its GET_REPLY in
 * place (payload copied into the room the GET carried, addresses swapped, XDP_TX). Shared by
 * every program that answers GETs: the switch from its cache (kvswitch.c) and a pool node from
 * its staged blocks (kvserve.c).
 *
 * Define KV_REPLY_MAX (the largest payload a reply carries, the deployment's chunk size) before
 * including this file. */
#ifndef KV_REPLY_H
#define KV_REPLY_H

#include "parse.h"
#include "verifier.h"

#ifndef KV_REPLY_MAX
#error "define KV_REPLY_MAX (the largest reply payload) before including reply.h"
#endif

static __always_inline void kv_swap_bytes(__u8 *a, __u8 *b, int n)
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

/* Whether a GET's UDP checksum is one the receiving kernel accepts, so that what XDP answers or
 * holds is exactly what the pool node's stack would answer. The kernel (udp4_csum_init) takes a
 * checksum of 0 as "none" and otherwise sums the whole datagram with its pseudo-header (the
 * result must fold to 0; 0xffff in the field stands for a computed 0, and sums the same). This
 * checks the same sum over the pseudo-header, UDP and KV headers, the room counted as the zeros
 * the protocol requires (a room of other bytes fails it, unless they add up to nothing, and then
 * the kernel accepts it too): ~30 additions, not a pass over the room.
 *
 * Not accepted: a field holding just the pseudo-header's folded sum (what a local stack leaves
 * for checksum offload, CHECKSUM_PARTIAL on veth) when the full sum fails. A kernel takes that
 * form only from an skb still marked partial, which XDP cannot see; the same bytes crafted on a
 * raw socket are dropped by the pool's stack. Accepting it let a tenant open rounds the pool
 * never answered (issue 26). Senders on veth use checksum 0 (the XDP fetch engine, the asyncio
 * client with SO_NO_CHECK) or a full one; partial GETs still reach the pool's stack, which
 * answers the genuine ones. */
static __always_inline int kv_get_udp_csum_ok(struct kv_frame *f)
{
    if (!f->udp->check)
        return 1;
    __u16 *w = (__u16 *)&f->ip->saddr;    /* saddr and daddr: 4 words */
    __u32 sum = bpf_htons(IPPROTO_UDP) + f->udp->len;
#pragma unroll
    for (int i = 0; i < 4; i++)
        sum += w[i];
    w = (__u16 *)f->udp;                   /* the UDP header, then the KV header */
#pragma unroll
    for (int i = 0; i < (KV_UDP_LEN + KV_HDR_LEN) / 2; i++)
        sum += w[i];
    return kv_csum_fold(sum) == 0;
}

/* Whether a GET can be answered at all: the kernel delivers a datagram from UDP port 0, but no
 * reply can be sent to it (sendmsg fails), so XDP answers and holds none either. */
static __always_inline int kv_get_answerable(struct kv_frame *f)
{
    return f->udp->source != 0;
}

/* Turn the GET in ctx (parsed, its room at least len bytes, 1 <= len <= KV_REPLY_MAX) into the
 * GET_REPLY carrying the len bytes at `payload` (a map value), for a block of `nchunks` chunks
 * whose CRC-32 is `csum`. The reply's flags are the GET's, ANDed with `keep` and ORed with `set`
 * (network order). Returns XDP_TX once the reply is made, XDP_PASS if the frame was left as it
 * was, XDP_DROP if its headers were rewritten but the payload could not be (never send half a
 * reply). The caller re-checks that `payload` still held its chunk after XDP_TX. */
static __always_inline int kv_reply_in_place(struct xdp_md *ctx, void *payload, __u32 len,
                                             __u32 nchunks, __u32 csum, __be16 keep, __be16 set)
{
    /* 1. drop the unused room and anything trailing the IP packet (link-layer padding) */
    int excess = (int)(ctx->data_end - ctx->data) - (int)(KV_PAYLOAD_OFF + len);
    if (excess > 0 && bpf_xdp_adjust_tail(ctx, -excess))
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

    kv_swap_bytes(eth->h_dest, eth->h_source, ETH_ALEN);
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
    kv->flags = (kv->flags & keep) | set;
    kv->status = 0;
    kv->nchunks = bpf_htonl(nchunks);
    kv->len = bpf_htons(len);
    kv->csum = bpf_htonl(csum);

    /* 3. the payload, from the map value into the room the request carried */
    __u64 n = kv_opaque_len(len);
    if (n < 1 || n > KV_REPLY_MAX)
        return XDP_DROP;
    if (bpf_xdp_store_bytes(ctx, KV_PAYLOAD_OFF, payload, n))
        return XDP_DROP;           /* headers already rewritten: never send half a reply */
    return XDP_TX;
}

#endif /* KV_REPLY_H */
