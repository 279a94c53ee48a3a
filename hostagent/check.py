"""`hostagent check`: what the running kernel grants an inference or pool node's programs,
feature by feature (``xdp.features``): the fetch engine's receiver (xdp/kvfetch.c) and the pool
node's XDP GET server (xdp/kvserve.c). Run on each node before anything else (`make setup` runs
it too)."""
from __future__ import annotations

from kvproto import DEFAULT_CHUNK
import xdp
from xdp.features import Finding, Use, check, load_programs

PURPOSES = {"kv_fetch": "the fetch engine: replies received straight into the block's memory",
            "kv_serve": "a pool node's GETs for staged blocks answered at the driver",
            "kv_serve_pass": "a pool node's interface while its XDP server is off"}
USES = [
    Use("bpf_xdp_load_bytes", "a reply's payload copied into the engine's arena", ""),
    Use("bpf_xdp_store_bytes", "a pool node's payload written into the GET's room", ""),
    Use("bpf_xdp_adjust_tail", "a pool node's reply trimmed to its chunk", ""),
    Use("bpf_xdp_adjust_meta", "", "the fetch engine's program only receives; its GETs leave "
        "from an AF_PACKET TX ring", needed=False),
    Use("mmapable arrays", "the engine's arena and a pool node's staging arena, shared with "
        "Python without a copy", "the asyncio socket client; `hostagent serve` answers every "
        "GET itself", needed=False),
    Use("AF_PACKET TX ring", "the fetch engine's GETs, a batch per system call",
        "the asyncio socket client", needed=False),
    Use("native XDP on veth", "the engine and the XDP server in driver mode",
        "the asyncio socket client; `hostagent serve` answers every GET itself", needed=False),
    Use("BPF_PROG_TEST_RUN live frames", "", "GETs leave from an AF_PACKET TX ring",
        needed=False),
    Use("XDP multi-buffer on veth", "", "frames up to a 3,506-byte MTU: chunks up to 3,416 "
        "bytes", needed=False),
]


def node_check(chunk_size: int = DEFAULT_CHUNK) -> list[Finding]:
    """The node's programs loaded on the running kernel, and every feature they use, probed."""
    from hostagent.pool.xdpserve import sizes
    segs, slots, blocks = sizes(64 << 20)
    programs = load_programs(xdp.source("kvfetch.c"), {"kv_fetch": 0},
                             [f"-DKV_CHUNK={chunk_size}"])
    programs += load_programs(xdp.source("kvserve.c"), {"kv_serve": 0, "kv_serve_pass": 0},
                              [f"-DKV_SERVE_SEGS={segs}", f"-DKV_SERVE_SLOTS={slots}",
                               f"-DKV_SERVE_BLOCKS={blocks}"])
    return check(programs, USES, PURPOSES)
