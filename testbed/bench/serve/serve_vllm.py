"""`testbed bench vllm`: `vllm serve` on the testbed's inference nodes, measured by vLLM's own
client, with and without kvswitch.

S servers (default 2), each a `vllm serve` of SmolLM2-135M (the real model `make setup`
installs) in its own inference node, one or more pool nodes, every link shaped
(testbed.lab.links). One `vllm bench serve` per server (testbed.bench.serve.vllm_server), all
started together with the same seed on vLLM's ``prefix_repetition`` dataset, so every server is
asked for the same prefixes at the same moments (cross-server sharing), while each server's own
KV space (``--num-gpu-blocks-override``) is smaller than the prefixes' working set, as HBM is in a
deployment. The clients run the requests twice: a warm-up pass at twice the rate (every prefix
gets computed somewhere, as a deployment's hot prefixes have been long before), then the
measured pass, the same requests again. Modes, one testbed each, one after another in one run:

  local   vLLM alone: its own prefix cache only;
  pool    the kvswitch connector over a plain Linux bridge (no switch program): every load
          from the pool node that owns the block;
  switch  the connector through kvswitch, switchd's default policy (nothing admitted by hand).

The JSON keeps vLLM's own result per server and mode, unchanged (TTFT/TPOT/E2E percentiles,
throughput, completed and failed requests, each request's TTFT and text), and adds the switch's
hit ratio, the bytes that left the pool nodes, whether every request's output text is the same
in every mode (temperature 0) and the box's unshaped capacity (a block of a prefix's KV fetched
through the switch on an unshaped testbed), which the link rates must stay well under for the
links, not this machine, to bound the transfers.
"""
from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ...lab import Lab, TestbedError
from ...results import write_json
from .vllm_server import ServerSpec, VllmServer, Workload, run_clients

MODES = ("local", "pool", "switch")
NS = 1
CHUNK = 3072


@dataclass(frozen=True)
class VllmBench:
    """One run's configuration (the CLI's options)."""
    servers: int = 2
    pools: int = 1
    link_gbit: float = 0.5
    pool_link_gbit: float | None = None          # default: link_gbit
    workload: Workload = field(default_factory=Workload)
    kv_blocks: int = 12                          # per server, of block_size tokens
    block_size: int = 128
    switch_cache_mib: int = 256                  # the switch's cache (chunks of CHUNK bytes)
    modes: tuple[str, ...] = MODES
    prefix: str = "vb"

    def check(self) -> None:
        wl = self.workload
        if not 1 <= self.servers <= 16 or not 1 <= self.pools <= 8:
            raise TestbedError("1..16 servers and 1..8 pool nodes")
        if not self.modes or set(self.modes) - set(MODES):
            raise TestbedError(f"modes are {', '.join(MODES)}, not {', '.join(self.modes)}")
        if wl.prompts < wl.prefixes:
            raise TestbedError(f"--prompts ({wl.prompts}) must be at least --prefixes "
                               f"({wl.prefixes}): vLLM's dataset gives each prefix a share")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise TestbedError(f"--kv-blocks {self.kv_blocks} of {self.block_size} tokens "
                               f"cannot hold one request of {self.max_model_len} tokens")

    @property
    def max_model_len(self) -> int:
        wl = self.workload
        return -(-(wl.prefix_len + wl.suffix_len + wl.output_len) // self.block_size) * \
            self.block_size

    def spec(self, model_dir: str, connector: dict | None) -> ServerSpec:
        return ServerSpec(model_dir, "smollm2", self.max_model_len, self.kv_blocks,
                          self.block_size, connector=connector)


def run_vllm_bench(cfg: VllmBench, json_path: str | None = None, plot_path: str | None = None,
                   log=print, busy: bool = False) -> dict:
    """The light workload's modes (module docstring), or with ``busy`` the busy workload's
    passes (``vllm_busy``)."""
    from testbed.demos import realmodel
    cfg.check()
    model_dir, model_id = str(realmodel.model_dir()), None
    if not (realmodel.model_dir() / "sha256").exists():
        raise TestbedError(f"the real model is not converted at {model_dir}: run 'make model'")
    model_id = realmodel.model_id()
    layout = _kv_layout(model_dir)
    prefix_kv = cfg.workload.prefix_len * layout["kv_bytes_per_token"]
    t0 = time.time()
    if busy:
        return _run_busy(cfg, model_dir, model_id, layout, json_path, log, t0)
    log(f"bench vllm: modes {', '.join(cfg.modes)} on {cfg.servers} servers; first the box's "
        "unshaped capacity ...")
    unshaped = measure_unshaped(cfg, prefix_kv, log)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-vllm-") as tmp:
        for mode in cfg.modes:
            rows += run_mode(cfg, mode, model_dir, model_id, tmp, log)
    wl = cfg.workload
    config = {**{k: v for k, v in asdict(cfg).items() if k not in ("workload", "prefix")},
              **asdict(wl), "model": model_id, "dtype": "float32", **layout,
              "prefix_kv_bytes": prefix_kv, "chunk_bytes": CHUNK,
              "kv_tokens_per_server": cfg.kv_blocks * cfg.block_size,
              "working_set_tokens": wl.prefixes * wl.prefix_len,
              "pool_link_gbit": cfg.pool_link_gbit or cfg.link_gbit, "cpus": os.cpu_count(),
              "load_average_end": round(os.getloadavg()[0], 2),
              "seconds": round(time.time() - t0, 1),
              "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0))}
    out = {"config": config, "results": rows, "outputs_match": outputs_match(rows),
           "unshaped_gbit": unshaped["switch_gbit"], "unshaped": unshaped,
           "summary": summary(rows)}
    out["summary"]["outputs_match"] = out["outputs_match"]
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def _run_busy(cfg: VllmBench, model_dir: str, model_id: str, layout: dict,
              json_path: str | None, log, t0: float) -> dict:
    from .vllm_busy import busy_config, busy_summary, run_busy
    with tempfile.TemporaryDirectory(prefix="kvbench-vllm-busy-") as tmp:
        rows = run_busy(cfg, model_dir, model_id, tmp, log)
    out = {"config": {**busy_config(cfg), "model": model_id, **layout, "cpus": os.cpu_count(),
                      "seconds": round(time.time() - t0, 1),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0))},
           "results": rows, "summary": busy_summary(rows)}
    out["outputs_match"] = out["summary"]["outputs_match"]
    write_json(json_path, out)
    return out


def _kv_layout(model_dir: str) -> dict:
    import json
    from pathlib import Path
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return {"layers": c["num_hidden_layers"], "kv_heads": kv_heads, "head_dim": head_dim,
            "kv_bytes_per_token": 2 * c["num_hidden_layers"] * kv_heads * head_dim * 4}


def run_mode(cfg: VllmBench, mode: str, model_dir: str, model_id: str, tmp: str,
             log) -> list[dict]:
    """One mode on a testbed of its own: servers up, every client at once, counters."""
    lab_kw = dict(hosts=cfg.servers, pools=cfg.pools, chunk_size=CHUNK,
                  cache_entries=max(1024, (cfg.switch_cache_mib << 20) // CHUNK),
                  pool_capacity="2GiB", switch=mode == "switch", link_gbit=cfg.link_gbit,
                  pool_link_gbit=cfg.pool_link_gbit or cfg.link_gbit)
    log(f"bench vllm: {mode}: building the testbed, starting {cfg.servers} servers ...")
    with Lab(cfg.prefix, **lab_kw) as lab:
        connector = None if mode == "local" else {
            "pools": lab.pool_addrs, "namespace": NS, "chunk_size": CHUNK, "model_id": model_id}
        spec = cfg.spec(model_dir, connector)
        ncpu = len(os.sched_getaffinity(0))
        servers = [VllmServer(lab.topo, n.name, spec, os.path.join(tmp, f"{mode}-{n.name}.log"),
                              core=i % ncpu) for i, n in enumerate(lab.topo.host_nodes)]
        try:
            t0 = time.monotonic()
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
            log(f"bench vllm: {mode}: {len(servers)} servers ready in "
                f"{time.monotonic() - t0:.0f} s")
            wl = cfg.workload
            timeout = 600 + 4 * wl.prompts / wl.rate
            # the same requests once before (at twice the rate): every prefix has been computed
            # somewhere, as hot prefixes have in a deployment; measured: the second pass
            nodes = [s.node for s in servers]
            log(f"bench vllm: {mode}: the warm-up pass ...")
            warm = run_clients(lab.topo, nodes, replace(wl, rate=2 * wl.rate), spec, tmp,
                               f"{mode}-warmup", timeout)
            log(f"bench vllm: {mode}: the measured pass ...")
            pools = [n.name for n in lab.topo.pool_nodes]
            egress0 = sum(lab.link_bytes(p, "tx") for p in pools)
            counters0 = lab.counters() if mode == "switch" else None
            marks = [s.log_size() for s in servers]
            t0 = time.monotonic()
            results = run_clients(lab.topo, nodes, wl, spec, tmp, mode, timeout)
            seconds = time.monotonic() - t0
            egress = sum(lab.link_bytes(p, "tx") for p in pools) - egress0
            counters = _delta(lab.counters(), counters0) if counters0 is not None else None
            metrics = [s.metrics() for s in servers]
        finally:
            for s in servers:
                s.stop()
        rows = []
        for i, (s, r, w, m) in enumerate(zip(servers, results, warm, metrics)):
            rows.append({"mode": mode, "server": i, "node": s.node, "vllm": r, "warmup": w,
                         "server_metrics": m,
                         "switch_hit_ratio": hit_ratio(counters), "pool_egress_bytes": egress,
                         "clients_seconds": round(seconds, 2),
                         "connector_log": _connector_lines(s.log()),
                         "connector_loads": loads_summary(s.log(since=marks[i])),
                         **({"switch_counters": counters} if counters else {})})
        ttfts = [t for r in results for t in r["ttfts"]]
        log(f"bench vllm: {mode}: TTFT p50 {np.percentile(ttfts, 50):.3f} s, p99 "
            f"{np.percentile(ttfts, 99):.3f} s, pool egress {egress / 1e6:.1f} MB"
            + (f", switch hit ratio {hit_ratio(counters):.3f}" if counters else ""))
        return rows


def _delta(now: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def hit_ratio(counters: dict | None) -> float | None:
    """Of the GETs the switch saw (answered, forwarded or held), the share it answered from
    its cache."""
    if not counters:
        return None
    gets = sum(counters.get(k, 0) for k in ("get_hit", "get_miss", "coalesced"))
    return round(counters.get("get_hit", 0) / gets, 4) if gets else 0.0


def _connector_lines(text: str, keep: int = 20) -> list[str]:
    """The connector's warnings (failed loads, silent pool nodes), at most ``keep``."""
    lines = [ln.split("] ", 1)[-1] for ln in text.splitlines()
             if "kvswitch" in ln and ("WARNING" in ln or "ERROR" in ln)]
    return lines[:keep]


LOADED = re.compile(r"kvswitch: loaded \S+: (\d+) blocks, ([\d.]+) MB in ([\d.]+) s; chunks: (\d+) "
                    r"from the switch, (\d+) replicated, (\d+) from the pool, (\d+) asked again")


def loads_summary(text: str) -> dict:
    """The connector's loads as its log lines tell them (one per load): how many, their
    seconds (p50, p99), MB, where the chunks came from, failed loads."""
    rows = [tuple(float(x) for x in m.groups()) for m in LOADED.finditer(text)]
    secs = [r[2] for r in rows]
    return {"loads": len(rows), "failed": text.count("kvswitch: load of "),
            "seconds_p50": _pct(secs, 50), "seconds_p99": _pct(secs, 99),
            "mb": round(sum(r[1] for r in rows), 1),
            "chunks_from_switch": int(sum(r[3] for r in rows)),
            "chunks_replicated": int(sum(r[4] for r in rows)),
            "chunks_from_pool": int(sum(r[5] for r in rows)),
            "chunks_asked_again": int(sum(r[6] for r in rows))}


def outputs_match(rows: list[dict]) -> bool:
    """Every request's generated text identical across modes, servers and both passes (the
    same prompts in the same order everywhere, greedy)."""
    texts = [r[k].get("generated_texts") for r in rows for k in ("vllm", "warmup")]
    return bool(texts) and texts[0] is not None and all(t == texts[0] for t in texts)


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def summary(rows: list[dict]) -> dict:
    by_mode: dict[str, list[dict]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    s: dict = {"ttft_p50_s": {}, "ttft_p99_s": {}, "failed_requests": {}, "completed": {},
               "pool_egress_bytes": {}, "switch_hit_ratio": by_mode.get("switch", [{}])[0].get(
                   "switch_hit_ratio")}
    for mode, rs in by_mode.items():
        ttfts = [t for r in rs for t in r["vllm"]["ttfts"]]
        s["ttft_p50_s"][mode], s["ttft_p99_s"][mode] = _pct(ttfts, 50), _pct(ttfts, 99)
        s["failed_requests"][mode] = sum(r["vllm"]["failed"] for r in rs)
        s["completed"][mode] = sum(r["vllm"]["completed"] for r in rs)
        s["pool_egress_bytes"][mode] = rs[0]["pool_egress_bytes"]
        # how far apart the clients' first requests went out (same seed, started together)
        starts = [r["vllm"]["start_times"][0] for r in rs if r["vllm"].get("start_times")]
        s.setdefault("client_start_skew_s", {})[mode] = (round(max(starts) - min(starts), 3)
                                                         if len(starts) > 1 else 0.0)
    p50, p99 = s["ttft_p50_s"], s["ttft_p99_s"]
    if p50.get("switch") is not None and p50.get("local"):
        s["switch_over_local_p50"] = round(p50["switch"] / p50["local"], 3)
    if p99.get("switch") is not None and p99.get("pool"):
        s["switch_over_pool_p99"] = round(p99["switch"] / p99["pool"], 3)
    return s


def measure_unshaped(cfg: VllmBench, nbytes: int, log, reps: int = 3) -> dict:
    """The box's capacity without shaping: a block of ``nbytes`` (a prefix's KV) fetched by an
    inference node through the switch, from the pool node once (the switch learning it, the
    block admitted by hand) and then from the switch ``reps`` times; Gbit/s of each."""
    key, block = os.urandom(16), np.random.default_rng(1).bytes(nbytes)
    with Lab(f"{cfg.prefix}u", hosts=1, pools=1, chunk_size=CHUNK,
             cache_entries=nbytes // CHUNK + 1024, pool_capacity="1GiB") as lab:
        lab.put("h1", NS, key, block)
        lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
        rates = []
        for i in range(reps + 1):
            got, data = lab.get("h1", NS, key)
            if data != block:
                raise TestbedError("the unshaped fetch was not byte-exact")
            rates.append(round(8 * nbytes / got["seconds"] / 1e9, 3))
    out = {"block_bytes": nbytes, "pool_gbit": rates[0],
           "switch_gbit": statistics.median(rates[1:]), "switch_runs_gbit": rates[1:]}
    log(f"bench vllm: unshaped, a {nbytes / 1e6:.1f} MB block: {out['pool_gbit']} Gbit/s from "
        f"the pool node, {out['switch_gbit']} from the switch")
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path
    rows, c, s = out["results"], out["config"], out["summary"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(modes):
        t = np.sort([x for r in rows if r["mode"] == m for x in r["vllm"]["ttfts"]])
        axes[0].plot(t, np.arange(1, len(t) + 1) / len(t), label=m, color=f"C{i}")
        axes[1].bar(i - 0.2, s["ttft_p50_s"][m], 0.4, color=f"C{i}")
        axes[1].bar(i + 0.2, s["ttft_p99_s"][m], 0.4, color=f"C{i}", alpha=0.45)
    axes[0].set(xlabel="TTFT, s (vllm bench serve)", ylabel="share of requests",
                title=f"{c['servers']} vllm serve, links {c['link_gbit'] * 1000:g} Mbit/s, "
                      f"unshaped {out['unshaped_gbit']:g} Gbit/s")
    axes[0].legend()
    axes[1].set(xticks=range(len(modes)), xticklabels=modes, ylabel="TTFT, s",
                title="p50 (dark) and p99 (light)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
