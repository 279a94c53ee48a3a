"""What reusing KV does to a real model: `testbed bench compress` and `bench blend` (registered by
testbed.cli). Each parses its options and calls its benchmark (compress.run_compress,
blend.run_blend), imported when the command runs (torch with it)."""
from __future__ import annotations

import json
import os

import click

from ...options import json_opt, percent_list, plot_opt, plot_path_for, trace_opt
from .compress import BLOCK_TOKENS


def codec_list(ctx, param, value):
    """--codecs: a comma list of codec names hostagent.inference.codec knows."""
    from hostagent.inference.codec import UnknownCodec, parse   # torch: only when it runs
    names = [v.strip() for v in value.split(",") if v.strip()]
    try:
        for n in names:
            parse(n)
    except UnknownCodec as exc:
        raise click.BadParameter(str(exc)) from None
    return names


@click.command("compress")
@click.option("--codecs", default="none,int8,fp8,int4,int4h,pca", show_default=True,
              callback=codec_list,
              help="Comma list of KV codecs (NAME, NAME/gTOKENS, pca/xRATIO).")
@click.option("--prompts", type=click.IntRange(1, 200), default=20, show_default=True,
              help="Windows of Debian's license texts.")
@click.option("--prefix-tokens", type=click.IntRange(BLOCK_TOKENS), default=256,
              show_default=True, help=f"KV under test: whole {BLOCK_TOKENS}-token blocks.")
@click.option("--new-tokens", type=click.IntRange(1, 1024), default=64, show_default=True)
@click.option("--load-blocks", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="Blocks of the long prefix loaded from the switch.")
@click.option("--chunk-size", type=click.IntRange(64, 3440), default=3072,
              show_default=True)
@click.option("--parts", default="quality,speed,load,policy", show_default=True,
              help="Comma list of quality, speed, load, policy, loaded (readers at once over "
                   "a shaped pool link: TTFT with and without each codec).")
@click.option("--readers", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Readers of the loaded part.")
@click.option("--pool-link-gbit", type=click.FloatRange(0.001, 100), default=1.0,
              show_default=True, help="The pool node's link in the loaded part (Gbit/s).")
@trace_opt(help="Trace for the policy hit ratio (default: the one in testbed/traces/).")
@click.option("--json", "json_path", default="bench/results/compress.json",
              show_default=True)
@click.option("--plot", "plot_path", help="PNG (default: the JSON path with .png).")
@click.option("--update", is_flag=True,
              help="Update the JSON file's results with these parts (a run in parts).")
def compress(codecs, prompts, prefix_tokens, new_tokens, load_blocks, chunk_size, parts,
             readers, pool_link_gbit, trace_path, json_path, plot_path, update):
    """KV codecs on SmolLM2: ratio, perplexity, agreement, speed, load from the switch, TTFT of
    readers over a shared pool link."""
    from ...demos.realmodel import ModelMissing
    from .compress import run_compress
    parts = [p.strip() for p in parts.split(",") if p.strip()]
    bad = set(parts) - {"quality", "speed", "load", "policy", "loaded"}
    if bad:
        raise click.BadParameter(f"unknown parts {sorted(bad)}", param_hint="--parts")
    if prefix_tokens % BLOCK_TOKENS:
        raise click.BadParameter(f"must be a multiple of {BLOCK_TOKENS}",
                                 param_hint="--prefix-tokens")
    plot_path = plot_path or (json_path and os.path.splitext(json_path)[0] + ".png")
    try:
        out = run_compress(codecs, prompts, prefix_tokens, new_tokens=new_tokens,
                           load_blocks=load_blocks, chunk_size=chunk_size,
                           trace_path=trace_path, json_path=json_path,
                           plot_path=plot_path, parts=parts, update=update,
                           readers=readers, pool_gbit=pool_link_gbit, log=click.echo)
    except ModelMissing as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(out["results"], indent=1))


@click.command()
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
    from .blend import run_blend
    plot_path = plot_path_for(json_path, plot_path)
    out = run_blend(prompts, pool, ratios=[r / 100 for r in ratios], store=store,
                    json_path=json_path, plot_path=plot_path, log=click.echo)
    click.echo(json.dumps(out["results"], indent=1))
