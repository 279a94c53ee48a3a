/* features.c - the programs xdp/features.py runs to see whether the kernel grants what the
 * switch's replication needs: a frame broadcast through a devmap (BPF_F_BROADCAST,
 * BPF_F_EXCLUDE_INGRESS) whose entries carry an egress program, as kvswitch.c's release_waiters
 * and kv_egress do. probe_egress counts the copies it sees; probe_pass sits on the receiving
 * veth ends (a veth drops what XDP redirects into it unless its peer has a program). */
#include <linux/bpf.h>

struct probe_port {                /* devmap value: BCC's layout for an egress program */
    __u32 ifindex;
    int prog_fd;
};

BPF_XDP_REDIRECT_MAP("devmap", struct probe_port, probe_ports, 4);
BPF_ARRAY(probe_count, __u64, 1);

int probe_broadcast(struct xdp_md *ctx)
{
    return probe_ports.redirect_map(0, BPF_F_BROADCAST | BPF_F_EXCLUDE_INGRESS);
}

int probe_egress(struct xdp_md *ctx)
{
    __u32 zero = 0;
    __u64 *n = probe_count.lookup(&zero);
    if (n)
        __sync_fetch_and_add(n, 1);
    return XDP_PASS;
}

int probe_pass(struct xdp_md *ctx)
{
    return XDP_PASS;
}
