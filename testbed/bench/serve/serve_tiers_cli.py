"""The `--tiers` options of `testbed bench serve` (testbed.bench.serve.serve_tiers): a decorator
that adds them to the command and, when ``--tiers`` is given, runs the tiers benchmark in place of
the serving one (its own defaults: 4 nodes, 1 pool node, unless --nodes/--pools are given)."""
from __future__ import annotations

import functools
import json

import click

from kvproto.cli import FINITE

from ...options import name_list, plot_path_for, say_wrote

TIERS_JSON = "bench/results/serve-tiers.json"


def tiers_options(command):
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
