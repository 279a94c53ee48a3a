"""The `testbed` command line: build and remove topologies, run the demo, evaluate policies."""
from __future__ import annotations

import json
import sys

import click

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
@click.option("--chunk-size", type=click.IntRange(64, 3424), default=1024, show_default=True)
@click.option("--pool-link-mbit", type=click.FloatRange(min=1), help="Shape the pool node's link "
              "to this rate (default: unshaped veth).")
@click.option("--json", "json_path", default="bench/results/incast.json", show_default=True)
@click.option("--plot", "plot_path", default="bench/results/incast.png", show_default=True)
def incast(readers, block_mib, reps, chunk_size, pool_link_mbit, json_path, plot_path):
    """N readers fetch one block at once: plain bridge vs the switch."""
    from .bench_incast import run_incast
    if readers[-1] > 99:
        raise click.BadParameter("at most 99 readers", param_hint="--readers")
    out = run_incast(readers, block_mib, reps, json_path, plot_path, chunk_size, pool_link_mbit)
    click.echo(json.dumps(out["summary"], indent=2))
    click.echo(f"wrote {json_path} and {plot_path}")


@main.command()
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              required=True, help="Mooncake-format JSONL trace.")
@click.option("--capacity", type=click.FloatRange(min=0, min_open=True), default=0.02,
              show_default=True, help="Fraction of the trace's distinct blocks (<1) or a count.")
@click.option("--limit", type=click.IntRange(1), help="Only the first N requests.")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Time compression of the trace's pace.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=0.1, show_default=True,
              help="switchd's policy interval, seconds.")
@click.option("--json", "json_path", help="Write the result here.")
def replay(trace_path, capacity, limit, speedup, interval, json_path):
    """Replay a trace through the testbed; compare the live hit ratio with the evaluator's."""
    from .replay import run_replay
    run_replay(trace_path, capacity, limit, speedup, interval, json_path=json_path)


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
