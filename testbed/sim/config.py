"""What the cluster model is told: the model presets (KV bytes per token, prefill speed, GPUs per
node), SimConfig, one cluster configuration with its cost model (docs/sim.md), and the data
plane's CPU per frame, read from the throughput benchmark's result (the KV codec's measured
ratio and decode rate are read by testbed.sim.codec)."""
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
COMPRESS_JSON = "bench/results/compress.json"
REQUESTS_PER_NODE, MAX_REQUESTS = 200, 200_000    # a point's default request count
MIN_ENTRIES = 1_000_000           # the cache size the data plane's CPU should be measured at
PPS_KEYS = ("switch_hit_pps", "hit_pps_sequential", "hit_pps_zipf", "hit_pps")
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
    switch_budget: int = 500_000      # switch-bound fetches simulated exactly; more: sampled
    clock_scale: float = 1.0          # policy clock = trace time / clock_scale (testbed speedup)
    xdp_ns_per_frame: float | None = None   # data-plane CPU per frame; None: from throughput_json
    throughput_json: str = THROUGHPUT_JSON  # `testbed bench throughput` result (relative: to cwd
    #                                         or else the source tree)
    kv_codec: str = "none"            # KV codec of blocks on the wire and in the switch/pool
    compress_json: str = COMPRESS_JSON  # `testbed bench compress` result: its ratio and rates
    skew: float = 0.0                 # Zipf exponent of prefix-tree popularity (0: uniform)
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
        for name in ("hbm_gib", "dram_gib", "switch_gib", "skew"):
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
    """The data plane's CPU per frame it handles: ``cfg.xdp_ns_per_frame`` if set, else what
    ``testbed bench throughput`` measured (``cfg.throughput_json``) at the chunk size nearest
    ``cfg.chunk_bytes`` and, at that chunk size, the largest cache the file measured (the
    model's switch holds millions of blocks' chunks: ``MIN_ENTRIES`` or more is what it should
    be priced at). Per entry: the program's own run time per frame (bpf_stats) when the entry
    has it, else 1e9 / its hit replies per second on one core (the generator shares that core,
    so this errs high). Says which file and entry it read, and ``fallback`` when the entry's
    cache is smaller than ``MIN_ENTRIES`` (the file has no such entry at that chunk size)."""
    if cfg.xdp_ns_per_frame is not None:
        return {"ns_per_frame": float(cfg.xdp_ns_per_frame), "source": "configured"}
    path, shown, stamp = result_file(cfg.throughput_json)
    m = dict(_measured(str(path), cfg.chunk_bytes, stamp))
    return {**m, "file": shown,
            "source": f"{shown} {m['entry']}: {m['entries']:,} entries x "
                      f"{m['measured_chunk_bytes']} B chunks, {m['how']}"
                      + (" (fallback: smaller cache than 1M)" if "fallback" in m else "")}


def result_file(name: str) -> tuple[Path, str, tuple | None]:
    """A committed result file the model reads: its path (relative: to the working directory
    or else the source tree), how results name it (relative to the source tree when inside it)
    and a stamp (mtime, size; None if absent) so that cached readings of a rewritten file are
    read again."""
    path = Path(name)
    if not path.is_absolute() and not path.exists() and (ROOT / path).exists():
        path = ROOT / path
    path = path.resolve()
    shown = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    return path, shown, stamp


def throughput_entries(doc: dict) -> list[dict]:
    """Every switch-hit measurement in a throughput result: the entry (``section[index]``),
    its cache entries, chunk size, ns per frame and how that was got. Rows of ``results``
    measured ``config.keys`` entries unless they say (``entries``; 0: unknown); other sections'
    rows count only if they name their ``entries`` (``cache_scaling``, or any section added
    later)."""
    if not isinstance(doc, dict):
        raise TypeError("not a JSON object")
    keys = (doc.get("config") or {}).get("keys")
    out = []
    for section, rows in doc.items():
        if not isinstance(rows, list):
            continue
        for i, r in enumerate(rows):
            if not isinstance(r, dict) or not r.get("chunk_bytes"):
                continue
            entries = r.get("entries", r.get("cache_entries",
                                             (keys or 0) if section == "results" else None))
            if entries is None:
                continue
            own = r.get("switch_hit_ns_per_frame") or r.get("ns_per_frame")
            pps = [r[k] for k in PPS_KEYS if r.get(k)]
            if own:
                ns, how = float(own), "program run time per frame (bpf_stats)"
            elif pps:
                ns = 1e9 / min(pps)
                how = f"1e9 / {PPS_KEYS[[r.get(k) for k in PPS_KEYS].index(min(pps))]} (one core)"
            else:
                continue
            out.append({"entry": f"{section}[{i}]", "entries": int(entries),
                        "chunk_bytes": int(r["chunk_bytes"]), "ns_per_frame": round(ns, 1),
                        "how": how})
    return out


def pick_entry(entries: list[dict], chunk_bytes: int) -> dict:
    """The entry at the chunk size nearest ``chunk_bytes`` (ties: the larger) with the largest
    cache there (ties: the costlier)."""
    near = min(entries, key=lambda e: (abs(e["chunk_bytes"] - chunk_bytes), -e["chunk_bytes"]))
    at = [e for e in entries if e["chunk_bytes"] == near["chunk_bytes"]]
    return max(at, key=lambda e: (e["entries"], e["ns_per_frame"]))


@lru_cache(maxsize=8)
def _measured(path: str, chunk_bytes: int, stamp=None) -> tuple:
    """The priced entry (``stamp``: the file's mtime and size, so a rewritten file is read
    again)."""
    try:
        entries = throughput_entries(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise SimError(f"no throughput result at {path}: run `testbed bench throughput --json "
                       f"{THROUGHPUT_JSON}` or give the data plane's ns per frame "
                       f"(--xdp-ns-per-frame)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SimError(f"{path} is not a throughput result ({exc})") from None
    if not entries:
        raise SimError(f"{path} has no switch-hit measurement (switch_hit_pps, hit_pps_* or "
                       f"switch_hit_ns_per_frame with chunk_bytes) to price the data plane with")
    e = pick_entry(entries, chunk_bytes)
    out = {"ns_per_frame": e["ns_per_frame"], "entry": e["entry"], "entries": e["entries"],
           "measured_chunk_bytes": e["chunk_bytes"], "how": e["how"]}
    if e["entries"] < MIN_ENTRIES:
        big = [x for x in entries if x["entries"] >= MIN_ENTRIES]
        out["fallback"] = (f"no entry of >= {MIN_ENTRIES:,} cache entries at "
                           f"{e['chunk_bytes']} B chunks in this file; priced at its largest "
                           f"there ({e['entries']:,} entries)"
                           + (f"; at {MIN_ENTRIES:,}+ it has only "
                              + ", ".join(f"{x['entry']} ({x['entries']:,} x {x['chunk_bytes']} B: "
                                          f"{x['ns_per_frame']} ns)" for x in big) if big else ""))
    return tuple(out.items())
