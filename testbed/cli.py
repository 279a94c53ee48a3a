"""The `testbed` command line: build and remove topologies, run the demo, evaluate policies."""
from __future__ import annotations

import json
import sys

import click

from switchd.policy import POLICIES

from .options import int_list
from .topology import TestbedError, Topology, down, namespaces_of


class TestbedGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TestbedError as exc:
            click.echo(f"testbed: error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=TestbedGroup)
def main():
    """veth/namespace testbeds for the in-network KV-cache switch."""


@main.command()
@click.option("--name", default="kv", show_default=True, help="Prefix of every object made.")
@click.option("--hosts", type=click.IntRange(1, 99), default=2, show_default=True)
@click.option("--pools", type=click.IntRange(1, 99), default=1, show_default=True)
@click.option("--mtu", type=click.IntRange(1280, 3506), default=1500, show_default=True,
              help="Above 3506 this kernel refuses native XDP on veths.")
def up(name, hosts, pools, mtu):
    """Build a switch namespace with a bridge, inference nodes h1.. and pool nodes p1.."""
    t = Topology(name, hosts, pools, mtu).up()
    click.echo(f"testbed {name}: switch netns {t.switch_ns} (bridge ports "
               f"{', '.join(t.ports)}), pin dir {t.pin_dir}")
    for n in t.nodes:
        click.echo(f"  {n.name:4} {n.role:5} netns {n.netns:10} {n.ip}")


@main.command("down")
@click.option("--name", default="kv", show_default=True)
@click.option("--all", "everything", is_flag=True, help="Every testbed this tool made.")
def down_cmd(name, everything):
    """Remove a testbed and anything left running in it (idempotent)."""
    prefixes = {n.rsplit("-", 1)[0] for n in namespaces_of("") if n.endswith("-sw")} \
        if everything else {name}
    removed = [ns for p in sorted(prefixes) for ns in down(p)]
    click.echo(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed else ""))


@main.command()
@click.option("--chunks", type=click.IntRange(64, 65536), default=256, show_default=True)
def demo(chunks):
    """Fetch a KV block through the switch from two inference nodes (see `make demo`)."""
    from .demo import run_demo
    if not run_demo(chunks):
        sys.exit(1)


@main.group()
def bench():
    """Benchmarks: side-by-side modes in one run, JSON results and plots."""


@bench.command()
@click.option("--readers", default="1,2,4,8,16", show_default=True, callback=int_list,
              help="Reader counts to measure (each in its own namespace).")
@click.option("--block-mib", type=click.FloatRange(min=0.01, max=64), default=4.0,
              show_default=True)
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Repetitions per reader count and mode.")
@click.option("--chunk-size", type=click.IntRange(64, 3424), default=3072, show_default=True)
@click.option("--pool-link-mbit", type=click.FloatRange(min=0), default=100, show_default=True,
              help="Shape the pool node's link to this rate, so that it and not the readers' "
              "shared CPU is the bottleneck, as in a cluster (0: unshaped veth).")
@click.option("--json", "json_path", default="bench/results/incast.json", show_default=True)
@click.option("--plot", "plot_path", default="bench/results/incast.png", show_default=True)
def incast(readers, block_mib, reps, chunk_size, pool_link_mbit, json_path, plot_path):
    """N readers fetch one block at once: plain bridge vs the switch."""
    from .bench_incast import run_incast
    if readers[-1] > 99:
        raise click.BadParameter("at most 99 readers", param_hint="--readers")
    out = run_incast(readers, block_mib, reps, json_path, plot_path, chunk_size,
                     pool_link_mbit or None)
    click.echo(json.dumps(out["summary"], indent=2))
    click.echo(f"wrote {json_path} and {plot_path}")


@main.command()
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              required=True, help="Mooncake-format JSONL trace.")
@click.option("--capacity", type=click.FloatRange(min=0, min_open=True), default=0.02,
              show_default=True, help="Fraction of the trace's distinct blocks (<1) or a count.")
@click.option("--limit", type=click.IntRange(1), help="Only the first N requests.")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Time compression of the trace's pace (10 with a 0.1 s "
              "interval: one policy step per second of trace, as switchd's default).")
@click.option("--interval", type=click.FloatRange(min=0.05), default=0.1, show_default=True,
              help="switchd's policy interval, seconds.")
@click.option("--policy", type=click.Choice(list(POLICIES)), help="Default: switchd's default.")
@click.option("--fill-headroom", type=click.IntRange(min=0),
              help="Extra cache entries for speculative fills (default: a quarter of capacity).")
@click.option("--json", "json_path", help="Write the result here.")
def replay(trace_path, capacity, limit, speedup, interval, policy, fill_headroom, json_path):
    """Replay a trace through the testbed; compare the live hit ratio with the evaluator's."""
    from .replay import run_replay
    run_replay(trace_path, capacity, limit, speedup, interval, json_path=json_path,
               fill_headroom=fill_headroom, policy=policy)


@main.command()
@click.option("--frames", type=click.IntRange(1), default=100_000, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--json", "json_path", help="Write the result here.")
def fuzz(frames, seed, json_path):
    """Random and mutated frames through the data plane, checked against a reference."""
    from .fuzz import run_fuzz
    if run_fuzz(frames, seed, json_path)["violations"]:
        sys.exit(1)


@bench.command()
@click.option("--loss", "losses", default="0,1,5", show_default=True,
              help="Loss rates in percent, comma-separated.")
@click.option("--block-mib", type=click.FloatRange(min=0.01, max=64), default=4.0,
              show_default=True)
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True)
@click.option("--json", "json_path", default="bench/results/loss.json", show_default=True)
def loss(losses, block_mib, reps, json_path):
    """Block fetches over links that drop KV frames."""
    from .bench_loss import run_loss
    try:
        rates = [float(x) for x in losses.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{losses!r} is not a list of percentages") from None
    if not rates or any(not 0 <= r < 100 for r in rates):
        raise click.BadParameter("loss rates must be in [0, 100)", param_hint="--loss")
    run_loss(rates, block_mib, reps, json_path)


@main.command()
@click.option("--minutes", type=click.FloatRange(min=0.1, max=120), default=10.0,
              show_default=True)
@click.option("--json", "json_path", default="bench/results/soak.json", show_default=True)
def soak(minutes, json_path):
    """Sustained load for a bounded time; checks maps and daemon memory do not grow."""
    from .soak import run_soak
    out = run_soak(minutes, json_path)
    click.echo(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2))
    if not out["within_capacity"]:
        sys.exit(1)


def _register_commands():
    from .bench_throughput import throughput
    from .demo_inference import demo_inference
    from .policy_eval import policy_eval
    main.add_command(policy_eval, "policy-eval")
    main.add_command(demo_inference, "demo-inference")
    bench.add_command(throughput, "throughput")


_register_commands()


@main.group()
def sim():
    """Cluster-scale model: tiers, switch pool on/off, break-even, testbed validation."""


def _sim_options(f):
    for opt in reversed([
        click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
                     required=True, help="Mooncake-format JSONL trace."),
        click.option("--requests", type=click.IntRange(1), help="Resample to this many requests."),
        click.option("--nodes", type=click.IntRange(1, 1 << 20), default=4, show_default=True),
        click.option("--pools", type=click.IntRange(1), help="Pool nodes (default nodes/8)."),
        click.option("--model", type=click.Choice(["llama3-8b", "llama3-70b", "deepseek-v3"]),
                     default="llama3-8b", show_default=True),
        click.option("--kv-bytes-per-token", type=click.IntRange(1)),
        click.option("--block-tokens", type=click.IntRange(1, 512), default=512,
                     show_default=True),
        click.option("--hbm-gib", type=click.FloatRange(0), default=40.0, show_default=True),
        click.option("--dram-gib", type=click.FloatRange(0), default=256.0, show_default=True),
        click.option("--switch-gib", type=click.FloatRange(0), default=64.0, show_default=True),
        click.option("--pool-gib", type=click.FloatRange(0, min_open=True),
                     help="Per pool node (default unlimited)."),
        click.option("--node-gbps", type=click.FloatRange(0, min_open=True), default=100.0,
                     show_default=True),
        click.option("--pool-gbps", type=click.FloatRange(0, min_open=True), default=100.0,
                     show_default=True),
        click.option("--routing", type=click.Choice(["random", "least-loaded", "affinity"]),
                     default="affinity", show_default=True),
        click.option("--demote", type=click.Choice(["none", "all", "value"]), default="value",
                     show_default=True),
        click.option("--policy", "switch_policy", default="prefix", show_default=True,
                     type=click.Choice(["prefix", "lru", "lfu", "tinylfu"])),
        click.option("--sharing", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                     help="Share of resampled prefix trees that keep their ids (shared content)."),
        click.option("--load", type=click.FloatRange(0, min_open=True), default=0.7,
                     show_default=True, help="Per-node prefill utilisation without caching."),
        click.option("--seed", type=int, default=1, show_default=True),
    ]):
        f = opt(f)
    return f


@sim.command("run")
@_sim_options
@click.option("--json", "json_path", help="Write the result here.")
def sim_run(trace_path, requests, sharing, json_path, **kw):
    """Simulate one cluster configuration, switch pool on and off."""
    from .results import write_json
    from .sim import SimConfig, run
    from .trace import TraceError, load_trace
    try:
        trace = load_trace(trace_path)
        cfg = SimConfig(**kw)
    except (TraceError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    out = run(trace, cfg, requests, sharing, log=lambda m: click.echo(m, err=True))
    write_json(json_path, out)
    for mode in ("pool_off", "pool_on"):
        r = out[mode]
        click.echo(f"{mode}: hits {json.dumps(r['hit_ratio'])} ttft p50/p99 "
                   f"{r['ttft_s']['p50']}/{r['ttft_s']['p99']}s prefill GPU-s saved "
                   f"{r['prefill_gpu_s_saved']} pool egress {r['bytes']['pool_to_switch']}")
    click.echo(f"switch pool: {json.dumps(out['switch_benefit'])}")
    click.echo(f"{out['requests']} requests over {cfg.nodes} nodes in {out['wall_seconds']}s")


@sim.command("sweep")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              required=True, help="Mooncake-format JSONL trace.")
@click.option("--nodes", "nodes", default="4,16,64,256,1024", show_default=True,
              callback=int_list)
@click.option("--switch-gib", "switch_gib", default="16,64,256", show_default=True)
@click.option("--sharing", "sharing", default="0,0.5,0.9", show_default=True)
@click.option("--requests-per-node", type=click.IntRange(1), default=200, show_default=True)
@click.option("--max-requests", type=click.IntRange(1), default=200_000, show_default=True)
@click.option("--routing", type=click.Choice(["random", "least-loaded", "affinity"]),
              default="random", show_default=True)
@click.option("--pools", type=click.IntRange(1), default=4, show_default=True,
              help="Pool nodes, fixed while the inference nodes grow.")
@click.option("--json", "json_path", default="bench/results/sim-sweep.json", show_default=True)
@click.option("--plot", "plot_path", default="bench/results/sim-breakeven.png",
              show_default=True)
def sim_sweep(trace_path, nodes, switch_gib, sharing, requests_per_node, max_requests, routing,
              pools, json_path, plot_path):
    """Sweep nodes x switch memory x sharing; find and draw the break-even."""
    from .sim_sweep import floats, run_sweep
    mem, share = floats(switch_gib, "--switch-gib"), floats(sharing, "--sharing", hi=1.0)
    out = run_sweep(trace_path, nodes, mem, share, requests_per_node, max_requests, routing,
                    json_path, plot_path, log=lambda m: click.echo(m, err=True), pools=pools)
    click.echo(json.dumps(out["break_even"], indent=2))
    click.echo(f"wrote {json_path} and {plot_path}")


@sim.command("validate")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              required=True, help="Mooncake-format JSONL trace.")
@click.option("--limit", type=click.IntRange(4), default=2000, show_default=True,
              help="First N requests of the trace.")
@click.option("--capacity", type=click.FloatRange(0, min_open=True), default=0.05,
              show_default=True, help="Switch cache: fraction of distinct blocks (<1) or count.")
@click.option("--speedup", type=click.FloatRange(0, min_open=True), default=20.0,
              show_default=True)
@click.option("--routing", type=click.Choice(["random", "affinity"]), default="random",
              show_default=True)
@click.option("--json", "json_path", default="bench/results/sim-validate.json",
              show_default=True)
def sim_validate(trace_path, limit, capacity, speedup, routing, json_path):
    """Replay a trace slice on a 4-node testbed and compare with the model."""
    from .sim_validate import run_validate
    out = run_validate(trace_path, limit, capacity, speedup, routing, json_path,
                       log=lambda m: click.echo(m, err=True))
    click.echo(json.dumps(out["comparison"], indent=2))
    if not out["within_targets"]:
        sys.exit(1)
