"""`testbed bench faults` and `testbed soak` (registered by testbed.cli). Each parses its options
and calls its benchmark (faults.run_faults with the faults of testbed.lab.fault_kinds;
soak.run_soak, fault_soak.run_fault_soak, imported when the command runs)."""
from __future__ import annotations

import json

import click

from kvproto.cli import FINITE, FloatRange

from ...lab.fault_kinds import FAULTS, Target
from ...options import fail_unless, json_opt, name_list, plot_opt, plot_path_for
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
def faults_cmd(faults, stores, nodes, pools, link_gbit, run_seconds, fault_seconds, host_node,
               pool_node, seed, json_path, plot_path):
    """One fault at a time while serving, beside the bridge and the fault-free switch."""
    plot_path = plot_path_for(json_path, plot_path)
    out = run_faults(faults, stores, nodes, pools, link_gbit, run_seconds, fault_seconds,
                     Target(host_node, pool_node), seed, json_path, plot_path, log=click.echo)
    s = out["summary"]
    click.echo(json.dumps(s, indent=2))
    fail_unless(s["failed_requests"] == 0 and s["wrong_bytes"] == 0)


@click.command()
@click.option("--minutes", type=FloatRange(min=0.1, max=600),
              help="How long  [default: 10; 60 with --faults]")
@click.option("--faults", is_flag=True,
              help="Serving traffic with a fault of `bench faults` every --fault-every s.")
@click.option("--fault-every", type=FloatRange(min=20), default=180.0, show_default=True,
              help="Seconds between faults (with --faults).")
@json_opt(help="Write the result here  [default: bench/results/soak.json; soak-faults.json "
               "with --faults]")
def soak(minutes, faults, fault_every, json_path):
    """Sustained load for a bounded time; checks maps and daemon memory do not grow."""
    if faults:
        from .fault_soak import run_fault_soak
        out = run_fault_soak(minutes or 60.0, fault_every,
                             json_path=json_path or "bench/results/soak-faults.json",
                             log=click.echo)
        click.echo(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2))
        fail_unless(out["failed_requests"] == 0 and out["wrong_bytes"] == 0 and
                    out["counters"]["consistent"] and not out["left_behind"])
        return
    from .soak import run_soak
    out = run_soak(minutes or 10.0, json_path or "bench/results/soak.json")
    click.echo(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2))
    fail_unless(out["within_capacity"])
