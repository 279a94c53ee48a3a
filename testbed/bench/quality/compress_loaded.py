"""`testbed bench compress --parts loaded`: the run where a KV codec matters. ``readers``
inference nodes ask for the same long prefix at the same instant from one pool node over its one
shaped link (``pool_gbit``, default 1 Gbit/s; the readers' own links unshaped; a plain bridge,
no switch cache, so every reader's copy crosses the pool link), and each computes its first token
on the loaded cache: TTFT from the common start, per codec, against raw 16-bit blocks (``none``:
bf16 blocks into a bf16 cache, cast to the float32 the model runs in; a codec decodes straight
into float32).

Each reader (a task in its node) loads SmolLM2 once, then for every start line of the run (one
per codec and round, the codecs' order rotating from round to round so a busy moment falls on
all alike) waits for the common start, loads the prefix with the XDP fetch engine through the
connector (blocks decoded as they arrive) and runs the model on the prompt's last token.
JSON (under ``loaded`` in compress.json): per codec the TTFT p50/p99, load p50, bytes a reader
moved, and ``ttft_p50_vs_raw``; the configuration; every reader's records.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import time

READERS = 8
POOL_GBIT = 1.0
ROUNDS = 3


def schedule(codecs: list[str], rounds: int) -> list[str]:
    """The codec of each start line: every codec once a round, the order rotating."""
    return [c for r in range(rounds) for c in codecs[r % len(codecs):] + codecs[:r % len(codecs)]]


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(codecs: list[str], lines: list[str], records: list[list[dict]]) -> dict:
    """Per codec, from every reader's records (one per start line, in ``lines``' order)."""
    out = {}
    for c in codecs:
        recs = [r for rs in records for code, r in zip(lines, rs) if code == c]
        ttft = [r["ttft_s"] for r in recs]
        out[c] = {"ttft_p50_s": round(statistics.median(ttft), 4),
                  "ttft_p99_s": round(_percentile(ttft, 99), 4),
                  "load_p50_s": round(statistics.median(r["load_s"] for r in recs), 4),
                  "reader_bytes": recs[0]["bytes"], "samples": len(recs)}
    if "none" in out:
        for c in codecs:
            out[c]["ttft_p50_vs_raw"] = round(out[c]["ttft_p50_s"] /
                                              out["none"]["ttft_p50_s"], 3)
    return out


def reader(pools, chunk_size, shape, nblocks, model_id, line_codecs, line_paths) -> list[dict]:
    """Task in a reader node: for each start line, wait for the common start, load the prefix
    with the line's codec and compute the first token; a record a line."""
    import torch
    from hostagent.inference.codec import warm_up
    from hostagent.inference.connectors.hf import KVConnector, codec_for
    from hostagent.inference.fetch import open_client
    from testbed.demos.realmodel import load
    from testbed.lab.tasks import StartLine
    from .compress import NS, _layout
    torch.set_num_threads(1)
    model, _, _ = load()
    tokens = list(range(nblocks * shape[2] + 1))
    layouts = {c: _layout("bfloat16" if c == "none" else "float32", shape)
               for c in set(line_codecs)}
    for c in set(line_codecs):
        warm_up(c)
    size = max(codec_for(layouts[c], c).nbytes for c in layouts)

    async def go():
        out = []
        async with open_client(pools=pools, chunk_size=chunk_size, window=64, deadline=60,
                               arena_bytes=(nblocks + 8) * size) as client:
            conns = {c: KVConnector(client, NS, layouts[c], model_id, model.config,
                                    concurrency=4, kv_codec=c) for c in layouts}
            for c, path in zip(line_codecs, line_paths):
                at = StartLine.wait(path)
                await asyncio.sleep(max(0.0, at - time.time()))
                loaded = await conns[c].load(tokens)
                load_s = time.time() - at
                cache = loaded.cache
                if c == "none":                            # the model runs in float32
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys.float(), layer.values.float()
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache,
                                   use_cache=True).logits
                first = int(logits[0, -1].argmax())
                out.append({"codec": c, "ttft_s": time.time() - at, "load_s": load_s,
                            "blocks": loaded.blocks, "bytes": loaded.stats.bytes,
                            "token": first})
                del loaded, cache
        return out
    return asyncio.run(go())


def loaded_ttft(block_kv, codecs, nblocks: int, chunk_size: int, prefix: str,
                readers: int = READERS, pool_gbit: float = POOL_GBIT, rounds: int = ROUNDS,
                log=print) -> dict:
    """The loaded run (module docstring) on a testbed of its own; its JSON."""
    import tempfile
    import torch
    from testbed.lab import Lab
    from testbed.lab.tasks import StartLine, gather
    L, _, H, T, D = block_kv.shape[1:]
    codecs = list(dict.fromkeys(["none", *codecs]))
    tiled = block_kv[torch.arange(nblocks) % block_kv.shape[0]].contiguous()
    lines = schedule(codecs, rounds)
    with tempfile.TemporaryDirectory(prefix="kvloaded-") as tmp, \
            Lab(prefix, hosts=readers, pools=1, chunk_size=chunk_size, switch=False,
                pool_capacity="2GiB", pool_link_gbit=pool_gbit) as lab:
        os.chmod(tmp, 0o755)
        path = os.path.join(tmp, "kv.pt")
        torch.save(tiled, path)
        for c in codecs:
            dtype = "bfloat16" if c == "none" else "float32"
            lab.task("h1", "testbed.bench.quality.compress:node_put", lab.pool_addrs,
                     chunk_size, c, dtype, (L, H, T, D), path, "bench-compress")
        starts = [StartLine(tmp, readers) for _ in lines]
        tasks = [lab.start_task(f"h{i + 1}", "testbed.bench.quality.compress_loaded:reader",
                                lab.pool_addrs, chunk_size, (L, H, T, D), nblocks,
                                "bench-compress", lines, [s.path for s in starts])
                 for i in range(readers)]
        try:
            for k, (c, s) in enumerate(zip(lines, starts)):
                s.ready(tasks, timeout=600 if k == 0 else 300)
                log(f"  loaded: line {k + 1}/{len(lines)}, {readers} readers, codec {c}")
                s.go(tasks)
            records = gather(tasks, timeout=600)
        finally:
            for t in tasks:
                if t.proc.poll() is None:
                    t.proc.kill()
    out = {"readers": readers, "pool_link_gbit": pool_gbit, "blocks": nblocks,
           "prefix_tokens": nblocks * T, "rounds": rounds, "switch": False,
           "codecs": summarize(codecs, lines, records), "lines": lines, "records": records}
    for c, row in out["codecs"].items():
        log(f"  loaded {c}: {row}")
    return out
