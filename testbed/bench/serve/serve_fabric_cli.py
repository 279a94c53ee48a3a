"""The `--racks` options of `testbed bench serve` (testbed.bench.serve.serve_fabric): a decorator
that adds them to the command and, when ``--racks`` is given, runs the fabric benchmark in place of
the single-switch one (burst, Zipf and incast; modes bridge, rack, pool-side, fabric).
`testbed up --racks` is testbed.options.fabric_up_options."""
from __future__ import annotations

import functools
import json

import click

from kvproto.cli import FINITE, FloatRange

from ...options import plot_path_for, say_wrote

FABRIC_JSON = "bench/results/serve-fabric.json"


def fabric_options(command):
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
