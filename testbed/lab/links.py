"""Links that behave like links: a node's cable to the switch as a namespace of its own
(``<prefix>-l<node>``) holding a plain Linux bridge between two veths, one towards the switch port
and one towards the node, each with a tc tbf qdisc on its egress. Both directions of the link queue
at the configured rate whatever sent the frame: the node's stack, the node's XDP programs (XDP_TX,
the fetch engine's live-frames test runs, a pool node's XDP GET server) or the switch's XDP (hits
sent with XDP_TX, devmap broadcasts). XDP-sent frames skip every qdisc of the interface that sends
them; in the link namespace they arrive as skbs (an XDP_PASS program on each end accepts them, as
``pass_program`` in testbed.lab.topology does) and the bridge's egress queues them.

tbf queues rather than polices: a frame waits while the link is busy, up to ``buffer_ms`` of
queue or ``MIN_BUFFER`` bytes, whichever is more (then it is dropped, as a switch port with that
much buffer would). The optional one-way
delay needs the netem qdisc (a child of tbf); this machine's kernel has no netem, so asking for a
delay here fails with one line.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdp import netns
from xdp.attach import attach_xdp

from .shell import TestbedError, sh

BRIDGE = "br0"
TO_SWITCH, TO_NODE = "sw", "node"      # the link namespace's two ends


@dataclass(frozen=True)
class LinkSpec:
    """The rate of every inference node's link and every pool node's link (Gbit/s, None:
    a direct veth, unshaped), the one-way delay (µs) and the queue each direction holds."""
    host_gbit: float | None = None
    pool_gbit: float | None = None
    delay_us: float = 0.0
    buffer_ms: float = 50.0

    def __post_init__(self):
        for what, v in (("--link-gbit", self.host_gbit), ("--pool-link-gbit", self.pool_gbit)):
            if v is not None and not v > 0:
                raise TestbedError(f"{what} must be > 0 Gbit/s, got {v:g}")
            if v is not None and v > 100:
                raise TestbedError(f"{what} must be at most 100 Gbit/s, got {v:g}")
        if self.delay_us < 0:
            raise TestbedError(f"--link-delay-us must be >= 0, got {self.delay_us:g}")
        if not self.buffer_ms > 0:
            raise TestbedError(f"the link buffer must be > 0 ms, got {self.buffer_ms:g}")
        if self.delay_us and not (self.host_gbit or self.pool_gbit):
            raise TestbedError("--link-delay-us needs --link-gbit or --pool-link-gbit")

    def rate(self, role: str) -> float | None:
        return self.host_gbit if role == "host" else self.pool_gbit if role == "pool" else None

    def as_dict(self) -> dict:
        return {"link_gbit": self.host_gbit, "pool_link_gbit": self.pool_gbit,
                "link_delay_us": self.delay_us, "link_buffer_ms": self.buffer_ms}


def link_netns(prefix: str, node: str) -> str:
    return f"{prefix}-l{node}"


MIN_BUFFER = 512 << 10          # bytes of queue a link holds at least (a switch port's)


def tbf_args(gbit: float, mtu: int, buffer_ms: float) -> list[str]:
    """tbf's rate, bucket and queue for a link of ``gbit``: a bucket of two frames or 0.5 ms of
    the rate (whichever is larger: tight enough that a 4 MiB transfer sees the rate within
    1 %), a queue of ``buffer_ms`` at the rate but at least ``MIN_BUFFER`` bytes (at tens of
    Mbit/s, 50 ms would hold only a few dozen frames)."""
    rate_bps = gbit * 1e9
    burst = max(2 * (mtu + 14), int(rate_bps / 8 * 0.0005))
    limit = max(MIN_BUFFER, int(rate_bps / 8 * buffer_ms / 1000)) + burst
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def build_link(topo, node, gbit: float, spec: LinkSpec, pass_fn, ip, quiet) -> None:
    """Make ``node``'s link namespace: the switch's port ``node.name`` (in the switch's
    namespace) - [sw | br0 | node] - eth0 in the node's namespace, shaped both ways."""
    ln = link_netns(topo.prefix, node.name)
    ip("netns", "add", ln)
    quiet(ln)
    ip("link", "set", "lo", "up", ns=ln)
    ip("link", "add", BRIDGE, "type", "bridge", ns=ln)
    ip("link", "set", BRIDGE, "up", ns=ln)
    ip("link", "add", node.name, "type", "veth", "peer", "name", TO_SWITCH, "netns", ln,
       ns=topo.switch_ns)
    ip("link", "add", TO_NODE, "type", "veth", "peer", "name", "eth0", "netns", node.netns,
       ns=ln)
    for end in (TO_SWITCH, TO_NODE):
        ip("link", "set", end, "mtu", str(topo.mtu), "master", BRIDGE, "up", ns=ln)
        sh("ip", "netns", "exec", ln, "tc", "qdisc", "replace", "dev", end, "root",
           "handle", "1:", *tbf_args(gbit, topo.mtu, spec.buffer_ms))
        if spec.delay_us:
            r = sh("ip", "netns", "exec", ln, "tc", "qdisc", "add", "dev", end, "parent", "1:1",
                   "handle", "10:", "netem", "delay", f"{int(spec.delay_us)}us", check=False)
            if r.returncode:
                raise TestbedError("--link-delay-us needs the netem qdisc, which this kernel "
                                   f"does not have ({r.stderr.strip()})")
    with netns.inside(ln):
        for end in (TO_SWITCH, TO_NODE):
            attach_xdp(end, pass_fn)


def link_stats(topo, node: str) -> dict:
    """What the node's link queued and dropped, per direction (tc's counters)."""
    import json
    out = {}
    for end, direction in ((TO_SWITCH, "up"), (TO_NODE, "down")):
        r = sh("ip", "netns", "exec", link_netns(topo.prefix, node), "tc", "-j", "-s", "qdisc",
               "show", "dev", end, check=False)
        q = (json.loads(r.stdout or "[]") or [{}])[0]
        out[direction] = {k: q.get(k, 0) for k in ("bytes", "packets", "drops", "overlimits")}
    return out


def timed_fetches(pools: list[str], chunk_size: int, ns: int, key_hex: str,
                  reps: int) -> list[dict]:
    """Run inside a node (testbed.lab.tasks): fetch a block ``reps`` times with one fetch
    engine; each fetch's stats (seconds from the first GET to the last byte, who answered,
    retransmissions) and the block's sha256."""
    import hashlib
    from hostagent.inference.fetch.engine import FetchEngine
    out = []
    with FetchEngine(pools, chunk_size) as eng:
        for _ in range(reps):
            blk = eng.get_block(ns, bytes.fromhex(key_hex))
            try:
                out.append({**blk.stats.as_dict(),
                            "sha256": hashlib.sha256(blk.tobytes()).hexdigest()})
            finally:
                blk.release()
    return out
