"""The data path's commands, `testbed bench throughput`, `incast`, `loss` and `fetch` (registered
by testbed.cli). Each parses its options and calls its benchmark (throughput.run_throughput,
incast.run_incast, loss.run_loss, fetch.run_fetch), imported when the command runs."""
from __future__ import annotations

import json

import click

from kvproto.cli import FloatRange, chunk_option

from ...options import (chunk_list, cpu_list, float_list, int_list, json_opt, link_options,
                        link_spec, percent_list, plot_opt, plot_path_for, say_wrote)


@click.command()
@click.option("--chunk-sizes", default="256,1024,3072", show_default=True, callback=chunk_list,
              help="Chunk payload sizes (the veth MTU follows the chunk size).")
@click.option("--seconds", type=FloatRange(0.1, 30), default=2.0, show_default=True,
              help="Measuring time of each scenario (after 0.3 s of warm-up).")
@click.option("--windows", type=click.IntRange(1, 50), default=5, show_default=True,
              help="Parts of it; a scenario's rate is the median of theirs.")
@click.option("--cores", default="0", show_default=True, callback=cpu_list,
              help="CPUs the generator sends from, one pinned thread each.")
@click.option("--rate", type=FloatRange(min=0), default=0, show_default=True,
              help="Frames per second offered in all (0: as fast as possible).")
@click.option("--keys", type=click.IntRange(16, 1 << 20), default=4096, show_default=True,
              help="Chunks swept per scenario.")
@click.option("--hit-ratios", default="0,25,50,75,100", show_default=True,
              callback=percent_list, help="Hit percentages of the sweep (empty: skip).")
@click.option("--sweep-chunk", type=int,
              help="Chunk size of the hit-ratio sweep and the TCP measurement, one of "
                   "--chunk-sizes  [default: 1024 if among them, else the smallest]")
@click.option("--scaling", default="1000,10000,100000,1000000", show_default=True,
              callback=lambda c, p, v: int_list(c, p, v) if v.strip() else [],
              help="Cache sizes (entries) of the lookup-cost series (empty: skip).")
@click.option("--scaling-chunk", default="64,3072", show_default=True, callback=chunk_list,
              help="Chunk sizes of the cache-size series (one series each; a million entries "
                   "of 3 KiB take 3.3 GB).")
@click.option("--tcp-runs", type=click.IntRange(0, 20), default=5, show_default=True,
              help="Rounds of iperf3 runs, one each detached, with a bare XDP_PASS program "
                   "and with the program attached (0: skip).")
@click.option("--tcp-seconds", type=FloatRange(0.5, 60), default=2.0, show_default=True)
@click.option("--memcached-threads", type=click.IntRange(1, 64), default=2, show_default=True)
@json_opt("bench/results/throughput.json")
@plot_opt()
def throughput(chunk_sizes, seconds, windows, cores, rate, keys, hit_ratios, sweep_chunk,
               scaling, scaling_chunk, tcp_runs, tcp_seconds, memcached_threads, json_path,
               plot_path):
    """GET replies/s: XDP_TX ceiling, switch hits, pool server, memcached; hit ratios, cache
    size, TCP."""
    from .throughput import run_throughput
    if sweep_chunk is None:
        sweep_chunk = 1024 if 1024 in chunk_sizes else chunk_sizes[0]
    if sweep_chunk not in chunk_sizes:
        given = ",".join(map(str, chunk_sizes))
        raise click.BadParameter(f"{sweep_chunk} is not one of --chunk-sizes {given}",
                                 param_hint="--sweep-chunk")
    plot_path = plot_path_for(json_path, plot_path)
    out = run_throughput(chunk_sizes, seconds, windows, cores, keys, rate, hit_ratios,
                         sweep_chunk, scaling, scaling_chunk, tcp_runs, tcp_seconds,
                         memcached_threads, json_path, plot_path)
    click.echo(json.dumps(out["targets"], indent=2))
    say_wrote(json_path, plot_path)
    if out["sample_problems"]:
        raise click.ClickException("sampled replies were wrong: " +
                                   "; ".join(out["sample_problems"]))


@click.command()
@click.option("--readers", default="1,2,4,8,16", show_default=True, callback=int_list,
              help="Reader counts to measure (each in its own namespace).")
@click.option("--block-mib", type=FloatRange(min=0.01, max=64), default=4.0,
              show_default=True)
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Repetitions per reader count and mode.")
@chunk_option(default=3072)
@click.option("--store", type=click.Choice(["memory", "mooncake"]), default="memory",
              show_default=True, help="The pool node's store (mooncake: the benchmark runs a "
                                      "Mooncake master).")
@link_options
@json_opt("bench/results/incast.json")
@plot_opt()
def incast(readers, block_mib, reps, chunk_size, store, link_gbit, pool_link_gbit,
           link_delay_us, json_path, plot_path):
    """N readers fetch one block at once: plain bridge vs the switch."""
    from .incast import run_incast
    if readers[-1] > 99:
        raise click.BadParameter("at most 99 readers", param_hint="--readers")
    spec = link_spec(link_gbit, pool_link_gbit, link_delay_us)
    plot_path = plot_path_for(json_path, plot_path)
    out = run_incast(readers, block_mib, reps, json_path, plot_path, chunk_size,
                     spec and spec.host_gbit, spec and spec.pool_gbit, store,
                     spec.delay_us if spec else 0.0)
    click.echo(json.dumps(out["summary"], indent=2))
    say_wrote(json_path, plot_path)


@click.command()
@click.option("--loss", "losses", default="0,1,5", show_default=True,
              callback=float_list(99.999), help="Loss rates in percent, comma-separated.")
@click.option("--block-mib", type=FloatRange(min=0.01, max=64), default=4.0,
              show_default=True)
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True)
@json_opt("bench/results/loss.json")
def loss(losses, block_mib, reps, json_path):
    """Block fetches over links that drop KV frames."""
    from .loss import run_loss
    run_loss(losses, block_mib, reps, json_path)


@click.command()
@click.option("--chunk-sizes", default="3072,1024", show_default=True, callback=chunk_list)
@click.option("--sizes-mib", default="2,64", show_default=True, callback=int_list)
@click.option("--rounds", type=click.IntRange(1, 50), default=5, show_default=True)
@click.option("--mooncake/--no-mooncake", default=True, show_default=True)
@json_opt("bench/results/fetch.json")
@plot_opt()
def fetch(chunk_sizes, sizes_mib, rounds, mooncake, json_path, plot_path):
    """Whole blocks at a node: XDP engine, switch hit path, pool, asyncio client, Mooncake."""
    from .fetch import run_fetch
    plot_path = plot_path_for(json_path, plot_path)
    out = run_fetch(chunk_sizes, sizes_mib, rounds, mooncake=mooncake, json_path=json_path,
                    plot_path=plot_path, log=click.echo)
    click.echo(json.dumps(out["targets"], indent=2))
    say_wrote(json_path, plot_path)
