"""`testbed sim`: the cluster model's commands (run, sweep, reprice, fabric), registered on the
`testbed` command line by testbed.cli (`sim validate`, which runs testbeds, lives with the
benchmarks). Each parses its options and calls the library function
(testbed.sim.model.point, .sweep.run_sweep, .sweep.reprice_file, .fabric_sweep.run_fabric_sweep),
imported when the command runs."""
from __future__ import annotations

import json

import click

from ..options import (cluster_options, float_list, int_list, json_opt, plot_opt, plot_path_for,
                       say_wrote, sim_errors, trace_opt)

SWEEP_NODES = "4,8,12,16,24,32,48,64,128,256,1024"


def codec_options(f):
    """The KV codec of the blocks ``sim run`` and ``sim sweep`` price (testbed.sim.codec)."""
    from .config import COMPRESS_JSON
    f = click.option("--compress-json", default=COMPRESS_JSON, show_default=True,
                     help="`testbed bench compress` result giving the codec's ratio and "
                          "decode/encode GB/s.")(f)
    return click.option("--kv-codec", default="none", show_default=True,
                        help="KV codec of blocks on the wire and in the switch/pool (none, "
                             "int8, fp8, int4, NAME/gTOKENS) as measured in --compress-json: "
                             "blocks shrink by its ratio, nodes pay its decode time.")(f)


@click.command("run")
@trace_opt
@click.option("--requests", type=click.IntRange(0),
              help="Resample to this many requests (default 200 per node, at most 200,000, as "
                   "the sweep; 0: the trace's own requests).")
@click.option("--nodes", type=click.IntRange(1, 1 << 20), default=4, show_default=True)
@click.option("--switch-gib", type=click.FloatRange(0), default=64.0, show_default=True)
@click.option("--sharing", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of resampled prefix trees that keep their ids (shared content).")
@click.option("--skew", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Zipf exponent of prefix-tree popularity (hot objects; 0: uniform).")
@cluster_options
@codec_options
@json_opt()
def sim_run(trace_path, requests, sharing, json_path, **kw):
    """Simulate one cluster configuration, switch pool on and off (one point of the sweep)."""
    from ..results import write_json
    from .config import SimConfig
    from .model import point
    from .trace import load_trace
    out = sim_errors(lambda: point(load_trace(trace_path), SimConfig(**kw), requests, sharing,
                                   log=lambda m: click.echo(m, err=True)))
    write_json(json_path, out)
    for mode in ("pool_off", "pool_on"):
        r = out[mode]
        click.echo(f"{mode}: hits {json.dumps(r['hit_ratio'])} ttft p50/p99 "
                   f"{r['ttft_s']['p50']}/{r['ttft_s']['p99']}s prefill GPU-s saved "
                   f"{r['prefill_gpu_s_saved']} pool egress {r['bytes']['pool_to_switch']}")
    click.echo(f"point: {json.dumps(out['point'])}")
    click.echo(f"{out['requests']} requests over {kw['nodes']} nodes in {out['wall_seconds']}s")


@click.command("sweep")
@trace_opt
@click.option("--nodes", "nodes", default=SWEEP_NODES, show_default=True, callback=int_list)
@click.option("--switch-gib", "switch_gib", default="16,64,256", show_default=True,
              callback=float_list())
@click.option("--sharing", "sharing", default="0,0.5,0.9", show_default=True,
              callback=float_list(1.0))
@click.option("--skew-cases", "skew_cases", default="0.5:0.99", show_default=True,
              help="SHARING:SKEW cases swept besides the sharing list (hot objects: Zipf "
                   "popularity of prefix trees); '' for none.")
@click.option("--requests-per-node", type=click.IntRange(1), default=200, show_default=True)
@click.option("--max-requests", type=click.IntRange(1), default=200_000, show_default=True)
@cluster_options
@codec_options
@json_opt("bench/results/sim-sweep.json")
@plot_opt()
def sim_sweep(trace_path, nodes, switch_gib, sharing, skew_cases, requests_per_node,
              max_requests, json_path, plot_path, **kw):
    """Sweep nodes x switch memory x sharing (and skew cases); find and draw the break-even."""
    from .sweep import parse_cases, run_sweep
    cases = sim_errors(lambda: [(s, 0.0) for s in sharing] + parse_cases(skew_cases))
    plot_path = plot_path_for(json_path, plot_path)
    out = sim_errors(lambda: run_sweep(
        trace_path, nodes, switch_gib, cases, requests_per_node, max_requests, json_path,
        plot_path, log=lambda m: click.echo(m, err=True), **kw))
    click.echo(json.dumps(out["break_even"], indent=2))
    say_wrote(json_path, plot_path)


@click.command("reprice")
@click.argument("paths", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False))
@click.option("--throughput-json", default="bench/results/throughput.json", show_default=True,
              help="`testbed bench throughput` result giving the data plane's ns per frame.")
@click.option("--plot", "plot_path", help="With one sweep: redraw its break-even plot here.")
def sim_reprice(paths, throughput_json, plot_path):
    """Reprice `sim run` / `sim sweep` results at the data plane's cost measured now: the
    benefit does not depend on it, the XDP cores scale with it (exact, no rerun)."""
    from .config import SimConfig, xdp_frame_cost
    from .sweep import reprice_file
    if plot_path and len(paths) != 1:
        raise click.BadParameter("--plot goes with one sweep result")
    xdp = sim_errors(lambda: xdp_frame_cost(SimConfig(throughput_json=throughput_json)))
    for path in paths:
        try:
            out = reprice_file(path, xdp, plot_path)
        except (ValueError, KeyError, TypeError) as exc:
            raise click.BadParameter(f"{path}: not a result this model wrote ({exc})") from None
        was = (out.get("repriced_from") or out["switch_benefit"]["repriced_from"])["ns_per_frame"]
        click.echo(f"{path}: {was} -> {xdp['ns_per_frame']} ns/frame ({xdp['source']})")


@click.command("fabric")
@trace_opt
@click.option("--racks", default="4,8,16,32", show_default=True,
              help="Rack counts (comma-separated).")
@click.option("--hosts-per-rack", default="8,16,32", show_default=True,
              help="Inference nodes per rack (comma-separated).")
@click.option("--oversub", default="1,2,4", show_default=True,
              help="Uplink oversubscriptions: a rack's host links in total : its uplink.")
@click.option("--sharing", "sharing", default="0,0.5,0.9", show_default=True,
              callback=float_list(1.0))
@click.option("--requests-per-node", type=click.IntRange(1), default=16, show_default=True)
@click.option("--max-requests", type=click.IntRange(1), default=16_384, show_default=True)
@click.option("--rack-gib", type=click.FloatRange(0), default=64.0, show_default=True,
              help="Memory of each rack switch's pool.")
@click.option("--agg-gib", type=click.FloatRange(0), default=64.0, show_default=True,
              help="Memory of the pool-side switch's pool.")
@cluster_options
@json_opt("bench/results/sim-fabric.json")
@plot_opt()
def sim_fabric(trace_path, racks, hosts_per_rack, oversub, sharing, requests_per_node,
               max_requests, rack_gib, agg_gib, json_path, plot_path, **kw):
    """A fabric of switches at cluster scale: racks x hosts per rack x oversubscription x
    sharing, modes bridge, rack, pool-side, fabric; when a pool-side switch on top of the
    rack switches pays."""
    from .fabric_serve_model import check_shape
    from .fabric_sweep import run_fabric_sweep
    racks = _numbers("--racks", racks, int)
    hosts = _numbers("--hosts-per-rack", hosts_per_rack, int)
    overs = _numbers("--oversub", oversub, float)
    for r in racks:
        for h in hosts:
            for o in overs:
                check_shape(r, h, o)
    plot_path = plot_path_for(json_path, plot_path)
    out = sim_errors(lambda: run_fabric_sweep(
        trace_path, racks, hosts, overs, sharing, requests_per_node, max_requests, rack_gib,
        agg_gib, json_path, plot_path, log=lambda m: click.echo(m, err=True), **kw))
    a = out["answer"]
    for g in a["second_level"]:
        click.echo(f"{a['racks']} x {a['hosts_per_rack']}, sharing {g['sharing']:g}, "
                   f"{g['oversub']:g}:1: the pool-side switch saves {g['pool_egress_saved']:.1%}"
                   f" of pool egress and {g['uplink_saved']:.1%} of uplink bytes for "
                   f"{g['boxes']} box and {g['xdp_cores']:.1f} XDP cores: net "
                   f"${g['net_usd_per_hour']:.2f}/h")
    say_wrote(json_path, plot_path)


def _numbers(name: str, value: str, kind) -> list:
    try:
        out = [kind(x) for x in value.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out:
        raise click.BadParameter(f"give a comma-separated list of numbers, got {value!r}",
                                 param_hint=name)
    return out
