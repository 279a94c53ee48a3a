"""The `testbed` command line: its groups (testbed, bench, sim) and every command in one table,
COMMANDS. Every command is a click command defined beside the code it runs, registered here and
nowhere else: the lab's, the demos', the fuzzer's, the policy evaluator's and the results
check's below; each benchmark's in its package's cli module (testbed.bench.serve.cli, .faults.cli,
.fetch.cli, .stores.cli, .quality.cli, .validate.cli); the cluster model's in testbed.sim.cli.
Each command parses its options and calls the library function of its experiment, imported when
the command runs."""
from __future__ import annotations

import click

from kvproto import VETH_MAX_MTU
from kvproto.cli import FINITE, chunk_option, one_line_errors
from switchd.policy import POLICIES

from .bench.faults.cli import faults_cmd, soak
from .bench.fetch.cli import fetch, incast, loss, throughput
from .bench.quality.cli import blend, compress
from .bench.serve.cli import serve, vllm
from .bench.stores.cli import lmcache
from .bench.validate.cli import replay, sim_validate
from .demos.inference import BLOCK_TOKENS, MODEL_CHOICES as DEMO_MODELS
from .demos.vllm import MODELS_DIR as DEMO_MODEL_DIR
from .lab.topology import TestbedError, Topology, down, namespaces_of
from .options import (capacity_value, fabric_up_options, fail_unless, int_list, json_opt,
                      link_options, link_spec, numbers, plot_opt, plot_path_for, policy_list,
                      trace_opt)
from .sim.cli import sim_fabric, sim_reprice, sim_run, sim_sweep


@click.group(cls=one_line_errors("testbed", TestbedError))
def main():
    """veth/namespace testbeds for the in-network KV-cache switch."""


@click.group()
def bench():
    """Benchmarks: side-by-side modes in one run, JSON results and plots."""


@click.group()
def sim():
    """Cluster-scale model: tiers, switch pool on/off, break-even, testbed validation."""


# ---- topologies, demos, the fuzzer, the policy evaluator, the results check ---------------------
@click.command()
@click.option("--name", default="kv", show_default=True, help="Prefix of every object made.")
@click.option("--hosts", type=click.IntRange(1, 99), default=2, show_default=True)
@click.option("--pools", type=click.IntRange(1, 99), default=1, show_default=True)
@click.option("--mtu", type=click.IntRange(1280, VETH_MAX_MTU), default=1500, show_default=True,
              help=f"Above {VETH_MAX_MTU} this kernel refuses native XDP on veths.")
@click.option("--store", type=click.Choice(["memory", "mooncake"]), default="memory",
              show_default=True, help="mooncake: also run a Mooncake master (node m1) for the "
                                      "pool nodes' `hostagent serve --store mooncake`.")
@link_options
@fabric_up_options
def up(name, hosts, pools, mtu, store, link_gbit, pool_link_gbit, link_delay_us):
    """Build a switch namespace with a bridge, inference nodes h1.. and pool nodes p1.. (with
    --racks: rack switches r1.. and a pool-side switch agg)."""
    links = link_spec(link_gbit, pool_link_gbit, link_delay_us)
    t = Topology(name, hosts, pools, mtu, master=store == "mooncake", links=links).up()
    click.echo(f"testbed {name}: switch netns {t.switch_ns} (bridge ports "
               f"{', '.join(t.ports)}), pin dir {t.pin_dir}")
    for n in t.nodes:
        rate = links.rate(n.role) if links else None
        click.echo(f"  {n.name:4} {n.role:5} netns {n.netns:10} {n.ip}" +
                   (f"  link {rate:g} Gbit/s via netns {name}-l{n.name}" if rate else ""))
    if store == "mooncake":
        from .lab.mooncake import MooncakeMaster
        log = f"/tmp/kvswitch-{name}-mooncake-master.log"
        try:
            master = MooncakeMaster(t, log).start(detach=True)
        except BaseException:
            t.down()
            raise
        click.echo(f"  m1   mooncake_master netns {t.master_node.netns} {master.address}, log "
                   f"{log}\n  pool nodes: ip netns exec {name}-p1 hostagent serve --store "
                   f"mooncake --mooncake-master {t.master_node.ip}")


@click.command("down")
@click.option("--name", default="kv", show_default=True)
@click.option("--all", "everything", is_flag=True, help="Every testbed this tool made.")
def down_cmd(name, everything):
    """Remove a testbed and anything left running in it (idempotent)."""
    prefixes = ({n.rsplit("-", 1)[0] for n in namespaces_of("")
                 if n.endswith(("-sw", "-agg"))}
                if everything else {name})
    removed = [ns for p in sorted(prefixes) for ns in down(p)]
    click.echo(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed
                                                         else ""))


@click.command()
@click.option("--chunks", type=click.IntRange(64, 65536), default=256, show_default=True)
@click.option("--store", type=click.Choice(["memory", "mooncake"]), default="memory",
              show_default=True, help="The pool node's store (mooncake: the demo runs a "
                                      "Mooncake master).")
def demo(chunks, store):
    """Fetch a KV block through the switch from two inference nodes (see `make demo`)."""
    from .demos.basic import run_demo
    fail_unless(run_demo(chunks, store=store))


@click.command("demo-inference")
@click.option("--sizes", default=None, callback=lambda c, p, v: v and int_list(c, p, v),
              help="Shared-prompt sizes in tokens (multiples of --block-tokens) [default: "
                   "1024,4096 for smollm2, 1024,4096,16384 for the others].")
@chunk_option(default=3072)
@click.option("--concurrency", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Blocks fetched or put at once per node.")
@click.option("--window", type=click.IntRange(1, 1024), default=64, show_default=True,
              help="Chunks in flight per block.")
@click.option("--new-tokens", type=click.IntRange(1, 1024), default=16, show_default=True,
              help="Greedy tokens generated and compared per prompt.")
@click.option("--model", type=click.Choice(DEMO_MODELS), default="smollm2",
              show_default=True, help="smollm2: the real SmolLM2-135M-Instruct on real text; "
                                      "the others: seeded-random weights.")
@click.option("--kv-codecs", default="none,int8,int4", show_default=True,
              help="KV codecs whose blocks also move (none is always run and must be exact).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="float32",
              show_default=True)
@click.option("--block-tokens", type=click.IntRange(16, 4096), default=BLOCK_TOKENS,
              show_default=True, help="Tokens per KV block (also the prefill chunk).")
@click.option("--name", default="inf", show_default=True, help="Testbed prefix.")
@json_opt()
def demo_inference(sizes, chunk_size, concurrency, window, new_tokens, model, kv_codecs,
                   dtype, block_tokens, name, json_path):
    """Prefix KV of a transformer through the switch: TTFT vs recompute, per KV codec."""
    from hostagent.inference.codec import UnknownCodec, parse
    from .demos.inference import run_inference_demo
    codecs = [c.strip() for c in kv_codecs.split(",") if c.strip()]
    try:
        [parse(c) for c in codecs]
    except UnknownCodec as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-codecs") from None
    sizes = sizes or ([1024, 4096] if model == "smollm2" else [1024, 4096, 16384])
    if any(s % block_tokens for s in sizes):
        raise click.BadParameter(f"must be multiples of --block-tokens ({block_tokens})",
                                 param_hint="--sizes")
    fail_unless(run_inference_demo(sizes, chunk_size, window, concurrency, new_tokens, model,
                                   dtype, block_tokens, name, json_path, codecs=codecs))


@click.command("demo-vllm")
@click.option("--shared", type=click.IntRange(16), default=4000, show_default=True,
              help="Tokens of the shared prefix (at least one block).")
@click.option("--question", type=click.IntRange(1), default=40, show_default=True,
              help="Tokens of each prompt's own question after the prefix.")
@click.option("--new-tokens", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.option("--ttft-reps", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Timed requests per TTFT figure.")
@chunk_option(default=3072)
@click.option("--window", type=click.IntRange(1, 1024), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--block-tokens", type=click.IntRange(16, 4096), default=128, show_default=True,
              help="vLLM's block size, also one KV block of the switch.")
@click.option("--model", default="small-llama", show_default=True,
              type=click.Choice(["smollm2"] + sorted(p.name for p in DEMO_MODEL_DIR.iterdir()
                                                     if p.is_dir())),
              help="smollm2: the real SmolLM2-135M-Instruct on real text (make setup); the "
                   "others: a model config shipped in testbed/demos/models, seeded weights.")
@click.option("--kv-codec", default="none", show_default=True,
              help="The connectors' KV codec (none, int8, fp8, int4, int4h): other than none, "
                   "greedy agreement with recompute is reported instead of required identity.")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also run an engine without the connector (the token-identity reference).")
@click.option("--negative/--no-negative", default=True, show_default=True,
              help="Also check that another model id finds nothing (no false hits).")
@click.option("--must-win/--no-must-win", default=True, show_default=True,
              help="Fail unless TTFT with the connector beats recompute.")
@click.option("--name", default="vl", show_default=True, help="Testbed prefix.")
@json_opt()
def demo_vllm(shared, question, new_tokens, ttft_reps, chunk_size, window, concurrency,
              block_tokens, model, kv_codec, baseline, negative, must_win, name, json_path):
    """Two vLLM engines share prefix KV through the switch (the kvswitch KV connector)."""
    from hostagent.inference.codec import UnknownCodec, parse
    from .demos.vllm import run_vllm_demo
    try:
        parse(kv_codec)
    except UnknownCodec as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-codec") from None
    try:
        ok = run_vllm_demo(shared, question, new_tokens, ttft_reps, chunk_size, window,
                           concurrency, block_tokens, model, baseline, negative, must_win, name,
                           json_path, kv_codec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    fail_unless(ok)


@click.command()
@click.option("--frames", type=click.IntRange(1), default=100_000, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@json_opt()
def fuzz(frames, seed, json_path):
    """Random and mutated frames through the data plane, checked against a reference."""
    from .fuzz import run_fuzz
    fail_unless(not run_fuzz(frames, seed, json_path)["violations"])


@click.command("policy-eval")
@trace_opt
@click.option("--capacity", type=FINITE, default=0.02, show_default=True, callback=capacity_value,
              help="Cache size: a fraction of the trace's distinct blocks if < 1, else blocks.")
@click.option("--sweep", callback=lambda c, p, v: v and [capacity_value(c, p, x) for x in
                                                         numbers(v, float, 0)],
              help="Comma list of capacities instead of --capacity: hit ratio vs capacity.")
@plot_opt(help="With --sweep: PNG path (default: the JSON path with .png).")
@json_opt()
@click.option("--policies", callback=policy_list,
              help=f"Comma list (default: all of switchd's, {', '.join(POLICIES)}, and "
                   "libCacheSim's, e.g. ARC or lcs:ARC); belady and static always run.")
def policy_eval(trace_path, capacity, sweep, plot_path, json_path, policies):
    """Replay a trace against switchd's policies, libCacheSim's, Belady and the best fixed set."""
    from .results import write_json
    from .sim.baselines import LibCacheSimMissing
    from .sim.evaluate import evaluate, plot_sweep, render, sweep as run_sweep
    from .sim.trace import TraceError, load_trace
    try:
        trace = load_trace(trace_path)
        if not sweep:
            result = evaluate(trace, capacity, policies)
            render(result)
            return write_json(json_path, result)
        result = run_sweep(trace, sweep, policies, log=click.echo)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--trace'") from None
    except LibCacheSimMissing as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(f"plotted: {', '.join(result['plotted'])}")
    write_json(json_path, result)
    plot_path = plot_path_for(json_path, plot_path)
    if plot_path:
        plot_sweep(result, plot_path)


@click.command("results-check")
@click.option("--root", default=".", show_default=True, help="The checkout to check.",
              type=click.Path(exists=True, file_okay=False))
@click.option("--require-stamps", is_flag=True, envvar="KVSWITCH_REQUIRE_STAMPS",
              help="A cited result without a `measured` stamp (what made it, on which commit) "
                   "fails as unstamped.")
def results_check(root, require_stamps):
    """Every result file README and docs cite: present, and made by the code as it is now."""
    from .provenance import NotACheckout, check, render
    try:
        lines, ok = render(check(root, require_stamps=require_stamps))
    except NotACheckout as exc:
        raise click.ClickException(str(exc)) from None
    for line in lines:
        click.echo(line)
    fail_unless(ok)


# ---- every command, registered on its group -----------------------------------------------------
COMMANDS = {
    main: [up, down_cmd, demo, demo_inference, demo_vllm, fuzz, soak, policy_eval, replay,
           results_check, bench, sim],
    bench: [throughput, incast, serve, loss, fetch, blend, compress, vllm, faults_cmd, lmcache],
    sim: [sim_run, sim_sweep, sim_reprice, sim_validate, sim_fabric],
}
for group, commands in COMMANDS.items():
    for command in commands:
        group.add_command(command)
