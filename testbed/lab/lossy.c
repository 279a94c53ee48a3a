/* lossy.c - a loss injector for testbeds whose kernel has no netem: attached on a node's veth end
 * in place of pass.c, it drops a set share of the KV protocol frames it receives (and passes
 * everything else, so ARP and TCP are untouched). loss_ppm[0] is the drop rate in parts per
 * million; loss_unsummed[0] = 1 also drops every KV frame sent without a UDP checksum (0), as
 * some middleboxes do; dropped frames are counted in loss_dropped. */
#include "parse.h"

BPF_ARRAY(loss_ppm, __u32, 1);
BPF_ARRAY(loss_unsummed, __u32, 1);
BPF_PERCPU_ARRAY(loss_dropped, __u64, 1);

int xdp_lossy(struct xdp_md *ctx)
{
    struct kv_frame f = {};
    if (kv_parse((void *)(long)ctx->data, (void *)(long)ctx->data_end, &f) != KV_OK)
        return XDP_PASS;
    __u32 zero = 0;
    __u32 *ppm = loss_ppm.lookup(&zero), *unsummed = loss_unsummed.lookup(&zero);
    int refused = unsummed && *unsummed && f.udp->check == 0;
    if (!refused && (!ppm || bpf_get_prandom_u32() % 1000000 >= *ppm))
        return XDP_PASS;
    __u64 *n = loss_dropped.lookup(&zero);
    if (n)
        *n += 1;
    return XDP_DROP;
}
