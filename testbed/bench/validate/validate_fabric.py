"""`testbed sim validate --serve --racks R`: the fabric model (testbed.sim.fabric_serve_model)
against `testbed bench serve --racks R` (testbed.bench.serve.serve_fabric) at the bench's own point,
as validate_serve does it for one switch. For each mode a fabric of that mode's switches is
built and its timing constants measured with every node probing at once
(validate_serve.calibrate: the fetch engine's round trip from h1 through its rack switch, the
uplink and the pool-side switch on idle links, and the box's wake-up latency; the link rates are
the configured ones); then the bench runs its burst and Zipf workloads in every mode with its own
code (``run_fabric``); then the model replays the same request lists (bench serve's
make_workloads, rebuilt from the result's config: the workloads are seeded and the pool
addresses are the testbed's) with those constants, switchd's default policy at the testbed's
cache size (entries / chunks per block), 1 s interval and 1/16 fill headroom on every switch,
in the bench's placement (independent, or split: fabric_serve_model).

Compared per (workload, mode): TTFT p50 (target: within 10 %) and p99, the hit ratio of each
level the mode runs a switch at (hits / (hits + misses + coalesced GETs), target: within 20 %
of the measured ratio, 1 pp at least: testbed.sim.verdict), the bytes each rack's uplink
delivered into the rack and each pool node's egress.
``compare_fabric`` builds the comparison from a result `bench serve --racks` already wrote
(``--live-json``; a validation's own result too, its ``live`` part): its constants then come
from the result (a validation's ``calibration``), else from the committed single-switch
validation (bench/results/sim-validate-serve.json: its switch testbed's for the switch modes,
its bridge testbed's for the bridge), which the output names. Result:
bench/results/sim-validate-fabric.json."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ...lab.topology import SUBNET, TestbedError
from ...sim.config import MODELS, result_file
from ...sim.fabric_serve_model import LEVELS, check_modes, check_shape, simulate_fabric
from ...sim.serve_model import Calibration, summarise
from ...sim.verdict import FLOOR, RELATIVE, relative_agrees, share_agrees, share_bound

TARGET_P50 = 0.10
INTERVAL = 1.0                                  # switchd's default policy step
CACHE_ENTRIES = 65536                           # the testbed's switch cache (Lab's default)
SERVE_VALIDATION = "bench/results/sim-validate-serve.json"
MODEL_WORKLOADS = ("burst", "zipf")             # incast has no serving loop to model


def pool_addrs(pools: int) -> list[str]:
    """The testbed's pool node addresses (testbed.lab.topology: .101, .102, ...)."""
    return [f"{SUBNET}.{100 + j}" for j in range(1, pools + 1)]


def bottleneck_gbit(link_gbit: float, pool_link_gbit: float | None, hosts_per_rack: int,
                    oversub: float) -> float:
    """The slowest link of one host's fetch from a pool node on idle links."""
    return min(link_gbit, pool_link_gbit or link_gbit, link_gbit * hosts_per_rack / oversub)


def _cal_entry(cal: Calibration) -> dict:
    return {"link_bytes_per_s": round(cal.link_bytes_per_s, 1), "rtt_s": round(cal.rtt_s, 5),
            "wake_s": round(cal.wake_s, 5), **cal.source}


def constants(live: dict, calibration: dict | None = None) -> tuple[dict, str]:
    """Per mode {rtt_s, wake_s}: ``calibration`` (mode -> dict), else the live result's own
    (a validation's), else the committed single-switch validation's; and where they came from."""
    modes = sorted({r["mode"] for r in live["results"]})
    given = calibration or live.get("calibration")
    if given:
        missing = [m for m in modes if m not in given]
        if missing:
            raise TestbedError(f"no calibration for mode {missing[0]!r}")
        return {m: given[m] for m in modes}, "given" if calibration else "the live result's"
    path, shown, stamp = result_file(SERVE_VALIDATION)
    if stamp is None:
        raise TestbedError(f"no calibration in the live result and no {SERVE_VALIDATION}: run "
                           f"`testbed sim validate --serve` first or pass one")
    cals = json.loads(path.read_text())["calibration"]
    return ({m: cals["bridge" if m == "bridge" else "switch"] for m in modes},
            f"{shown} (its switch testbed's round trip and wake-up for the switch modes, its "
            f"bridge testbed's for the bridge)")


def placement_of(cfg: dict) -> str:
    """A result's placement (results before --placement named theirs in a sentence)."""
    p = str(cfg.get("placement", "independent"))
    return "independent" if p.startswith("independent") else p


def model_rows(cfg: dict, consts: dict, pairs, log=None) -> dict:
    """The model at a `bench serve --racks` result's configuration ``cfg``: one result per
    (workload, mode) of ``pairs``, with per-mode constants ``consts`` (rtt_s, wake_s)."""
    from ..serve.serve import make_workloads
    from ...sim.trace import DEFAULT_TRACE
    racks, hosts, pools = cfg["racks"], cfg["hosts_per_rack"], cfg["pools"]
    check_shape(racks, hosts, cfg["oversub"])
    preset = MODELS[cfg.get("preset", "llama3-8b")]
    # in the bench's order (a workload's namespace, and so zipf's placement, is its index)
    asked = {w for w, _ in pairs}
    names = [w for w in (cfg.get("workloads") or MODEL_WORKLOADS) if w in MODEL_WORKLOADS]
    names += sorted(asked - set(names))
    wls = make_workloads(names, racks * hosts, pool_addrs(pools), preset, DEFAULT_TRACE, 0,
                         cfg.get("scale", 1.0))
    for name in names:
        want = (cfg.get("workloads") or {}).get(name)
        if want is not None and want != wls[name].params:
            raise TestbedError(f"the {name} workload of this result is not the one bench serve "
                               f"makes now ({want} against {wls[name].params})")
    pool_rate = (cfg.get("pool_link_gbit") or cfg["link_gbit"]) * 1e9 / 8
    placement, entries = placement_of(cfg), cfg.get("cache_entries", CACHE_ENTRIES)
    out = {}
    for name, mode in pairs:
        c = consts[mode]
        cal = Calibration(cfg["link_gbit"] * 1e9 / 8, c["rtt_s"], cfg["chunk_bytes"],
                          cfg["block_bytes"], wake_s=c.get("wake_s", 0.0))
        wl = wls[name]
        out[(name, mode)] = m = simulate_fabric(
            wl.requests, wl.preload, mode, pool_addrs(pools), wl.params["ns"], cal,
            preset.prefill_tokens_per_s, racks, hosts, cfg["oversub"], pool_rate,
            cache_blocks=entries // cal.chunks, interval=INTERVAL, placement=placement)
        if log:
            log(f"  model {name} {mode}: ttft p50 {summarise(m['requests'])['ttft_p50_s']} "
                f"hit {m['hit_ratio']}")
    return out


def compare_row(row: dict, model: dict) -> dict:
    """One (workload, mode): the bench's row against the model's result."""
    ms = summarise(model["requests"])
    rel = (lambda a, b: round(b / a - 1, 4) if a else None)
    ttft = {q: {"live": row[q], "model": ms[q], "error": rel(row[q], ms[q])}
            for q in ("ttft_p50_s", "ttft_p99_s")}
    hits = {}
    for lv in LEVELS:
        a, b = row["hit_ratio"].get(lv), model["hit_ratio"][lv]
        hits[lv] = {"live": a, "model": b,
                    "difference_pp": round(100 * (b - a), 2) if None not in (a, b) else None,
                    "bound_pp": round(100 * share_bound(a), 2) if a is not None else None,
                    "agrees": share_agrees(a, b) if a is not None or b is not None else None}
    ok_p50 = relative_agrees(row["ttft_p50_s"], ms["ttft_p50_s"], TARGET_P50)
    ok_hits = all(h["agrees"] is not False for h in hits.values())
    return {"workload": row["workload"], "mode": row["mode"], **ttft, "hit_ratio": hits,
            "uplink_bytes": {"live": row["uplink_bytes"], "model": model["uplink_bytes"]},
            "pool_egress_bytes": {"live": row["pool_egress_bytes"],
                                  "model": model["pool_egress_bytes"]},
            "model_served_share": model["served_share"],
            "ttft_p50_within_target": ok_p50, "hit_ratio_within_target": ok_hits}


def compare_fabric(live: dict, calibration: dict | None = None, log=None) -> dict:
    """The comparison of a `bench serve --racks` result (``live``: run_fabric's output, or a
    validation's) with the model at its configuration. No testbed: the model only."""
    cfg = live["config"]
    rows = [r for r in live["results"] if r["workload"] in MODEL_WORKLOADS]
    if not rows:
        raise TestbedError(f"no {' or '.join(MODEL_WORKLOADS)} rows in this result")
    check_modes([r["mode"] for r in rows], placement_of(cfg))
    consts, source = constants({**live, "results": rows}, calibration)
    models = model_rows(cfg, consts, [(r["workload"], r["mode"]) for r in rows], log)
    out = [compare_row(r, models[(r["workload"], r["mode"])]) for r in rows]
    return {"config": {k: cfg[k] for k in ("racks", "hosts_per_rack", "pools", "oversub",
                                           "link_gbit", "pool_link_gbit", "chunk_bytes",
                                           "block_bytes", "scale") if k in cfg}
            | {"switch": {"policy": "switchd default", "interval_s": INTERVAL,
                          "cache_entries": cfg.get("cache_entries", CACHE_ENTRIES),
                          "placement": placement_of(cfg), "fill_headroom": "1/16 of the cache"},
               "measured_from": "the bench's last phase (after a burst's warm-up)"},
            "calibration": consts, "calibration_source": source, "rows": out,
            "targets": {"ttft_p50_relative": TARGET_P50, "hit_ratio_relative": RELATIVE,
                        "hit_ratio_floor": FLOOR},
            "within_targets": {f"{c['workload']}/{c['mode']}": c["ttft_p50_within_target"]
                               and c["hit_ratio_within_target"] for c in out}}


def compare_file(path: str, log=None) -> dict:
    """``compare_fabric`` of a result file; one clear line if it is not one."""
    try:
        live = json.loads(Path(path).read_text())
        if "results" not in live and isinstance(live.get("live"), dict):   # a validation's
            live = {**live["live"], "calibration": live.get("calibration")}
        return compare_fabric(live, log=log)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TestbedError(f"{path}: not a `bench serve --racks` result ({exc!r})") from None


def run_validate_fabric(racks: int = 2, hosts_per_rack: int = 4, pools: int = 2,
                        oversub: float = 2.0, link_gbit: float = 0.025,
                        pool_link_gbit: float | None = None, workloads=MODEL_WORKLOADS,
                        modes=("bridge", "rack", "pool-side", "fabric"), scale: float = 1.0,
                        json_path: str | None = None, prefix: str | None = None,
                        model: str = "llama3-8b", log=print, placement: str = "independent",
                        cache_entries: int = CACHE_ENTRIES) -> dict:
    """Calibrate a fabric of each mode, run the bench, run the model, compare."""
    from ..serve import serve as bench_serve
    from ..serve.serve_fabric import check, fabric_lab, run_fabric
    from ...results import write_json
    from .validate_serve import calibrate
    check(racks, hosts_per_rack, oversub, workloads, modes, placement)
    bad = [w for w in workloads if w not in MODEL_WORKLOADS]
    if bad:
        raise TestbedError(f"workload {bad[0]!r}: the model replays "
                           f"{', '.join(MODEL_WORKLOADS)}")
    block_bytes, chunk = bench_serve.block_bytes_for(link_gbit), bench_serve.CHUNK
    prefix = prefix or f"vf{os.getpid() % 1000}"
    gbit = bottleneck_gbit(link_gbit, pool_link_gbit, hosts_per_rack, oversub)
    t0, cals = time.monotonic(), {}
    for mode in modes:
        log(f"validate --racks: mode {mode}: building the fabric testbed, probing its timing ...")
        with fabric_lab(prefix, mode, racks, hosts_per_rack, pools, oversub, link_gbit,
                        pool_link_gbit, placement, cache_entries) as lab:
            cal = calibrate(lab, block_bytes, chunk, gbit)
        cals[mode] = _cal_entry(cal)
        log(f"{mode}: round trip {cal.rtt_s * 1e3:.1f} ms, wake-up {cal.wake_s * 1e3:.1f} ms "
            f"(probed rate x {cal.source['probed_rate_vs_configured']})")
    live = run_fabric(racks, hosts_per_rack, pools, oversub, link_gbit, pool_link_gbit,
                      workloads, modes, model, scale, prefix=prefix, log=log,
                      placement=placement, cache_entries=cache_entries)
    out = compare_fabric(live, cals, log)
    out.update(live=live, completed=live["summary"]["all_byte_exact"],
               seconds=round(time.monotonic() - t0, 1))
    write_json(json_path, out)
    return out
