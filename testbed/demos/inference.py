"""`testbed demo-inference`: a real transformer's prefix KV cache moved through the switch.

Three inference nodes run the same decoder on the CPU (nothing is downloaded).
For each prompt size, node A (h1) prefills a long shared prompt plus its own question and puts
the prompt's KV blocks on the pool node; the orchestrator admits those blocks to the switch; node
B (h2) asks the same prompt with another question, loads the longest available prefix (every
chunk a miss: the pool answers and the switch learns) and generates; node C (h3) does the same
and is answered by the switch. B and C each also recompute the whole prompt and report
time-to-first-token (TTFT) both ways, greedy tokens (must be identical), KV identity (the fetched
blocks must equal the recomputed ones bit for bit) and the bytes moved per cached token.

The default model is the real SmolLM2-135M-Instruct (``testbed.demos.realmodel``, installed by
``make setup``) on real text (Debian's license texts): with every KV codec in ``codecs``
(``hostagent.inference.codec``) the same prompts' blocks move again, coded (their own keys); codec
none must give greedy tokens and KV identical to recompute, the others report their greedy agreement
with it. The seeded-random models stay for fast runs and tests: "llama3-mini" is a scaled-down
Llama-3: grouped-query attention with 16 query heads and 2 KV heads, a 3.5x SwiGLU MLP, fp32, 8
layers of width 1024 (~0.17 B parameters, 0.35 GFLOP per token outside attention), so 8 KiB of KV
per token: ~42 kFLOP of prefill per KV byte. That is below Llama-3-8B's ratio (~107 kFLOP/B in bf16:
14 GFLOP and 128 KiB per token) and a tenth of Llama-3-70B's (~420 kFLOP/B), so the fetch path gets
no help from the model choice. Prefill runs in 512-token chunks (one block each) on both paths. fp32
by default: this machine's CPU has AVX2 and no AMX, and torch's CPU build multiplies bf16 about 5x
slower than fp32 here (``--dtype bfloat16`` still runs).

The orchestrator runs here; the model runs inside the node namespaces (tasks ``node_a`` and
``node_b``). B and C fetch through the XDP fetch engine (``hostagent.inference.fetch``; the asyncio
client where it cannot run) and rebuild the cache straight from its zero-copy blocks; A puts with
the asyncio client.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time


from ..lab import Lab
from ..results import write_json

NS = 8
SEED = 0
BLOCK_TOKENS = 512                # 2 MiB blocks of llama3-mini, like 16 tokens of Llama-3-8B
QUESTION_TOKENS = 64
MODELS = {
    "llama3-mini": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                        head_dim=64, max_position_embeddings=32768, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=32768, rope_theta=500000.0),
}
REAL = "smollm2"                  # the real trained model (testbed.demos.realmodel)
MODEL_CHOICES = [REAL, *MODELS]


def real_prompt(tok, size: int, node: str, offset: int = 0) -> list[int]:
    """Real English text: a ``size``-token shared prefix (Debian's license texts, in order, from
    token ``offset``: prompts of different sizes share no block), then a per-node question from
    another place of the same texts."""
    from .realmodel import texts
    ids = [t for text in texts().values() for t in tok(text)["input_ids"]]
    start = offset + size + 97 * (1 + sum(map(ord, node)) % 50)
    if start + QUESTION_TOKENS > len(ids):
        raise ValueError(f"the license texts have {len(ids):,} tokens: too few for prompts of "
                         f"{offset + size:,}")
    return ids[offset:offset + size] + ids[start:start + QUESTION_TOKENS]


def prompt(size: int, node: str) -> list[int]:
    """A shared ``size``-token prefix (the same on every node) and a per-node question."""
    shared, own = random.Random(f"shared-{size}"), random.Random(f"question-{node}-{size}")
    return ([shared.randrange(1, 32000) for _ in range(size)] +
            [own.randrange(1, 32000) for _ in range(QUESTION_TOKENS)])


# ---- inside a node -----------------------------------------------------------------------------
class _Node:
    """The model of one inference node (the same seeded weights on every node) and its layout."""

    def __init__(self, model: str, dtype: str, block_tokens: int):
        # first: keeps transformers offline
        from hostagent.inference.connectors.hf import BlockLayout
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        self.dtype = getattr(torch, dtype)
        self.tok = None
        if model == REAL:
            from .realmodel import load
            self.model, self.tok, self.model_id = load(dtype)
            self.config = self.model.config
        else:
            torch.manual_seed(SEED)
            self.config = LlamaConfig(**MODELS[model], attn_implementation="sdpa")
            self.model = LlamaForCausalLM(self.config).to(self.dtype).eval()
            self.model_id = f"{model}/seed{SEED}"
        self.layout = BlockLayout.of(self.config, self.dtype, block_tokens)
        self.vocab = self.config.vocab_size
        self.params = sum(p.numel() for p in self.model.parameters())

    def tokens(self, size: int, node: str, sizes) -> list[int]:
        """The prompt of ``size`` shared tokens asked by ``node``; the demo's other ``sizes``
        place real text so that no two prompt sizes share a block."""
        if self.tok is not None:
            return real_prompt(self.tok, size, node, sum(s for s in sizes if s < size))
        return [t % self.vocab for t in prompt(size, node)]

    def recompute(self, tokens: list[int]):
        from transformers import DynamicCache
        from hostagent.inference.connectors.hf import prefill
        cache = DynamicCache(config=self.config)
        start = time.perf_counter()
        logits = prefill(self.model, tokens, cache, self.layout.block_tokens)
        return logits, cache, time.perf_counter() - start

    def warm_up(self) -> None:
        """One block and a question's worth: the shapes timed later are not run cold."""
        self.recompute(list(range(1, self.layout.block_tokens + QUESTION_TOKENS + 1)))

    @contextlib.asynccontextmanager
    async def connector(self, client_args: dict, concurrency: int, fetch_blocks: int = 0):
        """Warmed up, a KV connector for this node's model over a client of its own: with
        ``fetch_blocks``, the XDP fetch engine (an arena for that many blocks; the asyncio
        client where the engine cannot run), else the asyncio client (puts)."""
        from hostagent.inference.client import KVClient
        from hostagent.inference.fetch import open_client
        from hostagent.inference.connectors.hf import KVConnector
        self.warm_up()
        opened = (open_client(**client_args, arena_bytes=fetch_blocks * self.layout.block_bytes)
                  if fetch_blocks else KVClient(**client_args))
        async with opened as client:
            yield lambda codec="none": KVConnector(client, NS, self.layout, self.model_id,
                                                   self.config, concurrency, kv_codec=codec)

    def info(self) -> dict:
        return {"model": self.model_id, "params": self.params,
                "dtype": str(self.dtype).removeprefix("torch."),
                "kv_bytes_per_token": self.layout.token_bytes,
                "block_tokens": self.layout.block_tokens,
                "block_bytes": self.layout.block_bytes}


def _link_bytes() -> tuple[int, int]:
    """This namespace's eth0 counters (rx, tx): the node's own view of what crossed its link."""
    def read(d):
        with open(f"/sys/class/net/eth0/statistics/{d}_bytes") as f:
            return int(f.read())
    return read("rx"), read("tx")


async def _node_a(node: _Node, name: str, sizes, client_args: dict, concurrency: int,
                  codecs=("none",)) -> dict:
    out = []
    async with node.connector(client_args, concurrency) as connector:
        for size in sizes:
            tokens = node.tokens(size, name, sizes)
            _, cache, seconds = node.recompute(tokens)
            for codec in codecs:
                conn = connector(codec)
                put = await conn.save(tokens, cache)
                out.append({"size": size, "codec": codec, "ttft_recompute": round(seconds, 4),
                            "keys": [k.hex() for k in conn.keys(tokens)], "put": put.as_dict()})
    return {"node": name, **node.info(), "sizes": out}


async def _node_b(node: _Node, name: str, sizes, client_args: dict, concurrency: int,
                  new_tokens: int, codecs=("none",)) -> dict:
    from hostagent.inference.client import KVClient
    from hostagent.inference.connectors.hf import greedy, prefill
    import torch
    out = []
    # the largest prefix's blocks are held together (the cache is built from them in place)
    blocks = max(sizes) // node.layout.block_tokens + concurrency + 1
    async with node.connector(client_args, concurrency, fetch_blocks=blocks) as connector:
        for size in sizes:
            tokens = node.tokens(size, name, sizes)
            logits_r, cache_r, ttft_recompute = node.recompute(tokens)
            via_recompute = greedy(node.model, logits_r, cache_r, new_tokens)
            for codec in codecs:
                conn = connector(codec)
                rx0, tx0 = _link_bytes()
                start = time.perf_counter()
                loaded = await conn.load(tokens)
                fetched = time.perf_counter()
                rx1, tx1 = _link_bytes()
                logits = prefill(node.model, tokens, loaded.cache, node.layout.block_tokens)
                ttft_fetch = time.perf_counter() - start
                n = loaded.tokens
                kv_identical = n > 0 and all(
                    torch.equal(layer.keys[..., :n, :], ref.keys[..., :n, :]) and
                    torch.equal(layer.values[..., :n, :], ref.values[..., :n, :])
                    for layer, ref in zip(loaded.cache.layers, cache_r.layers))
                kv_err = max((float((layer.keys[..., :n, :] - ref.keys[..., :n, :]).abs().max())
                              for layer, ref in zip(loaded.cache.layers, cache_r.layers)),
                             default=0.0)
                logits_equal = bool(torch.equal(logits, logits_r))
                via_fetch = greedy(node.model, logits, loaded.cache, new_tokens)
                s = loaded.stats
                out.append({
                    "size": size, "codec": codec, "prompt_tokens": len(tokens),
                    "cached_tokens": loaded.tokens, "blocks": loaded.blocks,
                    "probed": loaded.probed, "missing_at": loaded.missing_at,
                    "ttft_fetch": round(ttft_fetch, 4), "ttft_recompute": round(ttft_recompute, 4),
                    "fetch_seconds": round(fetched - start, 4),
                    "rebuild_seconds": round(loaded.rebuild_seconds, 4),
                    "suffix_prefill_seconds": round(ttft_fetch - (fetched - start), 4),
                    "chunks": s.chunks, "from_switch": s.from_switch, "replicas": s.replicas,
                    "from_pool": s.from_pool, "retransmits": s.retransmits,
                    "payload_bytes": s.bytes, "rx_bytes": rx1 - rx0, "tx_bytes": tx1 - tx0,
                    "tokens_equal": via_fetch == via_recompute,
                    "agreement": round(sum(a == b for a, b in zip(via_fetch, via_recompute))
                                       / new_tokens, 4),
                    "logits_equal": logits_equal, "kv_identical": kv_identical,
                    "kv_max_abs_error": kv_err, "tokens": via_fetch,
                    "text": node.tok.decode(via_fetch) if node.tok is not None else None})
                del loaded
            path = "asyncio" if isinstance(conn.client, KVClient) else "xdp"
    return {"node": name, **node.info(), "fetch_path": path, "sizes": out}


def _setup(pools, chunk_size, window, model, dtype, block_tokens):
    client_args = dict(pools=list(pools), chunk_size=chunk_size, window=window, deadline=60)
    return _Node(model, dtype, block_tokens), client_args


def node_a(name: str, pools: list[str], chunk_size: int, window: int, concurrency: int,
           sizes: list[int], model: str, dtype: str, block_tokens: int,
           codecs=("none",)) -> dict:
    """Task in the first inference node: prefill every prompt, put its blocks (per codec)."""
    node, client_args = _setup(pools, chunk_size, window, model, dtype, block_tokens)
    return asyncio.run(_node_a(node, name, sizes, client_args, concurrency, codecs))


def node_b(name: str, pools: list[str], chunk_size: int, window: int, concurrency: int,
           sizes: list[int], model: str, dtype: str, block_tokens: int,
           new_tokens: int, codecs=("none",)) -> dict:
    """Task in a later inference node: load each prompt's prefix (per codec), generate,
    compare with its own recompute."""
    node, client_args = _setup(pools, chunk_size, window, model, dtype, block_tokens)
    return asyncio.run(_node_b(node, name, sizes, client_args, concurrency, new_tokens,
                               codecs))


# ---- the orchestrator ----------------------------------------------------------------------------
def switch_entries(model: str, dtype: str, block_tokens: int, sizes, codecs,
                   chunk_size: int) -> int:
    """Switch cache entries for every chunk the demo puts (each prompt's blocks, once per
    codec) and a quarter more: h3 is served by the switch alone only if it holds them all
    (SmolLM2's fp32 KV is 46 KB a token: its 4k-token prompt alone is 61,440 chunks)."""
    import torch
    from transformers import AutoConfig, LlamaConfig
    from hostagent.inference.block_layout import BlockLayout
    from hostagent.inference.codec import make
    from .realmodel import model_dir
    config = (AutoConfig.from_pretrained(str(model_dir())) if model == REAL
              else LlamaConfig(**MODELS[model]))
    lay = BlockLayout.of(config, getattr(torch, dtype), block_tokens)
    blocks = sum(size // block_tokens for size in sizes)
    chunks = sum(blocks * -(-make(c, lay.layers, lay.kv_heads, block_tokens, lay.head_dim,
                                  lay.dtype).nbytes // chunk_size) for c in codecs)
    return max(65536, chunks + chunks // 4)


def run_inference_demo(sizes=(1024, 4096, 16384), chunk_size: int = 3072, window: int = 64,
                       concurrency: int = 4, new_tokens: int = 16, model: str = "llama3-mini",
                       dtype: str = "float32", block_tokens: int = BLOCK_TOKENS,
                       prefix: str = "inf", json_path: str | None = None,
                       must_win_from: int = 4096, codecs=("none",)) -> bool:
    """Run the demo; True when every check held (fetch must beat recompute at prompt sizes of
    ``must_win_from`` tokens and above; with codec none, tokens and KV identical to
    recompute). Each codec in ``codecs`` moves the same prompts' blocks coded its way (its own
    keys); its greedy agreement with recompute is reported."""
    from rich.console import Console
    console = Console()
    codecs = list(dict.fromkeys(["none", *codecs]))
    sizes = sorted(sizes)
    if any(s % block_tokens for s in sizes):
        raise ValueError(f"prompt sizes must be multiples of {block_tokens} tokens")
    entries = switch_entries(model, dtype, block_tokens, sizes, codecs, chunk_size)
    with Lab(prefix, hosts=3, pools=1, chunk_size=chunk_size, cache_entries=entries) as lab:
        args = [lab.pool_addrs, chunk_size, window, concurrency, sizes, model, dtype,
                block_tokens]
        console.print(f"[bold]{model}[/] ({dtype}) on h1, h2, h3; prompt sizes {sizes} "
                      f"+ {QUESTION_TOKENS}-token questions; {block_tokens}-token blocks, "
                      f"{chunk_size}-byte chunks, {concurrency} blocks in flight")
        a = lab.task("h1", f"{__name__}:node_a", "h1", *args, codecs)
        console.print(f"h1 prefilled and put {sum(len(s['keys']) for s in a['sizes'])} blocks "
                      f"({a['block_bytes']:,} bytes each, {a['kv_bytes_per_token']:,} B/token, "
                      f"{a['params'] / 1e6:.0f} M parameters)")
        for s in a["sizes"]:
            for key in s["keys"]:
                lab.switchd("cache", "admit", "--ns", str(NS), "--key", key)
        console.print("admitted them to the switch (learned as pool replies pass)")
        b = lab.task("h2", f"{__name__}:node_b", "h2", *args, new_tokens, codecs)
        c = lab.task("h3", f"{__name__}:node_b", "h3", *args, new_tokens, codecs)
        console.print(f"h2 and h3 fetched with the {b['fetch_path']} / {c['fetch_path']} client")
        counters = lab.stats()
    result = {"model": {k: v for k, v in a.items() if k != "sizes"},
              "config": {"chunk_size": chunk_size, "window": window, "concurrency": concurrency,
                         "sizes": sizes, "new_tokens": new_tokens, "codecs": codecs},
              "h1": a["sizes"], "h2": b["sizes"], "h3": c["sizes"], "switch": counters,
              "fetch_path": {"h2": b["fetch_path"], "h3": c["fetch_path"]}}
    result["checks"] = report(console, result, must_win_from)
    write_json(json_path, result)
    ok = all(result["checks"].values())
    speedups = ", ".join(f"{s['size'] // 1024}k {s['ttft_recompute'] / s['ttft_fetch']:.1f}x"
                         for s in c["sizes"] if s["codec"] == "none")
    rows = b["sizes"] + c["sizes"]
    agree = {k: round(sum(r["agreement"] for r in rows if r["codec"] == k)
                      / sum(r["codec"] == k for r in rows), 3) for k in codecs if k != "none"}
    result["agreement"] = agree
    write_json(json_path, result)
    print(f"demo-inference: {'OK' if ok else 'FAILED'} - TTFT speed-up with the prefix from the "
          f"switch: {speedups}; greedy tokens identical to recompute "
          f"{result['checks']['greedy tokens identical to recompute']}"
          + "".join(f"; {k} agreement {v:.3f}" for k, v in agree.items()))
    return ok


def report(console, result: dict, must_win_from: int) -> dict[str, bool]:
    """Print the demo's table and checks; return the checks."""
    from rich.table import Table
    model, a, counters = result["model"], result["h1"], result["switch"]
    a = [s for s in a if s.get("codec", "none") == "none"]
    table = Table(title=f"time to first token (s), {model['model']} {model['dtype']}, this CPU")
    for col in ("tokens", "node", "codec", "KV from", "fetch", "TTFT fetch", "TTFT recomp.",
                "gain", "wire B/tok", "same / agree"):
        table.add_column(col, justify="right")
    every = [(node, where, s) for node, where in (("h2", "pool"), ("h3", "switch"))
             for s in result[node]]
    for node, where, s in every:
        per_token = max(1, s["cached_tokens"])
        codec = s.get("codec", "none")
        same = ("yes" if s["tokens_equal"] and s["kv_identical"] else "NO") \
            if codec == "none" else f"{s.get('agreement', 0):.2f}"
        table.add_row(f"{s['prompt_tokens']:,}", node, codec, where,
                      f"{s['fetch_seconds']:.3f}",
                      f"{s['ttft_fetch']:.3f}", f"{s['ttft_recompute']:.3f}",
                      f"{s['ttft_recompute'] / s['ttft_fetch']:.1f}x",
                      f"{s['rx_bytes'] / per_token:,.0f}", same)
    rows = [(n, w, s) for n, w, s in every if s.get("codec", "none") == "none"]
    console.print(table)
    console.print(f"KV payload {model['kv_bytes_per_token']:,} B/token; wire: bytes the node "
                  "received per cached token (its GETs, carrying room for the reply, about as "
                  "many again)")
    console.print("h1 recompute TTFT: " + ", ".join(
        f"{s['size']:,} tokens {s['ttft_recompute']:.3f}" for s in a))
    console.print(f"switch counters: hits={counters['get_hit']} misses={counters['get_miss']} "
                  f"learned={counters['fill']} served {counters['hit_bytes']:,} bytes")
    checks = {
        "every shared block found": all(s["cached_tokens"] == s["size"] for _, _, s in every),
        "greedy tokens identical to recompute": all(s["tokens_equal"] for _, _, s in rows),
        "fetched KV identical to recomputed KV": all(s["kv_identical"] for _, _, s in rows),
        "h2 served by the pool node": all(s["from_pool"] == s["chunks"]
                                          for n, _, s in every if n == "h2"),
        "h3 served by the switch": all(s["from_switch"] == s["chunks"]
                                       for n, _, s in every if n == "h3"),
        f"fetch beats recompute from {must_win_from:,} tokens": all(
            s["ttft_fetch"] < s["ttft_recompute"] for _, _, s in rows
            if s["size"] >= must_win_from),
    }
    for name, ok in checks.items():
        console.print(f"  {'ok ' if ok else 'FAIL'} {name}")
    return checks
