/* trafficgen.c - the XDP programs of the traffic generator (testbed/bench/fetch/generator.py drives
 * them and sends the requests itself, from packet rings).
 *
 *  count_replies  on the requester's veth end: counts (per CPU) the replies addressed to the
 *                 generator's UDP port, keeps the first one of each sample generation in a
 *                 per-CPU slot for byte-exact checks, and drops them (no socket waits for
 *                 them: passing them on would only cost an ICMP port unreachable each).
 *                 Everything else passes.
 *  reflect        the bare XDP_TX reflector of the `ceiling` scenario.
 *
 * Constants are `#define KV_<NAME> <integer>` lines, as in kvproto.h, so the driver reads them.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include "kvproto.h"

#define KV_GEN_SAMPLE_MAX 3536    /* a 3520-byte MTU frame and its Ethernet header */

#define KV_GEN_MC_PORT 11211      /* memcached's UDP port (its frame header is 8 bytes) */

/* counters of count_replies, per CPU */
#define KV_CNT_KV_POOL 0          /* GET_REPLY, status OK, from the pool node */
#define KV_CNT_KV_SWITCH 1        /* GET_REPLY, status OK, written by the switch */
#define KV_CNT_KV_OTHER 2         /* NACK, ERROR or anything else of ours on the KV port */
#define KV_CNT_REFLECTED 3        /* our own GET came back as sent (the ceiling's reflector) */
#define KV_CNT_MC_REPLY 4         /* memcached answer with a value, on its last datagram */
#define KV_CNT_MC_OTHER 5         /* memcached END (miss), errors */
#define KV_CNT_BYTES 6            /* frame bytes of everything counted */
#define KV_CNT_MAX 8

struct rx_cfg {
    __be16 port;                   /* the generator's UDP source port */
    __u16 reserved;
    __u32 sample_gen;              /* bumped by the driver to ask for a new sample */
};

/* Per CPU: the first reply counted in sample generation `gen`. The driver never writes it: a
 * slot it cleared while this program filled it would come out part reply, part zeros. */
struct rx_sample {
    __u32 len;
    __u32 gen;
    __u8  data[KV_GEN_SAMPLE_MAX];
};

BPF_ARRAY(rx_cfg, struct rx_cfg, 1);
BPF_PERCPU_ARRAY(rx_count, __u64, KV_CNT_MAX);
BPF_PERCPU_ARRAY(rx_sample, struct rx_sample, 1);

/* A helper's size argument must be range-checked in the very register passed (xdp/verifier.h). */
static __always_inline __u64 opaque(__u32 v)
{
    __u64 n = v;
    asm volatile("" : "+r"(n));
    return n;
}

static __always_inline void bump(__u32 idx, __u64 n)
{
    __u64 *v = rx_count.lookup(&idx);
    if (v)
        *v += n;
}

/* Classify a frame addressed to (or, reflected, sent from) the generator's port: a KV_CNT_*
 * index; -1 not ours; -2 ours but not counted (a memcached answer's earlier datagrams).
 * *sample says whether it may be the sample. */
static __always_inline int classify(void *data, void *data_end, __be16 port, int *sample)
{
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 ||
        ip->protocol != IPPROTO_UDP)
        return -1;
    if (udp->source == port && udp->dest == bpf_htons(KV_UDP_PORT)) {
        *sample = 1;
        return KV_CNT_REFLECTED;
    }
    if (udp->dest != port)
        return -1;
    if (udp->source == bpf_htons(KV_UDP_PORT)) {
        struct kvhdr *kv = (void *)(udp + 1);
        if ((void *)(kv + 1) > data_end || kv->op != KV_OP_GET_REPLY || kv->status != 0)
            return KV_CNT_KV_OTHER;
        *sample = 1;
        return kv->flags & bpf_htons(KV_F_FROM_SWITCH) ? KV_CNT_KV_SWITCH : KV_CNT_KV_POOL;
    }
    if (udp->source == bpf_htons(KV_GEN_MC_PORT)) {
        __u8 *mc = (void *)(udp + 1);   /* request id, sequence, total, reserved; then text */
        if ((void *)(mc + 13) > data_end)
            return KV_CNT_MC_OTHER;
        __u16 seq = (mc[2] << 8) | mc[3], total = (mc[4] << 8) | mc[5];
        if (seq == 0 && (mc[8] != 'V' || mc[9] != 'A' || mc[10] != 'L'))
            return KV_CNT_MC_OTHER;    /* END (a miss) or an error */
        *sample = seq == 0;
        return seq + 1 == total ? KV_CNT_MC_REPLY : -2;  /* -2: ours, but not the last datagram */
    }
    return -1;
}

int count_replies(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    __u32 zero = 0;
    struct rx_cfg *cfg = rx_cfg.lookup(&zero);
    if (!cfg)
        return XDP_PASS;
    int sample = 0;
    int what = classify(data, data_end, cfg->port, &sample);
    if (what == -1)
        return XDP_PASS;
    __u32 len = (__u32)((long)data_end - (long)data);
    if (what >= 0)
        bump(what, 1);
    bump(KV_CNT_BYTES, len);
    struct rx_sample *s = rx_sample.lookup(&zero);
    if (sample && s && s->gen != cfg->sample_gen) {
        __u64 n = opaque(len);
        if (n >= 1 && n <= KV_GEN_SAMPLE_MAX && !bpf_xdp_load_bytes(ctx, 0, s->data, n)) {
            s->len = n;
            s->gen = cfg->sample_gen;
        }
    }
    return XDP_DROP;
}

int reflect(struct xdp_md *ctx)
{
    return XDP_TX;
}
