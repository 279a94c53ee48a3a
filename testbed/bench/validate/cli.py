"""`testbed sim validate` and `testbed replay`: the cluster model and the policy evaluator checked
against the live testbed (registered by testbed.cli). Each parses its options and calls the
check it names (validate.run_validate, validate_serve.run_validate_serve,
validate_fabric.run_validate_fabric or .compare_file, replay.run_replay), imported when the
command runs."""
from __future__ import annotations

import json

import click

from kvproto.cli import FINITE, FloatRange
from switchd.policy import POLICIES

from ...options import capacity_value, fail_unless, json_opt, trace_opt


@click.command("validate")
@trace_opt(help="Mooncake-format JSONL trace (default: the one in testbed/traces/; with "
                "--serve: bench serve's trace workload).")
@click.option("--serve", is_flag=True,
              help="Validate at `bench serve`'s level: its workloads on a testbed, TTFT, hit "
                   "ratio per tier and pool egress against the model at the same point.")
@click.option("--limit", type=click.IntRange(4), default=2000, show_default=True,
              help="First N requests of the trace (trace replay).")
@click.option("--capacity", type=click.FloatRange(0, min_open=True), default=0.05,
              show_default=True, help="Switch cache: fraction of distinct blocks (<1) or count.")
@click.option("--speedup", type=click.FloatRange(0, min_open=True), default=20.0,
              show_default=True)
@click.option("--routing", type=click.Choice(["random", "affinity"]), default="random",
              show_default=True)
@click.option("--nodes", type=int, default=8, show_default=True,
              help="--serve: inference nodes.")
@click.option("--pools", type=int, default=2, show_default=True, help="--serve: pool nodes.")
@click.option("--link-gbit", type=float, default=0.025, show_default=True,
              help="--serve: every link's rate.")
@click.option("--workloads", default="trace,burst,zipf", show_default=True,
              help="--serve: bench serve's workloads.")
@click.option("--modes", default="switch,bridge", show_default=True,
              help="--serve: bench serve's modes.")
@click.option("--scale", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True, help="--serve: shrink the workloads (bench serve's --scale).")
@click.option("--racks", type=int, default=None,
              help="--serve on a fabric (#43): this many rack switches of --hosts-per-rack "
                   "nodes under a pool-side switch; bench serve --racks' burst and zipf in its "
                   "modes bridge, rack, pool-side, fabric against the fabric model.")
@click.option("--hosts-per-rack", type=int, default=4, show_default=True,
              help="--racks: inference nodes per rack.")
@click.option("--oversub", type=float, default=2.0, show_default=True,
              help="--racks: a rack's host links in total : its uplink.")
@click.option("--pool-link-gbit", type=float, default=None,
              help="--racks: the pool nodes' link rate (default --link-gbit).")
@click.option("--placement", type=click.Choice(["independent", "split"]),
              default="independent", show_default=True,
              help="--racks: each switch caches on its own demand, or the rack and pool-side "
                   "switches split the block keys (bench serve --racks --placement).")
@click.option("--switch-entries", type=click.IntRange(64), default=65536, show_default=True,
              help="--racks: chunks each switch's cache holds.")
@click.option("--live-json", type=click.Path(dir_okay=False), default=None,
              help="--serve: compare the fabric model with this `bench serve --racks` result "
                   "instead of running a testbed (no testbed is built).")
@click.option("--json", "json_path", default=None,
              help="Write the result here (default bench/results/sim-validate.json, with "
                   "--serve sim-validate-serve.json, with --racks sim-validate-fabric.json).")
def sim_validate(trace_path, serve, limit, capacity, speedup, routing, nodes, pools, link_gbit,
                 workloads, modes, scale, racks, hosts_per_rack, oversub, pool_link_gbit,
                 placement, switch_entries, live_json, json_path):
    """Check the model against the testbed: a replayed trace slice on 4 nodes, (--serve) bench
    serve's workloads, or (--serve --racks) bench serve's on a fabric of switches."""
    if racks is not None or live_json:
        if not serve:
            raise click.UsageError("--racks and --live-json go with --serve")
        ctx = click.get_current_context()
        if ctx.get_parameter_source("nodes").name != "DEFAULT":
            raise click.UsageError("with --racks the nodes are --racks x --hosts-per-rack: "
                                   "drop --nodes")
        _validate_fabric(racks, hosts_per_rack, pools, oversub, link_gbit, pool_link_gbit,
                         workloads, modes, scale, live_json,
                         json_path or "bench/results/sim-validate-fabric.json",
                         placement, switch_entries)
        return
    if serve:
        from .validate_serve import run_validate_serve
        out = run_validate_serve(nodes, pools, link_gbit, _names(workloads), _names(modes),
                                 scale, trace_path,
                                 json_path=json_path or "bench/results/sim-validate-serve.json",
                                 log=lambda m: click.echo(m, err=True))
        click.echo(json.dumps(out["comparison"], indent=2))
        click.echo(f"within targets: {json.dumps(out['within_targets'])}")
        fail_unless(out["completed"] and all(out["within_targets"].values()))
        return
    from .validate import run_validate
    out = run_validate(trace_path, limit, capacity, speedup, routing,
                       json_path or "bench/results/sim-validate.json",
                       log=lambda m: click.echo(m, err=True))
    click.echo(json.dumps(out["comparison"], indent=2))
    fail_unless(out["within_targets"])


def _validate_fabric(racks, hosts_per_rack, pools, oversub, link_gbit, pool_link_gbit,
                     workloads, modes, scale, live_json, json_path, placement, switch_entries):
    """``sim validate --serve --racks``: on a fabric testbed, or (``live_json``) against a
    result `bench serve --racks` wrote."""
    from ...errors import TestbedError
    from ...results import write_json
    from ...sim.fabric_serve_model import FABRIC_MODES, check_shape
    from .validate_fabric import MODEL_WORKLOADS, compare_file, run_validate_fabric
    ctx = click.get_current_context()
    given = lambda name: ctx.get_parameter_source(name).name != "DEFAULT"   # noqa: E731
    log = lambda m: click.echo(m, err=True)                                 # noqa: E731
    if racks is not None:
        check_shape(racks, hosts_per_rack, oversub)
    if pool_link_gbit is not None and not pool_link_gbit > 0:
        raise TestbedError(f"--pool-link-gbit must be > 0, got {pool_link_gbit:g}")
    if live_json:
        out = compare_file(live_json, log)
        if racks is not None and racks != out["config"]["racks"]:
            raise TestbedError(f"{live_json} is a run of {out['config']['racks']} racks, "
                               f"not --racks {racks}")
    else:
        out = run_validate_fabric(
            racks, hosts_per_rack, pools, oversub, link_gbit, pool_link_gbit,
            _names(workloads) if given("workloads") else MODEL_WORKLOADS,
            _names(modes) if given("modes") else FABRIC_MODES, scale, log=log,
            placement=placement, cache_entries=switch_entries)
    write_json(json_path, out)
    for r in out["rows"]:
        p50, hit = r["ttft_p50_s"], r["hit_ratio"]
        levels = [f"{lv} {h['live']} / {h['model']}" for lv, h in hit.items()
                  if h["live"] is not None or h["model"] is not None]
        err = f"{p50['error']:+.1%}" if p50["error"] is not None else "-"
        click.echo(f"{r['workload']:5} {r['mode']:9} ttft p50 live {p50['live']} model "
                   f"{p50['model']} ({err}); hit ratio live / model: "
                   + (", ".join(levels) or "no kvswitch"))
    click.echo(f"within targets: {json.dumps(out['within_targets'])}\nwrote {json_path}")
    fail_unless(out.get("completed", True) and all(out["within_targets"].values()))


@click.command()
@trace_opt
@click.option("--capacity", type=FINITE, default=0.02, show_default=True, callback=capacity_value,
              help="Fraction of the trace's distinct blocks (<1) or a count.")
@click.option("--limit", type=click.IntRange(1), help="Only the first N requests.")
@click.option("--speedup", type=FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Time compression of the trace's pace (10 with a 0.1 s "
              "interval: one policy step per second of trace, as switchd's default).")
@click.option("--interval", type=FloatRange(min=0.05), default=0.1, show_default=True,
              help="switchd's policy interval, seconds.")
@click.option("--policy", type=click.Choice(list(POLICIES)), help="Default: switchd's default.")
@click.option("--fill-headroom", type=click.IntRange(min=0),
              help="Extra cache entries for speculative fills (default: a quarter of capacity).")
@json_opt()
def replay(trace_path, capacity, limit, speedup, interval, policy, fill_headroom, json_path):
    """Replay a trace through the testbed; compare the live hit ratio with the evaluator's."""
    from .replay import run_replay
    run_replay(trace_path, capacity, limit, speedup, interval, json_path=json_path,
               fill_headroom=fill_headroom, policy=policy)


def _names(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]
