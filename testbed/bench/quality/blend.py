"""`testbed bench blend`: CacheBlend's non-prefix reuse on SmolLM2-135M with passages' KV through
the testbed's switch and pool node (issue #31).

Workload: a pool of passages cut from Debian's license texts (``/usr/share/common-licenses``),
each a run of 256..512 tokens; every prompt is a fixed system prompt, 4..6 passages drawn from the
pool in random order, and a question (chat template of SmolLM2-Instruct). Seeded.

Modes, each timed from the prompt to its first token's logits on this CPU (fetch included):
full prefill; prefix-only reuse (today's KV connector: the longest prefix of 16-token blocks
from the pool; after each prompt its blocks that a later prompt shares are put, as a prefix
cache would hold them); full reuse (every passage's KV from the pool, moved to its offset, no
recompute, the question prefilled over it); CacheBlend at several recompute ratios (of the
passage tokens; the system prompt, at offset 0, is exact), picking tokens as ``RECIPE`` says.
Before the prompts run, every pool passage is prefilled (alone, or behind the lead) and put
(cached once); passages are fetched through the fetch engine (the asyncio client where it cannot
run). ``calibrate`` adds a mode ``exact-bf16``: full prefill's own KV rounded to bf16, the
question prefilled over it, which shows how far the metrics move for a tiny perturbation.

Per mode: greedy agreement of ``new_tokens`` tokens with full prefill (share of equal positions;
also the first position where they part and the teacher-forced agreement along full prefill's
tokens),
the perplexity of full prefill's greedy continuation under the mode's cache relative to full
prefill's (token-weighted over all prompts), mean TTFT, share of prompt tokens whose KV came from
the pool and was not recomputed, payload bytes fetched per prompt. The JSON holds exactly
``{"model", "results"}``; details (per-prompt rows, config, transfer counters) go beside it in
``<json>-detail.json``.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time

NS = 31
SEED = 31
PASSAGE_BLOCK = 64          # passage blocks: 64 tokens, 2.9 MB of float32 KV (SmolLM2)
PREFIX_BLOCK = 16           # prefix blocks, as vLLM's
SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Read the documents the user gives "
          "you and answer the question after them.<|im_end|>\n<|im_start|>user\nDocuments:\n")
# How blending picks what it recomputes (docs/cacheblend.md): passages computed after the system
# prompt (lead), the first ``first`` tokens of each passage always recomputed, check layers
# (gradual filtering from ``widen`` x the ratio), deviation of K and/or V.
RECIPE = {"lead": False, "first": 0, "checks": [1], "widen": 1.0, "of": "kv"}
QUESTIONS = ["Which rights does the license text above grant, in one sentence?",
             "Summarise the conditions stated in these documents.",
             "What must someone who redistributes the work do, according to the documents?",
             "Is there any warranty? Answer from the documents.",
             "Which document above is the most permissive, and why?"]


def workload(tok, texts: dict[str, str], pool: int, prompts: int, per_prompt: tuple[int, int],
             passage_tokens: tuple[int, int], seed: int = SEED):
    """(system tokens, passages, prompts: [(passage indexes, question tokens)])."""
    rng = random.Random(seed)
    cut, names = [], sorted(texts)
    streams = {n: tok(texts[n]).input_ids for n in names}
    while len(cut) < pool:
        progressed = False
        for n in names:
            s = streams[n]
            size = rng.randint(*passage_tokens)
            if len(s) >= size and len(cut) < pool:
                cut.append(s[:size])
                streams[n] = s[size:]
                progressed = True
        if not progressed:
            raise ValueError(f"the texts hold fewer than {pool} passages")
    system = tok(SYSTEM).input_ids
    out = []
    for i in range(prompts):
        k = rng.randint(*per_prompt)
        q = tok(f"\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n"
                "<|im_start|>assistant\n").input_ids
        out.append((rng.sample(range(pool), k), q))
    return system, cut, out


def _later_shared(keys: list[list[bytes]]) -> list[set[bytes]]:
    """For each prompt, its prefix keys that a later prompt also has."""
    out, seen_after = [set()] * len(keys), set()
    for i in range(len(keys) - 1, -1, -1):
        out[i] = set(keys[i]) & seen_after
        seen_after |= set(keys[i])
    return out


async def _run(model, tok, mid, client, args: dict, log=print) -> dict:
    import torch
    from hostagent.inference import blend
    from hostagent.inference.blend_store import PassageStore
    from hostagent.common.transfer import TransferStats
    from hostagent.inference.connectors.hf import (BlockLayout, KVConnector, cache_to_blocks,
                                                   greedy, prefill)
    from testbed.demos.realmodel import texts
    torch.set_num_threads(args["threads"])
    cfg, new = model.config, args["new_tokens"]
    system, passages, prompts = workload(tok, texts(), args["pool"], args["prompts"],
                                         tuple(args["per_prompt"]), tuple(args["passage_tokens"]))
    recipe = args.get("recipe", RECIPE)
    store = PassageStore(KVConnector(client, NS, BlockLayout.of(cfg, torch.float32,
                                                                PASSAGE_BLOCK), mid, cfg), model,
                         system if recipe["lead"] else ())
    pconn = KVConnector(client, NS, BlockLayout.of(cfg, torch.float32, PREFIX_BLOCK), mid, cfg)
    t0 = time.perf_counter()
    for i, seg in enumerate([system] + passages):                   # cached once
        lead = i > 0 and bool(store.lead)
        await store.put(seg, store.compute(seg, lead), lead)
    warm = time.perf_counter() - t0
    log(f"put {len(passages)} passages + the system prompt in {warm:.0f} s")
    full_tokens = [system + sum((passages[j] for j in idx), []) + q for idx, q in prompts]
    shared = _later_shared([pconn.keys(t[:-1]) for t in full_tokens])
    stored: set[bytes] = set()
    modes = ([("full", 0.0)] + [("exact-bf16", 0.0)] * bool(args.get("calibrate")) +
             [("prefix", 0.0), ("reuse", 0.0)] + [("blend", r) for r in args["ratios"]])
    rows = []
    prefill(model, full_tokens[0][:64], blend.DynamicCache(config=cfg), 4096)  # warm-up
    for i, ((idx, q), tokens) in enumerate(zip(prompts, full_tokens)):
        segs = [system] + [passages[j] for j in idx]
        R, T = len(tokens) - len(q), len(tokens)
        cand = torch.zeros(R, dtype=torch.bool)
        cand[len(system):] = True                                   # passage tokens
        forced, off = torch.zeros(R, dtype=torch.bool), len(system)
        for j in idx:                               # each passage's first tokens
            forced[off:off + recipe["first"]] = True
            off += len(passages[j])
        ref = None
        for mode, ratio in modes:
            stats, reused = TransferStats(), 0
            start = time.perf_counter()
            if mode == "full":
                cache = blend.DynamicCache(config=cfg)
                logits = prefill(model, tokens, cache, 1 << 20)
            elif mode == "exact-bf16":              # calibration of the metrics: full
                logits, cache = blend.reuse_prefill(     # prefill's own KV rounded to bf16
                    model, tokens, [(k.bfloat16().float(), v.bfloat16().float())
                                    for k, v in exact])
            elif mode == "prefix":
                loaded = await pconn.load(tokens)
                stats, reused, cache = loaded.stats, loaded.tokens, loaded.cache
                logits = prefill(model, tokens, cache, 1 << 20)
            else:
                got = await store.fused_kv(segs)
                stats = got.stats
                if mode == "reuse":
                    logits, cache = blend.reuse_prefill(model, tokens, got.kv)
                    reused = R
                else:
                    b = blend.blend_prefill(model, tokens, got.kv, cand, ratio,
                                            recipe["checks"], recipe["widen"], forced,
                                            recipe["of"])
                    logits, cache, reused = b.logits, b.cache, R - len(b.selected)
                reused = reused if got.misses == 0 else 0      # (all passages were put first)
            ttft = time.perf_counter() - start
            if ref is None:
                ref = greedy(model, logits, cache, new)
                if cache.get_seq_length() > T:
                    cache.crop(T - cache.get_seq_length())
            nll, forced_agree = blend.continuation_nll(model, logits, cache, ref, True)
            out = ref if mode == "full" else greedy(model, logits, cache, new)
            diverge = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), new)
            rows.append({"prompt": i, "mode": mode, "recompute": ratio, "tokens": T,
                         "ttft_s": ttft, "nll": nll,
                         "agreement": sum(a == b for a, b in zip(out, ref)) / new,
                         "first_divergence": diverge, "forced_agreement": forced_agree,
                         "reused": reused, "bytes": stats.bytes,
                         "from_switch": stats.from_switch, "from_pool": stats.from_pool})
            if mode == "prefix":                    # what a prefix cache would hold next
                keys = pconn.keys(tokens[:-1])
                for j, key in enumerate(keys):
                    if key in shared[i] and key not in stored:
                        await client.put_block(NS, key, cache_to_blocks(
                            cache, pconn.layout, j, j + 1)[0])
                        stored.add(key)
            if mode == "full":
                exact = [(k[:, :, :R].clone(), v[:, :, :R].clone())
                         for k, v in blend.cache_kv(cache)]
            del cache
        last = [r for r in rows if r["prompt"] == i]
        if args.get("rows_path"):                   # a run cut short can still be summarised
            with open(args["rows_path"], "a") as f:
                f.writelines(json.dumps({"model": mid, **r}) + "\n" for r in last)
        log(f"prompt {i}: {T} tokens, " + ", ".join(
            f"{r['mode']}{'' if r['mode'] != 'blend' else int(100 * r['recompute'])} "
            f"{r['ttft_s']:.1f}s/{r['agreement']:.2f}" for r in last))
    return {"rows": rows, "warm_seconds": warm, "passages": len(passages),
            "passage_tokens": [len(p) for p in passages], "system_tokens": len(system)}


def summarise(model_id: str, rows: list[dict]) -> dict:
    results = []
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        keyed.setdefault((r["mode"], r["recompute"]), []).append(r)
    full_nll = statistics.fmean(r["nll"] for r in keyed[("full", 0.0)])
    for (mode, ratio), rs in keyed.items():
        results.append({
            "mode": mode, "recompute": ratio,
            "token_agreement": round(statistics.fmean(r["agreement"] for r in rs), 4),
            **({"first_divergence": round(statistics.fmean(r["first_divergence"] for r in rs),
                                          2),
                "teacher_forced_agreement": round(statistics.fmean(r["forced_agreement"]
                                                                   for r in rs), 4)}
               if "first_divergence" in rs[0] else {}),
            "ppl_delta_pct": round(100 * (math.exp(statistics.fmean(r["nll"] for r in rs)
                                                   - full_nll) - 1), 3),
            "ttft_s": round(statistics.fmean(r["ttft_s"] for r in rs), 4),
            "reused_token_share": round(statistics.fmean(r["reused"] / r["tokens"]
                                                         for r in rs), 4),
            "bytes_fetched": int(statistics.fmean(r["bytes"] for r in rs))})
    return {"model": model_id, "results": results}


def _file_log(path):
    def log(line: str) -> None:
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return log


def node(pools: list[str], chunk_size: int, args: dict) -> dict:
    """Task inside the inference node: the whole run, passages through the testbed's pool."""
    os.nice(args.get("nice", 0))            # the model's work yields; switchd and the pool don't
    from hostagent.inference.fetch import AsyncFetchClient, open_client
    from testbed.demos.realmodel import load
    model, tok, mid = load()

    async def go():
        async with open_client(pools, chunk_size, window=64, deadline=60,
                               arena_bytes=256 << 20) as client:
            out = await _run(model, tok, mid, client, args, log=_file_log(args.get("progress")))
            out["fetch_path"] = "xdp" if isinstance(client, AsyncFetchClient) else "asyncio"
            return out
    return {"model": mid, **asyncio.run(go())}


def local(args: dict, log=print) -> dict:
    """The same run in this process with an in-process store (quick runs, no testbed)."""
    from hostagent.inference.blend_store import LocalClient
    from testbed.demos.realmodel import load
    model, tok, mid = load()
    out = asyncio.run(_run(model, tok, mid, LocalClient(), args, log))
    return {"model": mid, "fetch_path": "in-process", **out}


def run_blend(prompts=50, pool=32, per_prompt=(4, 6), passage_tokens=(256, 320),
              ratios=(0.05, 0.10, 0.15, 0.20, 0.30), new_tokens=32, threads=1,
              store="testbed", chunk_size=3072, json_path=None, plot_path=None,
              log=print, recipe=None, calibrate=False, nice=10) -> dict:
    from ...lab import Lab
    from ...results import write_json
    recipe = {**RECIPE, **(recipe or {})}
    args = dict(prompts=prompts, pool=pool, per_prompt=list(per_prompt),
                passage_tokens=list(passage_tokens), ratios=list(ratios),
                new_tokens=new_tokens, threads=threads, recipe=recipe, calibrate=calibrate,
                nice=nice)
    start = time.time()
    log(f"bench blend: {prompts} prompts over {pool} passages, store {store}"
        + (" ..." if store == "local" else "; building the testbed ..."))
    if store == "local":
        out = local(args, log)
        counters = {}
    else:
        with Lab(f"bl{os.getpid() % 100000}", hosts=1, pools=1, chunk_size=chunk_size,
                 pool_capacity="3GiB") as lab:
            args["progress"] = f"/tmp/kvswitch-blend-{os.getpid()}.log"
            args["rows_path"] = f"/tmp/kvswitch-blend-{os.getpid()}.jsonl"
            log(f"testbed {lab.topo.prefix}: the run is in h1; progress in {args['progress']}")
            out = lab.task("h1", f"{__name__}:node", lab.pool_addrs, chunk_size, args,
                           timeout=4 * 3600)
            counters = lab.stats()
    result = summarise(out["model"], out["rows"])
    detail = {"config": {**args, "store": store, "chunk_size": chunk_size,
                         "passage_block_tokens": PASSAGE_BLOCK,
                         "prefix_block_tokens": PREFIX_BLOCK},
              "fetch_path": out["fetch_path"], "warm_seconds": out["warm_seconds"],
              "passage_tokens": out["passage_tokens"], "system_tokens": out["system_tokens"],
              "wall_seconds": time.time() - start, "switch": counters, "rows": out["rows"]}
    write_json(json_path, result)
    if json_path:
        write_json(str(json_path).removesuffix(".json") + "-detail.json", detail)
    if plot_path:
        plot(result, plot_path)
    return result


COLORS = {"full": "grey", "exact-bf16": "silver", "prefix": "tab:blue", "reuse": "tab:red"}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rs = result["results"]
    labels = [r["mode"] if r["mode"] != "blend" else f"blend {r['recompute']:.0%}" for r in rs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("token_agreement", "ppl_delta_pct", "ttft_s"),
                              ("greedy agreement with full prefill (32 tokens)",
                               "perplexity delta vs full prefill (%)", "TTFT (s), this CPU")):
        ax.bar(labels, [r[key] for r in rs], color=[COLORS.get(r["mode"], "tab:green")
                                                    for r in rs])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.suptitle(f"CacheBlend on {result['model']}: passages' KV through the switch/pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    """``python -m testbed.bench.quality.blend ROWS.jsonl JSON PNG``: the results of the prompts
    a run (cut short) finished, from its rows file."""
    rows_path, json_path, plot_path = argv
    from ...results import write_json
    rows = [json.loads(line) for line in open(rows_path)]
    done = {r["prompt"] for r in rows}
    result = summarise(rows[0]["model"], rows)
    write_json(json_path, result)
    write_json(str(json_path).removesuffix(".json") + "-detail.json",
               {"prompts_done": len(done), "summarised_from": rows_path, "rows": rows})
    plot(result, plot_path)
    print(f"{len(done)} prompts summarised into {json_path} and {plot_path}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
