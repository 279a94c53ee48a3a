"""`testbed bench lmcache` (registered by testbed.cli): it parses its options and calls the
benchmark, lmcache_bench.run_lmcache_bench (each node's engine: lmcache_node)."""
from __future__ import annotations

import json

import click

from kvproto.cli import FloatRange

from ...lab import TestbedError
from ...options import fail_unless, json_opt, name_list, plot_opt, plot_path_for
from .lmcache_bench import STORES, WORKLOADS, LmcacheBench, run_lmcache_bench
from ..serve.serve import check_choices

POSITIVE = click.IntRange(1)


@click.command("lmcache")
@click.option("--stores", default=",".join(STORES), show_default=True, callback=name_list,
              help="Comma list of the remote stores, side by side.")
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True, callback=name_list,
              help="Comma list of the workloads.")
@click.option("--nodes", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Inference nodes, each an LMCache engine.")
@click.option("--link-gbit", type=FloatRange(0, min_open=True), default=0.1,
              show_default=True, help="Rate of every link, both directions (incast, zipf).")
@click.option("--timeout-s", type=POSITIVE, default=60, show_default=True,
              help="How long LMCache waits for a remote chunk (its blocking_timeout_secs), "
                   "every store alike.")
@click.option("--hot-tokens", type=POSITIVE, default=1024, show_default=True,
              help="Tokens of the incast's hot prefix (whole LMCache chunks of 256 count).")
@click.option("--incast-rounds", type=POSITIVE, default=3, show_default=True,
              help="Hot prefixes, each retrieved by every node at once.")
@click.option("--zipf-prefixes", type=POSITIVE, default=16, show_default=True)
@click.option("--zipf-requests", type=POSITIVE, default=6, show_default=True,
              help="Retrieves per node in the zipf workload.")
@click.option("--single-prefixes", type=POSITIVE, default=4, show_default=True,
              help="Prefixes the lone retriever retrieves on the unshaped testbed, a turn.")
@click.option("--single-rounds", type=POSITIVE, default=5, show_default=True,
              help="Turns each store takes at the lone retriever (stores alternate).")
@click.option("--prefix", default="lb", show_default=True,
              help="Names the testbeds' namespaces (PREFIX, PREFIXm, PREFIXu, PREFIXmu).")
@json_opt("bench/results/lmcache.json")
@plot_opt()
def lmcache(stores, workloads, nodes, link_gbit, timeout_s, hot_tokens, incast_rounds,
            zipf_prefixes, zipf_requests, single_prefixes, single_rounds, prefix, json_path,
            plot_path):
    """kvswitch as LMCache's remote tier beside LMCache's server, Redis and Mooncake Store."""
    check_choices("store", stores, STORES)
    check_choices("workload", workloads, WORKLOADS)
    try:
        import lmcache  # noqa: F401
    except ImportError:
        raise TestbedError("LMCache is not installed: run `make setup` (it installs "
                           "lmcache==0.5.6 into .venv)") from None
    plot_path = plot_path_for(json_path, plot_path)
    cfg = LmcacheBench(nodes=nodes, link_gbit=link_gbit, timeout_s=timeout_s,
                       hot_tokens=hot_tokens,
                       incast_rounds=incast_rounds, zipf_prefixes=zipf_prefixes,
                       zipf_requests=zipf_requests, single_prefixes=single_prefixes,
                       single_rounds=single_rounds,
                       stores=tuple(stores), workloads=tuple(workloads), prefix=prefix)
    out = run_lmcache_bench(cfg, json_path, plot_path, log=click.echo)
    click.echo(json.dumps(out["summary"], indent=2))
    fail_unless(out["summary"]["byte_exact"] and not out["summary"]["failed"])
