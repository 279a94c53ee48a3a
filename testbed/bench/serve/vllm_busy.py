"""`testbed bench vllm --workload busy`: `vllm serve` under load, measured by vLLM's own client,
where a cost of loading would show: requests decode while others load, and every prefix is one
the warm-up never saw.

The workload (``BUSY``): vLLM's ``prefix_repetition`` dataset at a higher rate and with longer
outputs than the light one, so several requests decode while a prompt's prefix loads. No
warm-up pass: server 0's client starts first, every other server's ``OFFSET_S`` later with the
same seed (the same prompts in the same order), so within the measured pass server 0 computes
and saves each prefix and the others load it, ``OFFSET_S`` later, or compute it themselves.

The passes, each on a testbed of its own (two pool nodes; the connector holds each block on
both, ``replicas`` 2, so that the fault pass differs from the others by the fault alone), vLLM
alone and the switch with asynchronous loads twice each, in the order A B ... B A, so that the
verdicts against vLLM alone compare passes run side by side (``ROUNDS``):

  local   vLLM alone (its own prefix cache);
  pool    the connector over a plain bridge, loads asynchronous;
  switch  the connector through kvswitch, loads synchronous (``load_mode: sync``: a load holds
          the engine's step) and then asynchronous (the default: the request waits for its
          blocks while the others keep decoding);
  switch, loads asynchronous, with pool node p1 killed (its server SIGKILLed, its link down) a
          few seconds into the loading servers' requests: loads fail over to the replica;
  switch, loads asynchronous, with p1 hung (its server stopped, SIGSTOP) for ``HANG_S`` at the
          same moment, then continued: a node that is not dead, only silent for a while.

Rows: ``{"workload": "busy", "mode", "loads", "fault", "round", "server", "vllm": vLLM's own
result}`` and the connector's log lines; ``summary`` has vLLM's TTFT, TPOT and ITL per pass over
the loading servers (1..S-1; a pass run twice: both runs' requests), each round's switch ÷ vLLM
alone, and the targets: ITL p99 through the switch with asynchronous loads within 1.1x vLLM
alone's, TTFT p50 at most 0.5x (each the median of the rounds' ratios: vLLM alone's TTFT moved
1.09-1.81 s between runs on one day while the switch's stayed at 0.78-0.88 s, so a single pair
measured the spread), no failed request and every text identical in
every pass (temperature 0); with a pool node killed or hung, TTFT p99 and ITL p99 within 2x
the same pass's without the fault (a death costs a silence and the replica's reads, never a
stall).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from ...lab import Lab, TestbedError
from ...lab.fault_kinds import Target, heal, inject
from ...lab.topology import ip
from .vllm_server import VllmServer, Workload, run_clients

# one core prefills SmolLM2's 512-token prefix in ~2.7 s and decodes a token in tens of ms:
# at 0.3 requests/s with 96 tokens out a server computing its prefixes is near saturation and
# one or two requests decode while another's prefix loads (or is prefilled, in chunks)
BUSY = Workload(prefix_len=512, suffix_len=32, prefixes=8, output_len=96, prompts=16,
                rate=0.3, seed=7)
KV_BLOCKS = 24               # vLLM blocks per server: 3,072 tokens, 4 requests (a working set
#                              of 4,096 prefix tokens still does not fit)
OFFSET_S = 20.0              # the loading servers' clients start this much later
KILL_AFTER_S = 10.0          # the fault strikes this long into the loading servers' pass
HANG_S = 10.0                # how long pool-hang keeps p1 stopped
POOLS = 2
TARGETS = {"itl_p99_switch_over_local": 1.1, "ttft_p50_switch_over_local": 0.5,
           # a pool node's death costs its silence and a replica's reads, never a stall
           "ttft_p99_fault_over_no_fault": 2.0, "itl_p99_fault_over_no_fault": 2.0,
           "ttft_p99_hang_over_no_fault": 2.0, "itl_p99_hang_over_no_fault": 2.0}
FAULT_VERDICTS = {"pool-kill": "fault", "pool-hang": "hang"}   # the verdicts' names per fault


@dataclass(frozen=True)
class Pass:
    mode: str                # local, pool, switch
    loads: str | None        # sync, async (None: no connector)
    fault: str | None = None
    round: int = 0           # vLLM alone and switch-async run once a round (ROUNDS)

    @property
    def name(self) -> str:
        return "-".join(x for x in (self.mode, self.loads, self.fault) if x)


PASSES = (Pass("local", None), Pass("pool", "async"), Pass("switch", "sync"),
          Pass("switch", "async"), Pass("switch", "async", "pool-kill"),
          Pass("switch", "async", "pool-hang"), Pass("switch", "async", round=1),
          Pass("local", None, round=1))
ROUNDS = 1 + max(p.round for p in PASSES)


def run_busy(cfg, model_dir: str, model_id: str, tmp: str, log) -> list[dict]:
    """Every pass of the busy workload (``cfg``: serve_vllm.VllmBench); the rows."""
    if cfg.servers < 2:
        raise TestbedError("--workload busy needs 2 servers at least (one computes, the "
                           "others load)")
    rows = []
    for p in PASSES:
        rows += _run_pass(cfg, p, model_dir, model_id, tmp, log)
    return rows


def _connector(lab, model_id: str, p: Pass) -> dict | None:
    if p.loads is None:
        return None
    return {"pools": lab.pool_addrs, "namespace": 1, "chunk_size": 3072, "model_id": model_id,
            "replicas": POOLS, "load_mode": p.loads}


def _run_pass(cfg, p: Pass, model_dir: str, model_id: str, tmp: str, log) -> list[dict]:
    from .serve_vllm import CHUNK, _connector_lines, loads_summary
    name = p.name + (f"-round{p.round + 1}" if p.round else "")
    log(f"bench vllm busy: {name}: building the testbed, starting {cfg.servers} servers ...")
    lab_kw = dict(hosts=cfg.servers, pools=POOLS, chunk_size=CHUNK,
                  cache_entries=max(1024, (cfg.switch_cache_mib << 20) // CHUNK),
                  pool_capacity="2GiB", switch=p.mode == "switch", link_gbit=cfg.link_gbit,
                  pool_link_gbit=cfg.pool_link_gbit or cfg.link_gbit)
    wl = cfg.workload
    with Lab(cfg.prefix, **lab_kw) as lab:
        spec = cfg.spec(model_dir, _connector(lab, model_id, p))
        ncpu = len(os.sched_getaffinity(0))
        servers = [VllmServer(lab.topo, n.name, spec, os.path.join(tmp, f"{name}-{n.name}.log"),
                              core=i % ncpu) for i, n in enumerate(lab.topo.host_nodes)]
        fault: dict = {}
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
            log(f"bench vllm busy: {name}: the pass (the loading servers {OFFSET_S:g} s "
                "later) ...")
            timer = None
            if p.fault:
                timer = threading.Timer(OFFSET_S + KILL_AFTER_S, STRIKE[p.fault], (lab, fault))
                timer.start()
            delays = [0.0] + [OFFSET_S] * (len(servers) - 1)
            results = run_clients(lab.topo, [s.node for s in servers], wl, spec, tmp, name,
                                  600 + OFFSET_S + 4 * wl.prompts / wl.rate, delays=delays)
            if timer is not None:
                timer.cancel()
        finally:
            for s in servers:
                s.stop()
    rows = [{"workload": "busy", "mode": p.mode, "loads": p.loads, "fault": p.fault,
             "round": p.round, "server": i, "node": s.node, "vllm": r, "start_delay_s": delays[i],
             "connector_log": _connector_lines(s.log()),
             "connector_loads": loads_summary(s.log()), **({"fault_at": fault} if fault else {})}
            for i, (s, r) in enumerate(zip(servers, results))]
    lo = [x for r in rows[1:] for x in r["vllm"]["ttfts"]]
    log(f"bench vllm busy: {name}: loading servers' TTFT p50 {np.percentile(lo, 50):.3f} s, "
        f"ITL p99 {_itl_p99(rows[1:]) or 0:.1f} ms, failed "
        f"{sum(r['vllm']['failed'] for r in rows)}")
    return rows


def _kill_pool(lab, out: dict) -> None:
    """Pool node p1 dies: its server killed, its link down (nothing answers from it)."""
    out["at"] = time.time()
    out["exit"] = lab.stop_pool(0, signal.SIGKILL)
    ip("link", "set", lab.topo.pool_nodes[0].name, "down", ns=lab.topo.switch_ns)


def _hang_pool(lab, out: dict) -> None:
    """Pool node p1 hangs for ``HANG_S``: its server stopped (SIGSTOP), then continued."""
    target = Target(pool=lab.topo.pool_nodes[0].name)
    out["at"] = time.time()
    out.update(inject(lab, "pool-hang", target))
    time.sleep(HANG_S)                     # the timer's own thread
    heal(lab, "pool-hang", target)
    out["continued_at"] = time.time()


STRIKE = {"pool-kill": _kill_pool, "pool-hang": _hang_pool}


def _itl_p99(rows: list[dict]) -> float | None:
    """Inter-token latency p99 (ms) over every request of ``rows`` (vLLM's per-request ITLs;
    its own p99 where it saved none)."""
    itls = [x for r in rows for req in r["vllm"].get("itls") or [] for x in req]
    if itls:
        return round(float(np.percentile(itls, 99)) * 1000, 2)
    vals = [r["vllm"].get("p99_itl_ms") for r in rows if r["vllm"].get("p99_itl_ms")]
    return round(max(vals), 2) if vals else None


def _pct(values, q) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def _key(row: dict) -> str:
    """The name of the pass a row is of (``Pass.name``)."""
    return Pass(row["mode"], row["loads"], row["fault"]).name


def _pass_summary(rs: list[dict]) -> dict:
    """vLLM's TTFT p50/p99, TPOT mean and ITL p99 over the loading servers of rows ``rs``;
    failed and completed requests and load failures over all of them."""
    loading = [r for r in rs if r["server"] > 0]
    ttfts = [x for r in loading for x in r["vllm"]["ttfts"]]
    tpots = [r["vllm"].get("mean_tpot_ms") for r in loading
             if r["vllm"].get("mean_tpot_ms") is not None]
    return {"ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "tpot_mean_ms": round(float(np.mean(tpots)), 2) if tpots else None,
            "itl_p99_ms": _itl_p99(loading),
            "failed": sum(r["vllm"]["failed"] for r in rs),
            "completed": sum(r["vllm"]["completed"] for r in rs),
            "load_failures": sum(r["connector_loads"].get("failed", 0) for r in rs)}


def _ratio(a: dict, b: dict, what: str) -> float | None:
    """``a``'s ``what`` over ``b``'s (None when either is missing or ``b``'s is 0)."""
    return round(a[what] / b[what], 3) if b.get(what) and a.get(what) is not None else None


def busy_summary(rows: list[dict]) -> dict:
    """Per pass, over the loading servers (server 1..): vLLM's TTFT p50/p99, TPOT mean and ITL
    p99; failed requests over every server; per round, switch-async ÷ vLLM alone; the verdicts
    (against vLLM alone: the rounds' median ratio) and their targets."""
    passes = {key: _pass_summary([r for r in rows if _key(r) == key])
              for key in dict.fromkeys(_key(r) for r in rows)}
    texts = [r["vllm"].get("generated_texts") for r in rows]
    out = {"passes": passes, "outputs_match": bool(texts) and texts[0] is not None
           and all(t == texts[0] for t in texts), "targets": TARGETS, "rounds": []}
    for n in sorted({r.get("round", 0) for r in rows}):
        local, sw = (_pass_summary([r for r in rows if _key(r) == key and
                                    r.get("round", 0) == n]) for key in ("local", "switch-async"))
        out["rounds"].append({"round": n, "local": local, "switch-async": sw, **{
            f"{what}_switch_over_local": _ratio(sw, local, f"{what}_{unit}")
            for what, unit in (("ttft_p50", "s"), ("itl_p99", "ms"))}})
    for what in ("itl_p99", "ttft_p50"):
        ratios = [r[f"{what}_switch_over_local"] for r in out["rounds"]
                  if r[f"{what}_switch_over_local"] is not None]
        if ratios:
            out[f"{what}_switch_over_local"] = round(float(np.median(ratios)), 3)
    sw = passes.get("switch-async", {})
    for kind, name in FAULT_VERDICTS.items():
        fault = passes.get(f"switch-async-{kind}", {})
        for what, unit in (("ttft_p99", "s"), ("itl_p99", "ms")):
            ratio = _ratio(fault, sw, f"{what}_{unit}")
            if ratio is not None:
                out[f"{what}_{name}_over_no_fault"] = ratio
    out["met"] = {k: out.get(k) is not None and out[k] <= v for k, v in TARGETS.items()}
    out["met"]["no_failed_request"] = not any(p["failed"] for p in passes.values())
    out["met"]["outputs_match"] = out["outputs_match"]
    return out


def busy_config(cfg) -> dict:
    return {"workload": "busy", **asdict(cfg.workload), "servers": cfg.servers, "pools": POOLS,
            "replicas": POOLS, "offset_s": OFFSET_S, "kill_after_s": KILL_AFTER_S,
            "passes": [asdict(p) for p in PASSES], "rounds": ROUNDS, "link_gbit": cfg.link_gbit,
            "kv_blocks": cfg.kv_blocks}
