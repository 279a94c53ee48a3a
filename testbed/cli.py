"""The `testbed` command line, every command of it: topologies, demos, benchmarks, the fuzzer,
trace evaluation and replay, the cluster model, the results check. Each command parses its
options and calls the library function of its experiment (testbed.lab, .bench, .sim, .demos,
.fuzz, .provenance), imported when the command runs."""
from __future__ import annotations

import json

import click

from kvproto.cli import FINITE, FloatRange, one_line_errors
from kvproto import VETH_MAX_MTU
from kvproto.cli import chunk_option
from switchd.policy import POLICIES

from .bench.quality.compress import command as compress_command
from .bench.faults.cli import command as faults_command
from .bench.stores.cli import command as lmcache_command
from .bench.validate.cli import sim_validate
from .bench.serve.serve_vllm import command as vllm_bench_command
from .bench.serve.serve_fabric_cli import fabric_options
from .bench.serve.serve_tiers_cli import tiers_options
from .demos.inference import BLOCK_TOKENS, MODEL_CHOICES as DEMO_MODELS
from .demos.vllm import MODELS_DIR as DEMO_MODEL_DIR
from .lab.lab import STORES
from .sim.cli import sim as sim_group
from .sim.config import MODELS as SIM_MODELS
from .lab.topology import TestbedError, Topology, down, namespaces_of
from .options import (capacity_value, chunk_list, cpu_list, fabric_up_options, fail_unless,
                      float_list, int_list, json_opt, link_options, link_spec, numbers,
                      name_list, percent_list, plot_opt, plot_path_for, policy_list, say_wrote,
                      trace_opt)


# ---- topologies and demos ----------------------------------------------------------------------
@click.group(cls=one_line_errors("testbed", TestbedError))
def main():
    """veth/namespace testbeds for the in-network KV-cache switch."""


@main.command()
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


@main.command("down")
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


@main.command()
@click.option("--chunks", type=click.IntRange(64, 65536), default=256, show_default=True)
@click.option("--store", type=click.Choice(["memory", "mooncake"]), default="memory",
              show_default=True, help="The pool node's store (mooncake: the demo runs a "
                                      "Mooncake master).")
def demo(chunks, store):
    """Fetch a KV block through the switch from two inference nodes (see `make demo`)."""
    from .demos.basic import run_demo
    fail_unless(run_demo(chunks, store=store))


@main.command("demo-inference")
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


@main.command("demo-vllm")
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


@main.command()
@click.option("--frames", type=click.IntRange(1), default=100_000, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@json_opt()
def fuzz(frames, seed, json_path):
    """Random and mutated frames through the data plane, checked against a reference."""
    from .fuzz import run_fuzz
    fail_unless(not run_fuzz(frames, seed, json_path)["violations"])


# ---- benchmarks --------------------------------------------------------------------------------
@main.group()
def bench():
    """Benchmarks: side-by-side modes in one run, JSON results and plots."""


bench.add_command(compress_command())
bench.add_command(vllm_bench_command())
bench.add_command(faults_command)
bench.add_command(lmcache_command)


@bench.command()
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
    from .bench.fetch.throughput import run_throughput
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


@bench.command()
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
    from .bench.fetch.incast import run_incast
    if readers[-1] > 99:
        raise click.BadParameter("at most 99 readers", param_hint="--readers")
    spec = link_spec(link_gbit, pool_link_gbit, link_delay_us)
    plot_path = plot_path_for(json_path, plot_path)
    out = run_incast(readers, block_mib, reps, json_path, plot_path, chunk_size,
                     spec and spec.host_gbit, spec and spec.pool_gbit, store,
                     spec.delay_us if spec else 0.0)
    click.echo(json.dumps(out["summary"], indent=2))
    say_wrote(json_path, plot_path)


@bench.command()
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
    from .bench.serve.serve import run_serve
    plot_path = plot_path_for(json_path, plot_path)
    out = run_serve(nodes, pools, store, link_gbit, workloads, modes, model, trace_path,
                    trace_requests, scale, json_path, plot_path, log=click.echo)
    click.echo(json.dumps(out["summary"], indent=2))
    say_wrote(json_path, plot_path)
    fail_unless(out["summary"]["all_byte_exact"])


@bench.command()
@click.option("--loss", "losses", default="0,1,5", show_default=True,
              callback=float_list(99.999), help="Loss rates in percent, comma-separated.")
@click.option("--block-mib", type=FloatRange(min=0.01, max=64), default=4.0,
              show_default=True)
@click.option("--reps", type=click.IntRange(1, 50), default=3, show_default=True)
@json_opt("bench/results/loss.json")
def loss(losses, block_mib, reps, json_path):
    """Block fetches over links that drop KV frames."""
    from .bench.fetch.loss import run_loss
    run_loss(losses, block_mib, reps, json_path)


@bench.command()
@click.option("--chunk-sizes", default="3072,1024", show_default=True, callback=chunk_list)
@click.option("--sizes-mib", default="2,64", show_default=True, callback=int_list)
@click.option("--rounds", type=click.IntRange(1, 50), default=5, show_default=True)
@click.option("--mooncake/--no-mooncake", default=True, show_default=True)
@json_opt("bench/results/fetch.json")
@plot_opt()
def fetch(chunk_sizes, sizes_mib, rounds, mooncake, json_path, plot_path):
    """Whole blocks at a node: XDP engine, switch hit path, pool, asyncio client, Mooncake."""
    from .bench.fetch.fetch import run_fetch
    plot_path = plot_path_for(json_path, plot_path)
    out = run_fetch(chunk_sizes, sizes_mib, rounds, mooncake=mooncake, json_path=json_path,
                    plot_path=plot_path, log=click.echo)
    click.echo(json.dumps(out["targets"], indent=2))
    say_wrote(json_path, plot_path)


@bench.command()
@click.option("--prompts", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--pool", type=click.IntRange(1, 1000), default=32, show_default=True,
              help="Passages in the pool (Debian license texts cut into 256-512 tokens).")
@click.option("--ratios", default="5,10,15,20,30", show_default=True, callback=percent_list,
              help="Recompute percentages of the blend modes.")
@click.option("--store", type=click.Choice(["testbed", "local"]), default="testbed",
              show_default=True, help="local: an in-process store instead of the switch/pool.")
@json_opt("bench/results/blend.json")
@plot_opt()
def blend(prompts, pool, ratios, store, json_path, plot_path):
    """CacheBlend: RAG passages' KV reused at any position (SmolLM2-135M, issue #31)."""
    from .bench.quality.blend import run_blend
    plot_path = plot_path_for(json_path, plot_path)
    out = run_blend(prompts, pool, ratios=[r / 100 for r in ratios], store=store,
                    json_path=json_path, plot_path=plot_path, log=click.echo)
    click.echo(json.dumps(out["results"], indent=1))


@main.command()
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
        from .bench.faults.fault_soak import run_fault_soak
        out = run_fault_soak(minutes or 60.0, fault_every,
                             json_path=json_path or "bench/results/soak-faults.json",
                             log=click.echo)
        click.echo(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2))
        fail_unless(out["failed_requests"] == 0 and out["wrong_bytes"] == 0 and
                    out["counters"]["consistent"] and not out["left_behind"])
        return
    from .bench.faults.soak import run_soak
    out = run_soak(minutes or 10.0, json_path or "bench/results/soak.json")
    click.echo(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2))
    fail_unless(out["within_capacity"])


# ---- traces: offline evaluation and live replay ------------------------------------------------
@main.command("policy-eval")
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


@main.command()
@trace_opt
@click.option("--capacity", type=FINITE, default=0.02, show_default=True, callback=capacity_value,
              help="Fraction of the trace's distinct blocks (<1) or a count.")
@click.option("--limit", type=click.IntRange(1), help="Only the first N requests.")
@click.option("--speedup", type=FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Time compression of the trace's pace (10 with a 0.1 s "
              "interval: one policy step per second of trace, as switchd's default).")
@click.option("--interval", type=FloatRange(min=0.05), default=0.1, show_default=True,
              help="switchd's policy interval, seconds.")
@click.option("--policy", type=click.Choice(list(POLICIES)), help="Default: switchd's default.")
@click.option("--fill-headroom", type=click.IntRange(min=0),
              help="Extra cache entries for speculative fills (default: a quarter of capacity).")
@json_opt()
def replay(trace_path, capacity, limit, speedup, interval, policy, fill_headroom, json_path):
    """Replay a trace through the testbed; compare the live hit ratio with the evaluator's."""
    from .bench.validate.replay import run_replay
    run_replay(trace_path, capacity, limit, speedup, interval, json_path=json_path,
               fill_headroom=fill_headroom, policy=policy)


@main.command("results-check")
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


# ---- the cluster model (testbed.sim.cli; its live validation: testbed.bench.validate.cli) -------
sim_group.add_command(sim_validate)
main.add_command(sim_group)
