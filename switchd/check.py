"""`switchd check`: what the running kernel grants the switch's programs, feature by feature
(``xdp.features``), run on each switch box before anything else (`make setup` runs it too)."""
from __future__ import annotations

from kvproto import DEFAULT_CHUNK
import xdp
from xdp import libbpf
from xdp.features import Finding, Use, check, load_programs

from .dataplane import Deployment

PURPOSES = {"kv_ingress": "every port: hits, misses, coalescing, learning, port checks",
            "kv_egress": "each copy of a replicated reply, rewritten for the waiter on its port",
            "kv_write": "switchd's writes into cache slots (run with BPF_PROG_TEST_RUN)"}
USES = [
    Use("bpf_redirect_map", "replication: one pool reply broadcast to every port that asked",
        ""),
    Use("bpf_xdp_adjust_tail", "a hit's reply trimmed to its chunk", ""),
    Use("bpf_xdp_load_bytes", "a pool reply learned into its cache slot", ""),
    Use("bpf_xdp_store_bytes", "a hit's payload written into the GET's room", ""),
    Use("bpf_xdp_adjust_meta", "", "a replicated reply's round rides in the frame (its IPv4 "
        "destination and request id, which the egress program rewrites)", needed=False),
    Use("devmap broadcast with egress programs", "replication: the N-to-1 incast cure",
        "start switchd with --no-coalesce: every GET goes on to the pool node"),
    Use("BPF_PROG_TEST_RUN", "switchd's writes into cache slots (kv_write)",
        "blocks are cached only from passing pool replies"),
    Use("native XDP on veth", "switch ports in driver mode", "--mode generic (slower)"),
    Use("bpffs pinning", "the cache kept across a restart of switchd",
        "a --pin-dir on a bpf filesystem (mount -t bpf bpf /sys/fs/bpf)"),
    Use("BPF_PROG_TEST_RUN live frames", "", "the fetch engine and the testbed's generator send "
        "from AF_PACKET TX rings", needed=False),
    Use("XDP multi-buffer on veth", "", "frames up to a 3,506-byte MTU: chunks up to 3,416 "
        "bytes", needed=False),
]


def switch_check(chunk_size: int = DEFAULT_CHUNK, cache_entries: int = 65536) -> list[Finding]:
    """The switch's programs (compiled for ``chunk_size`` and ``cache_entries``) loaded on the
    running kernel, and every feature they use, probed."""
    programs = load_programs(xdp.source("kvswitch.c"),
                             {"kv_ingress": 0, "kv_write": 0,
                              "kv_egress": libbpf.BPF_XDP_DEVMAP},
                             Deployment(chunk_size, cache_entries, None).cflags(),
                             append=(xdp.source("kvwrite.c"),))
    return check(programs, USES, PURPOSES)
