"""The serving benchmarks' commands, `testbed bench serve` (with --tiers: serve_tiers, with --racks:
serve_fabric) and `bench vllm` (registered by testbed.cli). Each parses its options and calls
its benchmark (serve.run_serve, serve_tiers.run_tiers, serve_fabric.run_fabric,
serve_vllm.run_vllm_bench), imported when the command runs."""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, replace

import click
from click.core import ParameterSource

from kvproto.cli import FINITE, FloatRange

from ...lab import TestbedError
from ...lab.lab import STORES
from ...options import (fail_unless, json_opt, name_list, plot_opt, plot_path_for, say_wrote,
                        trace_opt)
from ...sim.config import MODELS as SIM_MODELS
from .serve_vllm import MODES as VLLM_MODES, VllmBench
from .vllm_server import Workload

TIERS_JSON = "bench/results/serve-tiers.json"
FABRIC_JSON = "bench/results/serve-fabric.json"
VLLM_DEFAULTS, VLLM_WORKLOAD = VllmBench(), Workload()    # bench vllm's defaults


def tiers_options(command):
    """--tiers and its options: with --tiers, the tiers benchmark (serve_tiers.run_tiers) runs
    in place of the serving one, with its own defaults (4 nodes, 1 pool node, unless given)."""
    @click.option("--tiers", is_flag=True, default=False,
                  help="Measure the tiers (#29) instead: node DRAM, switch, pool DRAM, pool "
                       "disk, per demote and write-down mode, with `testbed sim` beside.")
    @click.option("--demote", "demotes", default="none,all,value", show_default=True,
                  callback=name_list, help="With --tiers: comma list of none, all, value.")
    @click.option("--write-down", "write_downs", default="all,selective", show_default=True,
                  callback=name_list, help="With --tiers: comma list of all, selective.")
    @click.option("--fill", type=FINITE, default=2.0, show_default=True,
                  help="With --tiers: the workload's distinct blocks / the pool's DRAM.")
    @functools.wraps(command)
    def wrapper(*args, tiers, demotes, write_downs, fill, **kw):
        if not tiers:
            return command(*args, **kw)
        ctx = click.get_current_context()
        given = lambda name: ctx.get_parameter_source(name).name != "DEFAULT"   # noqa: E731
        json_path = kw["json_path"] if given("json_path") else TIERS_JSON
        plot_path = plot_path_for(json_path, kw.get("plot_path"))
        from .serve_tiers import run_tiers
        out = run_tiers(kw["nodes"] if given("nodes") else 4,
                        kw["pools"] if given("pools") else 1, kw["link_gbit"],
                        demotes, write_downs, kw["model"], fill, kw["scale"],
                        json_path=json_path, plot_path=plot_path, log=click.echo)
        click.echo(json.dumps(out["summary"], indent=2))
        say_wrote(json_path, plot_path)
        if not out["summary"]["all_byte_exact"]:
            raise click.ClickException("some block was not byte-exact")
    return wrapper


def fabric_options(command):
    """--racks and its options: with --racks, the fabric benchmark (serve_fabric.run_fabric)
    runs in place of the single-switch one (burst, Zipf and incast; modes bridge, rack,
    pool-side, fabric). `testbed up --racks` is testbed.options.fabric_up_options."""
    @click.option("--racks", type=int, default=None,
                  help="Serve on a fabric (#43) instead: this many rack switches of "
                       "--hosts-per-rack nodes, uplinks to a pool-side switch; modes bridge, "
                       "rack, pool-side, fabric.")
    @click.option("--hosts-per-rack", type=int, default=4, show_default=True)
    @click.option("--oversub", type=FINITE, default=2.0, show_default=True,
                  help="With --racks: a rack's host links in total : its uplink.")
    @click.option("--pool-link-gbit", type=FloatRange(0, min_open=True), default=None,
                  help="With --racks: the pool nodes' link rate (default --link-gbit).")
    @click.option("--placement", type=click.Choice(["independent", "split"]),
                  default="independent", show_default=True,
                  help="With --racks: each switch caches on its own demand, or the rack and "
                       "pool-side switches split the block keys between them.")
    @click.option("--switch-entries", type=click.IntRange(64), default=65536,
                  show_default=True, help="With --racks: chunks each switch's cache holds.")
    @functools.wraps(command)
    def wrapper(*args, racks, hosts_per_rack, oversub, pool_link_gbit, placement,
                switch_entries, **kw):
        if racks is None:
            return command(*args, **kw)
        ctx = click.get_current_context()
        given = lambda name: ctx.get_parameter_source(name).name != "DEFAULT"   # noqa: E731
        json_path = kw["json_path"] if given("json_path") else FABRIC_JSON
        plot_path = plot_path_for(json_path, kw.get("plot_path"))
        from .serve_fabric import FABRIC_MODES, FABRIC_WORKLOADS, run_fabric
        out = run_fabric(racks, hosts_per_rack, kw["pools"] if given("pools") else 2, oversub,
                         kw["link_gbit"], pool_link_gbit,
                         kw["workloads"] if given("workloads") else FABRIC_WORKLOADS,
                         kw["modes"] if given("modes") else FABRIC_MODES, kw["model"],
                         kw["scale"], json_path=json_path, plot_path=plot_path, log=click.echo,
                         placement=placement, cache_entries=switch_entries)
        click.echo(json.dumps(out["summary"], indent=2))
        say_wrote(json_path, plot_path)
        if not out["summary"]["all_byte_exact"]:
            raise click.ClickException("some block was not byte-exact")
    return wrapper


@click.command()
@click.option("--nodes", type=int, default=8, show_default=True, help="Inference nodes.")
@click.option("--pools", type=int, default=2, show_default=True, help="Pool nodes.")
@click.option("--store", type=click.Choice(STORES), default="memory", show_default=True)
@click.option("--link-gbit", type=FINITE, default=0.025, show_default=True,
              help="Rate of every link (inference and pool nodes), both directions; blocks "
                   "scale with it (64 MiB at 100 Gbit/s).")
@click.option("--workloads", default="trace,burst,zipf", show_default=True, callback=name_list,
              help="Comma list of trace, burst, zipf.")
@click.option("--modes", default="bridge,switch,replicas", show_default=True, callback=name_list,
              help="Comma list of bridge, switch, replicas.")
@click.option("--model", type=click.Choice(sorted(SIM_MODELS)), default="llama3-8b",
              show_default=True, help="The cluster model's preset whose prefill speed is used.")
@trace_opt(help="Mooncake-format trace of the trace workload (default: the one in "
                "testbed/traces/).")
@click.option("--trace-requests", type=click.IntRange(1), default=96, show_default=True)
@click.option("--scale", type=FloatRange(0.05, 4), default=1.0, show_default=True,
              help="Shrink (or grow) every workload.")
@json_opt("bench/results/serve.json")
@plot_opt()
@tiers_options
@fabric_options
def serve(nodes, pools, store, link_gbit, workloads, modes, model, trace_path, trace_requests,
          scale, json_path, plot_path):
    """Serving loops on N nodes over shaped links: TTFT, pool egress; bridge, switch, replicas."""
    from .serve import run_serve
    plot_path = plot_path_for(json_path, plot_path)
    out = run_serve(nodes, pools, store, link_gbit, workloads, modes, model, trace_path,
                    trace_requests, scale, json_path, plot_path, log=click.echo)
    click.echo(json.dumps(out["summary"], indent=2))
    say_wrote(json_path, plot_path)
    fail_unless(out["summary"]["all_byte_exact"])


@click.command("vllm")
@click.option("--servers", type=click.IntRange(1, 16), default=VLLM_DEFAULTS.servers,
              show_default=True, help="`vllm serve` processes, one per inference node.")
@click.option("--pools", type=click.IntRange(1, 8), default=VLLM_DEFAULTS.pools,
              show_default=True)
@click.option("--link-gbit", type=click.FloatRange(0, 100, min_open=True),
              default=VLLM_DEFAULTS.link_gbit, show_default=True,
              help="Rate of every inference node's link, both directions; every frame "
                   "queues at it, XDP-sent ones too.")
@click.option("--pool-link-gbit", type=click.FloatRange(0, 100, min_open=True),
              help="Rate of every pool node's link (default: --link-gbit's).")
@click.option("--prefix-len", type=click.IntRange(1), default=VLLM_WORKLOAD.prefix_len,
              show_default=True, help="Tokens of each shared prefix.")
@click.option("--suffix-len", type=click.IntRange(1), default=VLLM_WORKLOAD.suffix_len,
              show_default=True)
@click.option("--prefixes", type=click.IntRange(1), default=VLLM_WORKLOAD.prefixes,
              show_default=True, help="Distinct prefixes (the working set).")
@click.option("--output-len", type=click.IntRange(1), default=VLLM_WORKLOAD.output_len,
              show_default=True)
@click.option("--prompts", type=click.IntRange(1), default=VLLM_WORKLOAD.prompts,
              show_default=True, help="Requests per server.")
@click.option("--rate", type=click.FloatRange(0, min_open=True), default=VLLM_WORKLOAD.rate,
              show_default=True, help="Requests per second per server (Poisson).")
@click.option("--seed", type=int, default=VLLM_WORKLOAD.seed, show_default=True)
@click.option("--kv-blocks", type=click.IntRange(1), default=VLLM_DEFAULTS.kv_blocks,
              show_default=True, help="Each server's KV space, in vLLM blocks.")
@click.option("--switch-cache-mib", type=click.IntRange(1),
              default=VLLM_DEFAULTS.switch_cache_mib, show_default=True)
@click.option("--modes", default=",".join(VLLM_MODES), show_default=True,
              help=f"Comma list of {', '.join(VLLM_MODES)}.")
@click.option("--workload", type=click.Choice(["light", "busy"]), default="light",
              show_default=True,
              help="light: a warm-up pass, then the same requests measured (modes --modes); "
                   "busy: requests decode while others load, prefixes no warm-up saw, loads "
                   "sync and async and a pool node killed (its own defaults for the options "
                   "above not given; 2 pool nodes).")
@json_opt("bench/results/vllm-serve.json")
@click.option("--plot", "plot_path", help="PNG (default: the JSON path with .png).")
@click.pass_context
def vllm(ctx, servers, pools, link_gbit, pool_link_gbit, prefix_len, suffix_len,
         prefixes, output_len, prompts, rate, seed, kv_blocks, switch_cache_mib, modes,
         workload, json_path, plot_path):
    """`vllm serve` on S nodes driven by `vllm bench serve`: local, pool, switch."""
    from .serve_vllm import run_vllm_bench
    wl = Workload(prefix_len, suffix_len, prefixes, output_len, prompts, rate, seed)
    if workload == "busy":                   # its own defaults for what was not given
        from .vllm_busy import BUSY, KV_BLOCKS
        given = {f: v for f, v in asdict(wl).items()
                 if ctx.get_parameter_source(f) is not ParameterSource.DEFAULT}
        wl = replace(BUSY, **given)
        if ctx.get_parameter_source("kv_blocks") is ParameterSource.DEFAULT:
            kv_blocks = KV_BLOCKS
    cfg = replace(VLLM_DEFAULTS, servers=servers, pools=pools, link_gbit=link_gbit,
                  pool_link_gbit=pool_link_gbit, workload=wl, kv_blocks=kv_blocks,
                  switch_cache_mib=switch_cache_mib,
                  modes=tuple(m.strip() for m in modes.split(",") if m.strip()))
    try:
        cfg.check()
    except TestbedError as exc:
        raise click.UsageError(str(exc)) from None
    if workload == "busy":
        out = run_vllm_bench(cfg, json_path, None, log=click.echo, busy=True)
        click.echo(json.dumps(out["summary"], indent=2))
        fail_unless(out["outputs_match"] and out["summary"]["met"]["no_failed_request"])
        return
    plot_path = plot_path or (json_path and json_path.rsplit(".", 1)[0] + ".png")
    out = run_vllm_bench(cfg, json_path, plot_path, log=click.echo)
    click.echo(json.dumps(out["summary"], indent=2))
    fail_unless(out["outputs_match"] and not any(out["summary"]["failed_requests"].values()))
