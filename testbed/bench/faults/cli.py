"""The `testbed bench faults` command (registered by testbed.cli); the benchmark is
testbed.bench.faults.faults, the faults testbed.lab.fault_kinds."""
from __future__ import annotations

import json

import click

from kvproto.cli import FINITE

from ...options import fail_unless, json_opt, name_list, plot_opt, plot_path_for
from ...lab.fault_kinds import FAULTS, Target
from .faults import STORES, run_faults


@click.command("faults")
@click.option("--faults", "faults", default=",".join(FAULTS), show_default=True,
              callback=name_list, help="Comma list of the faults to inject, one run each.")
@click.option("--stores", default=",".join(STORES), show_default=True, callback=name_list,
              help="Pool stores: every fault runs with memory; pool-kill with each.")
@click.option("--nodes", type=int, default=8, show_default=True, help="Inference nodes.")
@click.option("--pools", type=int, default=2, show_default=True, help="Pool nodes.")
@click.option("--link-gbit", type=FINITE, default=0.025, show_default=True,
              help="Rate of every link, both directions.")
@click.option("--run-seconds", type=FINITE, default=40.0, show_default=True,
              help="Length of each run's traffic (the fault strikes in its second burst).")
@click.option("--fault-seconds", type=FINITE,
              help="How long every fault lasts  [default: each fault's own, in the JSON]")
@click.option("--host-node", default="h1", show_default=True,
              help="The inference node flap-host pulls the cable of.")
@click.option("--pool-node", default="p1", show_default=True,
              help="The pool node pool-kill kills and flap-pool pulls the cable of.")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Seeds the moment each fault strikes.")
@json_opt("bench/results/faults.json")
@plot_opt()
def command(faults, stores, nodes, pools, link_gbit, run_seconds, fault_seconds, host_node,
            pool_node, seed, json_path, plot_path):
    """One fault at a time while serving, beside the bridge and the fault-free switch."""
    plot_path = plot_path_for(json_path, plot_path)
    out = run_faults(faults, stores, nodes, pools, link_gbit, run_seconds, fault_seconds,
                     Target(host_node, pool_node), seed, json_path, plot_path, log=click.echo)
    s = out["summary"]
    click.echo(json.dumps(s, indent=2))
    fail_unless(s["failed_requests"] == 0 and s["wrong_bytes"] == 0)
