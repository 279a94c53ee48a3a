"""`testbed bench compress`: the KV codecs (``hostagent.inference.codec``) measured on a real
trained model, SmolLM2-135M-Instruct (``testbed.demos.realmodel``), with real English text (Debian's
``/usr/share/common-licenses/*``, but for the texts the ``pca`` codec is calibrated on,
``codec_pca.CALIBRATION_TEXTS``: every codec's quality is measured on text no calibration saw;
the calibration is made first if there is none, ``compress_pca``).

Per codec: the compression ratio against 16-bit KV; the perplexity of a continuation with the
prefix KV loaded through the codec against the same with the exact KV (``ppl_delta_pct``); greedy
token agreement over ``new_tokens`` generated tokens (positional, free running; teacher-forced
agreement along the exact run's tokens too); encode and decode GB/s of 16-bit KV on one core; the
load time of a long prefix fetched from the switch with the XDP fetch engine and decoded into
the model's float32 cache (``load_s``) against the same prefix as uncompressed bf16 blocks copied
into a bf16 cache (``load_s_raw``), on a testbed with a pid-based prefix; and switchd's ``prefix``
policy's hit ratio on the shared trace when the switch's bytes for 2 % of the trace's blocks at
16 bits hold ``ratio`` times as many compressed blocks (``testbed.sim.evaluate``); and (part
``loaded``, ``compress_loaded``) the TTFT of readers asking for one long prefix at once over a
shared pool link, with and without each codec.

Each prompt is a window of one text: ``prefix_tokens`` (whole blocks, the KV under test), then
``suffix_tokens`` computed exactly and ``new_tokens`` generated greedily; the perplexity runs over
the ``cont_tokens`` after the prefix. JSON: ``{"model", "config", "results": [{"codec",
"ratio", "ppl_delta_pct", "token_agreement", "decode_gbytes_per_s", "load_s", "load_s_raw",
"hit_ratio_at_2pct_bytes", ...}], "entropy", "loaded"}``; a plot beside it.
"""
from __future__ import annotations

import asyncio
import math
import os
import time

BLOCK_TOKENS = 256
NS = 28


# ---- prompts and the model ------------------------------------------------------------------
def windows(tok, need: int, count: int) -> list[tuple[str, list[int]]]:
    """``count`` windows of ``need`` tokens from the license texts no calibration uses, spread
    over every text long enough (round robin, each text's windows evenly spaced)."""
    from hostagent.inference.codec_pca import CALIBRATION_TEXTS
    from testbed.demos.realmodel import texts
    ids = {name: tok(text)["input_ids"] for name, text in texts().items()
           if name not in CALIBRATION_TEXTS}
    ids = {n: t for n, t in ids.items() if len(t) >= need}
    per = {n: 0 for n in ids}
    while sum(per.values()) < count and any(len(ids[n]) >= need * (per[n] + 1) for n in ids):
        for n in sorted(ids, key=lambda n: -len(ids[n])):
            if sum(per.values()) < count and len(ids[n]) >= need * (per[n] + 1):
                per[n] += 1
    out = []
    for n, k in sorted(per.items()):
        step = (len(ids[n]) - need) // max(1, k - 1) if k > 1 else 0
        out += [(f"{n}@{i * step}", ids[n][i * step:i * step + need]) for i in range(k)]
    return out


def _batch_cache(caches, config):
    """One DynamicCache of batch ``len(caches)`` stacking batch-1 caches (same length)."""
    import torch
    from transformers import DynamicCache
    return DynamicCache([(torch.cat([c.layers[i].keys for c in caches]),
                          torch.cat([c.layers[i].values for c in caches]))
                         for i in range(len(caches[0].layers))], config=config)


def quality(model, layout, codecs, prompts, prefix_tokens, cont_tokens, suffix_tokens,
            new_tokens, log=print) -> dict:
    """Per codec: perplexity, its delta, agreement (free running and teacher forced). Every
    codec of a prompt runs in one batch (row 0: none, the exact KV), so a step costs one
    forward for all of them."""
    import torch
    from transformers import DynamicCache
    from hostagent.inference.connectors.hf import (blocks_to_cache, cache_to_blocks,
                                                   codec_for, prefill)
    order = ["none"] + [c for c in codecs if c != "none"]
    B = len(order)
    acc = {c: {"nll": 0.0, "n": 0, "agree": [], "tf": [], "err": 0.0} for c in order}
    bt = layout.block_tokens
    for pi, (name, ids) in enumerate(prompts):
        ref = DynamicCache(config=model.config)
        prefill(model, ids[:prefix_tokens], ref, bt)
        coded = []
        for c in order:
            codec = codec_for(layout, c)
            coded.append((codec, cache_to_blocks(ref, layout, codec=codec)))

        def fresh():
            return _batch_cache([blocks_to_cache(b, layout, model.config, co)
                                 for co, b in coded], model.config)
        cache = fresh()
        for c, row in zip(order, range(B)):
            acc[c]["err"] = max(acc[c]["err"], max(
                float((l.keys[row] - r.keys[0, :, :prefix_tokens]).abs().max())
                for l, r in zip(cache.layers, ref.layers)))
        cont = torch.tensor([ids[prefix_tokens:prefix_tokens + cont_tokens + 1]] * B)
        with torch.inference_mode():
            # the token after the prefix is predicted by the prefix's last token: recompute
            # it from the cache (positions line up: the cache holds the prefix only)
            lg = model(input_ids=cont[:, :-1], past_key_values=cache, use_cache=True).logits
            lp = torch.log_softmax(lg.float(), -1)
            nll = -lp.gather(-1, cont[:, 1:, None])[..., 0].sum(-1)
            cache = fresh()
            step = model(input_ids=torch.tensor([ids[prefix_tokens:prefix_tokens +
                                                     suffix_tokens]] * B),
                         past_key_values=cache, use_cache=True).logits[:, -1]
            out = [step.argmax(-1)]
            while len(out) < new_tokens:
                step = model(input_ids=out[-1][:, None], past_key_values=cache,
                             use_cache=True).logits[:, -1]
                out.append(step.argmax(-1))
            gen = torch.stack(out, 1)                            # [B, new_tokens]
            ref_tokens = gen[0]
            cache = fresh()
            tf_in = torch.tensor([ids[prefix_tokens:prefix_tokens + suffix_tokens]] * B)
            tf_in = torch.cat([tf_in, ref_tokens[None, :-1].expand(B, -1)], 1)
            lg = model(input_ids=tf_in, past_key_values=cache,
                       use_cache=True).logits[:, suffix_tokens - 1:]
            tf = (lg.argmax(-1) == ref_tokens[None]).float().mean(-1)
        for row, c in enumerate(order):
            a = acc[c]
            a["nll"] += float(nll[row])
            a["n"] += cont_tokens
            a["agree"].append(float((gen[row] == ref_tokens).float().mean()))
            a["tf"].append(float(tf[row]))
        log(f"  prompt {pi + 1}/{len(prompts)} {name}: agreement " + ", ".join(
            f"{c} {acc[c]['agree'][-1]:.2f}" for c in order))
    base = math.exp(acc["none"]["nll"] / acc["none"]["n"])
    out = {}
    for c, a in acc.items():
        ppl = math.exp(a["nll"] / a["n"])
        out[c] = {"ppl": round(ppl, 4), "ppl_delta_pct": round(100 * (ppl / base - 1), 4),
                  "token_agreement": round(sum(a["agree"]) / len(a["agree"]), 4),
                  "token_agreement_teacher_forced": round(sum(a["tf"]) / len(a["tf"]), 4),
                  "max_abs_key_error": round(a["err"], 5)}
    return out


def speed(layout, codecs, block_kv, reps: int = 5) -> dict:
    """Encode and decode GB/s of 16-bit KV on one core, over real blocks ``block_kv``
    ([n, L, 2, H, T, D] float32, block i at position i * T); decode straight into a
    cache-shaped float32 tensor. Decode
    per wall second (best of ``reps``) and per second of the thread's CPU time (what the loop
    costs when other processes share the core)."""
    import torch
    from hostagent.inference.connectors.hf import codec_for
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        n = block_kv.shape[0]
        L, _, H, T, D = block_kv.shape[1:]
        dest = torch.empty(L, 2, H, n * T, D)
        for c in codecs:
            codec = codec_for(layout, c)
            coded = [codec.encode(block_kv[i], i * T) for i in range(n)]
            codec.decode_into(coded[0], dest, 0)                 # compiles the kernel
            t0 = time.perf_counter()
            for _ in range(reps):
                coded = [codec.encode(block_kv[i], i * T) for i in range(n)]
            enc = (time.perf_counter() - t0) / reps
            best = cpu = math.inf
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.thread_time()
                for i in range(n):
                    codec.decode_into(coded[i], dest, i * T)
                best = min(best, time.perf_counter() - t0)
                cpu = min(cpu, time.thread_time() - c0)
            gb = 2 * codec.values * n / 1e9
            out[c] = {"ratio": round(codec.ratio, 4), "block_bytes": codec.nbytes,
                      "encode_gbytes_per_s": round(gb / enc, 3),
                      "decode_gbytes_per_s": round(gb / best, 3),
                      "decode_gbytes_per_cpu_s": round(gb / max(cpu, 1e-9), 3)}
        return out
    finally:
        torch.set_num_threads(threads)


def entropy(layout, block_kv) -> dict:
    """Empirical entropy of the int8, int4 and int4h codes (bits a symbol): what an entropy
    coder (CacheGen's last stage) could take off, before its own decode cost."""
    import numpy as np
    from hostagent.inference.connectors.hf import codec_for
    out = {}
    for c in ("int8", "int4", "int4h"):
        codec = codec_for(layout, c)
        codes = np.concatenate([np.frombuffer(codec.encode(b), np.uint8)[:codec.code_bytes]
                                for b in block_kv])
        syms = np.concatenate([codes & 15, codes >> 4]) if c != "int8" else codes
        p = np.bincount(syms, minlength=256).astype(float)
        p = p[p > 0] / p.sum()
        bits = float(-(p * np.log2(p)).sum())
        out[c] = {"bits_per_symbol": round(bits, 3),
                  "ratio_if_entropy_coded": round(2 * codec.values / (
                      codec.nbytes - codec.code_bytes + bits / (8 if c == "int8" else 4)
                      * codec.code_bytes), 3)}
    return out


def hit_ratios(trace_path: str, ratios: dict[str, float], fraction: float = 0.02) -> dict:
    """switchd's ``prefix`` policy on the trace with the switch bytes of ``fraction`` of the
    distinct blocks at 16 bits, holding ``ratio`` times as many blocks of each codec."""
    from testbed.sim.evaluate import evaluate
    from testbed.sim.trace import load_trace
    trace = load_trace(trace_path)
    base = fraction * trace.distinct_blocks
    out = {}
    for c, r in ratios.items():
        res = evaluate(trace, max(1, int(base * r)), ["prefix"])
        out[c] = round(res["hit_ratio"]["prefix"], 4)
    return out


# ---- the long prefix through the switch -----------------------------------------------------
def _layout(dtype: str, shape):
    import torch
    from hostagent.inference.connectors.hf import BlockLayout
    L, H, T, D = shape
    return BlockLayout(L, H, D, getattr(torch, dtype), T)


def node_put(pools, chunk_size, codec, dtype, shape, kv_path, model_id) -> dict:
    """In an inference node: put the blocks of ``kv_path`` (a saved [n, L, 2, H, T, D] tensor)
    coded with ``codec`` (bf16 blocks for ``none``); their keys."""
    import torch
    from hostagent.inference.client import KVClient
    from hostagent.common.hashing import block_hashes
    from hostagent.inference.connectors.hf import codec_for
    layout = _layout(dtype, shape)
    kv = torch.load(kv_path)
    co = codec_for(layout, codec)
    extra = model_id.encode() + b"|" + layout.tag() + co.tag()
    keys = block_hashes(list(range(kv.shape[0] * layout.block_tokens)), layout.block_tokens,
                        extra=extra)

    async def go():
        async with KVClient(pools, chunk_size, 64, 60) as client:
            for i, (k, b) in enumerate(zip(keys, kv)):        # block i at position i * T
                await client.put_block(NS, k, co.encode(b.to(layout.dtype),
                                                        i * layout.block_tokens))
    asyncio.run(go())
    return {"keys": [k.hex() for k in keys], "block_bytes": co.nbytes}


def node_load(pools, chunk_size, codec, dtype, shape, nblocks, model_id, reps) -> dict:
    """In an inference node: load the prefix with the fetch engine and decode it, ``reps``
    times (the first warms the switch); seconds of each."""
    from hostagent.inference.fetch import AsyncFetchClient, open_client
    from hostagent.inference.connectors.hf import KVConnector
    layout = _layout(dtype, shape)

    async def go():
        from hostagent.inference.connectors.hf import codec_for
        size = codec_for(layout, codec).nbytes
        async with open_client(pools=pools, chunk_size=chunk_size, window=64, deadline=60,
                               arena_bytes=(nblocks + 8) * size) as client:
            conn = KVConnector(client, NS, layout, model_id, concurrency=4, kv_codec=codec)
            tokens = list(range(nblocks * layout.block_tokens + 1))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                loaded = await conn.load(tokens)
                times.append({"seconds": time.perf_counter() - t0,
                              "fetch": loaded.stats.seconds, "decode": loaded.rebuild_seconds,
                              "blocks": loaded.blocks, "from_switch": loaded.stats.from_switch,
                              "chunks": loaded.stats.chunks})
                del loaded
            path = "xdp" if isinstance(client, AsyncFetchClient) else "asyncio"
            return {"runs": times, "fetch_path": path}
    return asyncio.run(go())


def load_times(block_kv, codecs, nblocks: int, chunk_size: int, prefix: str, rounds: int = 3,
               log=print) -> dict:
    """Per codec, median seconds to load ``nblocks`` blocks from the switch and decode them
    (``none``: bf16 blocks into a bf16 cache). Every codec's blocks are put in the pool first;
    then ``rounds`` rounds each load every codec once (the order rotating from round to round,
    the switch refilled with that codec's blocks, one warm-up load, two timed), so a busy
    moment of a shared machine falls on all codecs alike; ``load_vs_raw_paired`` is the median
    of each round's ratio to ``none``'s."""
    import statistics
    import tempfile
    import torch
    from testbed.lab import Lab
    L, _, H, T, D = block_kv.shape[1:]
    tiled = block_kv[torch.arange(nblocks) % block_kv.shape[0]].contiguous()
    runs: dict = {c: [] for c in codecs}
    per_round: dict = {c: [] for c in codecs}
    with tempfile.TemporaryDirectory(prefix="kvcompress-") as tmp, \
            Lab(prefix, hosts=2, pools=1, chunk_size=chunk_size, pool_capacity="2GiB") as lab:
        path = os.path.join(tmp, "kv.pt")
        torch.save(tiled, path)
        os.chmod(tmp, 0o755)
        args, keys, sizes = {}, {}, {}
        for c in codecs:
            dtype = "bfloat16" if c == "none" else "float32"
            args[c] = (lab.pool_addrs, chunk_size, c, dtype, (L, H, T, D))
            put = lab.task("h1", f"{__name__}:node_put", *args[c], path, "bench-compress")
            keys[c], sizes[c] = put["keys"], put["block_bytes"]
        for r in range(rounds):
            for c in codecs[r % len(codecs):] + codecs[:r % len(codecs)]:
                lab.switchd("cache", "flush")       # the last codec's blocks make room
                for key in keys[c]:
                    lab.switchd("cache", "admit", "--ns", str(NS), "--key", key)
                got = lab.task("h2", f"{__name__}:node_load", *args[c], nblocks,
                               "bench-compress", 3)
                timed = got["runs"][1:]             # the first run fills the switch
                runs[c] += [r_ | {"fetch_path": got["fetch_path"]} for r_ in timed]
                per_round[c].append(statistics.median(x["seconds"] for x in timed))
                log(f"  round {r + 1}/{rounds} {c}: {per_round[c][-1]:.3f} s")
    out = {}
    for c in codecs:
        rs = runs[c]
        out[c] = {"load_s": round(statistics.median(r["seconds"] for r in rs), 4),
                  "fetch_s": round(statistics.median(r["fetch"] for r in rs), 4),
                  "decode_s": round(statistics.median(r["decode"] for r in rs), 4),
                  "from_switch": rs[-1]["from_switch"], "chunks": rs[-1]["chunks"],
                  "blocks": rs[-1]["blocks"], "block_bytes": sizes[c],
                  "fetch_path": rs[-1]["fetch_path"], "rounds_s": [round(x, 4) for x in
                                                                   per_round[c]]}
        if "none" in per_round:
            out[c]["load_vs_raw_paired"] = round(statistics.median(
                x / y for x, y in zip(per_round[c], per_round["none"])), 3)
        log(f"  {c}: {out[c]}")
    return out


# ---- the run --------------------------------------------------------------------------------
def run_compress(codecs=("none", "int8", "fp8", "int4", "int4h"), prompts: int = 20,
                 prefix_tokens: int = 256, cont_tokens: int = 64, suffix_tokens: int = 8,
                 new_tokens: int = 64, load_blocks: int = 32, chunk_size: int = 3072,
                 trace_path: str | None = None, json_path: str | None = None,
                 plot_path: str | None = None, parts=("quality", "speed", "load", "policy"),
                 update: bool = False, readers: int = 8, pool_gbit: float = 1.0,
                 log=print) -> dict:
    """Measure every codec; the result (see the module doc), written to ``json_path`` after
    each part. ``update``: keep what ``json_path`` already holds and update it (a run split
    into parts)."""
    import torch
    from hostagent.inference.connectors.hf import (BlockLayout, DynamicCache,
                                                   cache_block_tensor, codec_for)
    from testbed.demos.realmodel import load
    from testbed.results import measured, write_json
    stamp = measured()                   # before the first part's save makes the tree dirty
    codecs = list(dict.fromkeys(["none", *codecs]))
    t0 = time.monotonic()
    torch.set_num_threads(1)             # a shared machine: OpenMP threads spinning cost more
    log(f"bench compress: parts {', '.join(parts)}; loading the model ...")
    model, tok, mid = load()
    layout = BlockLayout.of(model.config, torch.float32, BLOCK_TOKENS)
    from .compress_pca import ensure_calibration, pca_entropy, uses_pca
    if uses_pca(codecs):
        ensure_calibration(model, tok, log)
    for c in codecs:
        codec_for(layout, c)             # an unknown name fails here, before any work
    if prefix_tokens % BLOCK_TOKENS:
        raise ValueError(f"the prefix must be whole {BLOCK_TOKENS}-token blocks")
    windows_ = windows(tok, prefix_tokens + max(cont_tokens + 1, suffix_tokens), prompts)
    log(f"{mid}: {len(windows_)} prompts of {prefix_tokens} prefix tokens, codecs "
        f"{', '.join(codecs)}")
    result = {"model": mid, "config": {
        "prompts": [n for n, _ in windows_], "block_tokens": BLOCK_TOKENS,
        "prefix_tokens": prefix_tokens, "cont_tokens": cont_tokens,
        "suffix_tokens": suffix_tokens, "new_tokens": new_tokens, "load_blocks": load_blocks,
        "chunk_size": chunk_size, "trace": trace_path, "parts": list(parts)}}
    per = {c: {"codec": c, "spec": codec_for(layout, c).tag().decode().strip() or "none",
               "ratio": 1.0 if c == "none" else round(codec_for(layout, c).ratio, 4)}
           for c in codecs}
    final: dict = {}

    def save() -> None:
        """Write the result; with ``update``, merged into what the file holds now (another
        part may have written it meanwhile): this run's fields win."""
        rows, out = {c: dict(per[c]) for c in codecs}, dict(result)
        if update and json_path and os.path.exists(json_path):
            import json
            with open(json_path) as f:
                old = json.load(f)
            for r in old.get("results", []):
                rows[r["codec"]] = r | rows.get(r["codec"], {})
            out = old | result | {"config": old.get("config", {}) | result["config"]}
            out["config"]["parts"] = sorted(set(old.get("config", {}).get("parts", []))
                                            | set(parts))
        out["results"] = list(rows.values())
        out["seconds"] = round(time.monotonic() - t0, 1)
        out["loadavg"] = os.getloadavg()
        out["measured"] = stamp
        write_json(json_path, out)
        final.clear()
        final.update(out)
    # real KV for the speed and load parts: the first 4 blocks of the longest text
    block_kv = None
    if {"speed", "load", "loaded"} & set(parts):
        from hostagent.inference.connectors.hf import prefill
        cache = DynamicCache(config=model.config)
        prefill(model, windows(tok, 4 * BLOCK_TOKENS, 1)[0][1], cache, BLOCK_TOKENS)
        block_kv = cache_block_tensor(cache, layout)
    if "quality" in parts:
        log("bench compress: quality ...")
        q = quality(model, layout, codecs, windows_, prefix_tokens, cont_tokens, suffix_tokens,
                    new_tokens, log)
        for c in codecs:
            per[c].update(q[c])
        save()
    if "speed" in parts:
        log("bench compress: speed ...")
        for c, s in speed(layout, codecs, block_kv).items():
            per[c].update({k: v for k, v in s.items() if k != "ratio"})
        result["entropy"] = entropy(layout, block_kv)
        for c in codecs:
            if uses_pca([c]):
                result["entropy"][c] = pca_entropy(codec_for(layout, c), block_kv)
        save()
    if "load" in parts:
        log("bench compress: load from the switch ...")
        prefix = f"cmp{os.getpid() % 10000}"
        lt = load_times(block_kv, codecs, load_blocks, chunk_size, prefix, log=log)
        for c in codecs:
            per[c].update({"load_s": lt[c]["load_s"], "load_s_raw": lt["none"]["load_s"],
                           "load_vs_raw": round(lt[c]["load_s"] / lt["none"]["load_s"], 3),
                           "load_vs_raw_paired": lt[c]["load_vs_raw_paired"],
                           "load": lt[c]})
        save()
    if "loaded" in parts:
        from .compress_loaded import loaded_ttft
        log(f"bench compress: {readers} readers at once over a {pool_gbit:g} Gbit/s pool link ...")
        result["loaded"] = loaded_ttft(block_kv, codecs, load_blocks, chunk_size,
                                       f"cld{os.getpid() % 10000}", readers, pool_gbit, log=log)
        for c, row in result["loaded"]["codecs"].items():
            per[c]["loaded_ttft_p50_vs_raw"] = row.get("ttft_p50_vs_raw")
        save()
    if "policy" in parts and trace_path:
        # the switch's bytes are those of 2 % of the distinct blocks at 16 bits
        log("bench compress: policy hit ratios ...")
        hr = hit_ratios(trace_path, {c: per[c]["ratio"] for c in codecs})
        for c in codecs:
            per[c]["hit_ratio_at_2pct_bytes"] = hr[c]
    save()
    if plot_path:
        plot(final, plot_path)
    return final


def plot(result: dict, path: str) -> None:
    """Ratio, perplexity delta, agreement and load time per codec."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["results"]
    names = [r["codec"] for r in rows]
    panels = [("ratio", "ratio vs 16-bit KV"), ("ppl_delta_pct", "perplexity delta (%)"),
              ("token_agreement", "greedy agreement (64 tokens)"),
              ("decode_gbytes_per_s", "decode GB/s (16-bit KV, 1 core)"),
              ("load_vs_raw", "load from switch / raw bf16"),
              ("hit_ratio_at_2pct_bytes", "hit ratio, 2 % switch bytes")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        vals = [r.get(key) for r in rows]
        ax.bar(names, [v if v is not None else 0 for v in vals], color="tab:blue")
        for i, v in enumerate(vals):
            if v is not None:
                ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"KV codecs on {result['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
