"""What the cluster model is told: the model presets (KV bytes per token, prefill speed, GPUs per
node), SimConfig, one cluster configuration with its cost model (docs/sim.md), and the data
plane's CPU per frame, read from the throughput benchmark's result."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvproto.frames import PAYLOAD_OFF
from switchd.policy import POLICIES

from .trace import BLOCK_TOKENS

GIB = 1 << 30
FRAME_OVERHEAD = PAYLOAD_OFF               # Ethernet + IPv4 + UDP + KV header per chunk frame
ROUTINGS = ("random", "least-loaded", "affinity")
DEMOTES = ("none", "all", "value")
ROOT = Path(__file__).resolve().parents[2]
THROUGHPUT_JSON = "bench/results/throughput.json"
REQUESTS_PER_NODE, MAX_REQUESTS = 200, 200_000    # a point's default request count
HBM, DRAM, SWITCH, POOL, REPLICA, RECOMPUTE, UNSAMPLED = range(7)
TIERS = ("hbm", "dram", "switch", "pool", "switch_replica", "recompute")


@dataclass(frozen=True)
class Model:
    name: str
    kv_bytes_per_token: int      # K and V of every layer, bf16
    prefill_tokens_per_s: float  # one inference node, long prompts
    gpus_per_node: int


MODELS = {
    # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes; one H100 per node
    "llama3-8b": Model("Llama-3-8B", 32 * 8 * 128 * 2 * 2, 10_000, 1),
    # 80 layers x 8 KV heads x 128 x 2 x 2; one 8-GPU node (TP8)
    "llama3-70b": Model("Llama-3-70B", 80 * 8 * 128 * 2 * 2, 8_000, 8),
    # MLA: 61 layers x (512 latent + 64 rope) x 2 bytes; one 8-GPU node
    "deepseek-v3": Model("DeepSeek-V3", 61 * (512 + 64) * 2, 6_000, 8),
}


class SimError(ValueError):
    """A configuration the model cannot run (the CLI prints it as a usage error)."""


@dataclass
class SimConfig:
    """One cluster. The defaults are the sweep's point (``testbed sim sweep``): a storage tier of
    4 pool nodes, fixed while the inference nodes grow, and requests routed at random."""
    nodes: int = 4
    pools: int = 4                    # pool nodes (the storage tier)
    model: str = "llama3-8b"
    kv_bytes_per_token: int | None = None   # overrides the model's
    block_tokens: int = 512           # allocation/transfer granularity (divides 512)
    hbm_gib: float = 40.0             # per node, for KV
    dram_gib: float = 256.0           # per node
    switch_gib: float = 64.0          # the switch pool
    pool_gib: float | None = None     # per pool node; None: unlimited
    node_gbps: float = 100.0          # inference node <-> switch
    pool_gbps: float = 100.0          # pool node <-> switch
    pcie_gbps: float = 200.0          # node DRAM -> HBM
    chunk_bytes: int = 3072           # payload per KV frame
    hop_us: float = 5.0               # extra latency of a fetch through the switch pool
    routing: str = "random"
    demote: str = "value"
    switch_policy: str = "prefix"
    interval: float = 1.0             # switchd policy step, seconds (of the policy clock)
    headroom: float | None = None     # speculative-fill share of the switch; None: 1/16
    coalesce: bool = True
    load: float = 0.7                 # per-node prefill utilisation without any cache
    rate_per_node: float | None = None  # requests/s per node; default from load
    preload: bool = False             # pool nodes hold every block from the start
    write_through: bool = True        # computed blocks are put to the pool nodes
    switch_budget: int = 1_000_000    # switch-bound accesses simulated exactly; more: sampled
    clock_scale: float = 1.0          # policy clock = trace time / clock_scale (testbed speedup)
    xdp_ns_per_frame: float | None = None   # data-plane CPU per frame; None: from throughput_json
    throughput_json: str = THROUGHPUT_JSON  # `testbed bench throughput` result (relative: to cwd
    #                                         or else the source tree)
    seed: int = 1
    # cost model (break-even), see docs/sim.md
    gpu_hour_usd: float = 2.0
    switch_gib_hour_usd: float = 0.004
    core_hour_usd: float = 0.04
    switchd_cores: float = 1.0

    def __post_init__(self):
        if self.nodes < 1:
            raise SimError(f"nodes must be >= 1, got {self.nodes}")
        if self.pools < 1:
            raise SimError(f"pools must be >= 1, got {self.pools}")
        if self.model not in MODELS:
            raise SimError(f"unknown model {self.model!r} (choose from {', '.join(MODELS)})")
        if self.routing not in ROUTINGS:
            raise SimError(f"unknown routing {self.routing!r} (choose from {', '.join(ROUTINGS)})")
        if self.demote not in DEMOTES:
            raise SimError(f"unknown demotion {self.demote!r} (choose from {', '.join(DEMOTES)})")
        if self.switch_policy not in POLICIES:
            raise SimError(f"unknown policy {self.switch_policy!r} "
                             f"(choose from {', '.join(POLICIES)})")
        if not (1 <= self.block_tokens <= BLOCK_TOKENS and BLOCK_TOKENS % self.block_tokens == 0):
            raise SimError(f"block tokens must divide {BLOCK_TOKENS}, got {self.block_tokens}")
        for name in ("hbm_gib", "dram_gib", "switch_gib"):
            if getattr(self, name) < 0:
                raise SimError(f"{name} must be >= 0")
        for name in ("node_gbps", "pool_gbps", "pcie_gbps", "interval", "load"):
            if not getattr(self, name) > 0:
                raise SimError(f"{name} must be > 0")

    @property
    def kv_per_token(self) -> int:
        return self.kv_bytes_per_token or MODELS[self.model].kv_bytes_per_token

    @property
    def block_bytes(self) -> int:
        return BLOCK_TOKENS * self.kv_per_token



def default_requests(nodes: int) -> int:
    """Requests of a point when none are given: 200 per inference node, at most 200,000."""
    return min(MAX_REQUESTS, REQUESTS_PER_NODE * nodes)


def xdp_frame_cost(cfg: SimConfig) -> dict:
    """The data plane's CPU per frame it handles: ``cfg.xdp_ns_per_frame`` if set, else what the
    throughput benchmark measured at the chunk size nearest ``cfg.chunk_bytes``: the program's
    own run time per frame (bpf_stats) when the result has it, else one core's switch-hit rate
    (1e9 / switch_hit_pps; the generator shares that core, so this errs high)."""
    if cfg.xdp_ns_per_frame is not None:
        return {"ns_per_frame": float(cfg.xdp_ns_per_frame), "source": "configured"}
    path = Path(cfg.throughput_json)
    if not path.is_absolute() and not path.exists() and (ROOT / path).exists():
        path = ROOT / path
    path = path.resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    measured = dict(_measured(str(path), cfg.chunk_bytes))
    how = ("kv_ingress run time per frame (bpf_stats)" if "switch_hit_ns_per_frame" in measured
           else "1e9 / switch_hit_pps (one core)")
    return {**measured, "source": f"{shown}: {how}"}


@lru_cache(maxsize=8)
def _measured(path: str, chunk_bytes: int) -> tuple:
    try:
        rows = [r for r in json.loads(Path(path).read_text())["results"]
                if r.get("switch_hit_pps")]
    except FileNotFoundError:
        raise SimError(f"no throughput result at {path}: run `testbed bench throughput --json "
                       f"{THROUGHPUT_JSON}` or give the data plane's ns per frame "
                       f"(--xdp-ns-per-frame)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SimError(f"{path} is not a throughput result ({exc})") from None
    if not rows:
        raise SimError(f"{path} has no switch_hit_pps to price the data plane's CPU with")
    row = min(rows, key=lambda r: (abs(r["chunk_bytes"] - chunk_bytes), -r["chunk_bytes"]))
    own = row.get("switch_hit_ns_per_frame")
    return (("ns_per_frame", own or round(1e9 / row["switch_hit_pps"], 1)),
            ("measured_chunk_bytes", row["chunk_bytes"]),
            ("switch_hit_pps", row["switch_hit_pps"]),
            *((("switch_hit_ns_per_frame", own),) if own else ()))
