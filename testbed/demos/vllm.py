"""`testbed demo-vllm`: vLLM engines sharing prefix KV through the switch with the kvswitch KV
connector (``hostagent.inference.connectors.vllm``).

The model is a small Llama whose config ships in ``models/<name>/config.json``; its weights are
made here from a seed (``materialize_model``: nothing is downloaded) and named in the block keys
by their SHA-256. Every engine is its own process in its node's namespace (vLLM's single-process
mode), prompts are token ids: a long shared prefix plus a per-prompt question.

h1 (engine A, connector) answers SHARED+QA and saves its prompt blocks; the orchestrator admits
those blocks to the switch. h2 (engine B, connector) answers SHARED+QB: its first request misses
at the switch and is served by the pool node (the switch learns the replies as they pass), the
next ones are served by the switch; it also times TTFT with the connector and recomputing
(``skip_reading_prefix_cache``) in alternation, generates with the recompute, and runs a negative
control (every loaded block swapped for the first block's KV, through the connector's ``getter``
seam) that must change the output. h3 (engine B', no connector) answers SHARED+QB and times TTFT.
Local prefix caching is off in every engine, so each request loads or recomputes.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ..lab import Lab
from ..results import write_json

NS = 9
SEED = 0
MODELS_DIR = Path(__file__).with_name("models")
CACHE = Path(os.environ.get("KVSWITCH_CACHE", Path.home() / ".cache" / "kvswitch"))
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_STREAM": "ext://sys.stderr",
       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


# ---- the model -----------------------------------------------------------------------------
def materialize_model(name: str = "small-llama", seed: int = SEED) -> tuple[str, str]:
    """The model directory (config + seeded safetensors weights, made once into the cache) and
    its model id for block keys (name, seed and the weights' SHA-256)."""
    config = (MODELS_DIR / name / "config.json").read_bytes()
    tag = hashlib.sha256(config).hexdigest()[:12]
    out = CACHE / "models" / f"{name}-seed{seed}-{tag}"
    if not (out / "sha256").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            torch.manual_seed(seed)
            cfg = LlamaConfig.from_dict(json.loads(config))
            model = LlamaForCausalLM(cfg).to(torch.float32).eval()
            model.save_pretrained(tmp, safe_serialization=True)
            (tmp / "generation_config.json").unlink(missing_ok=True)  # no sampling defaults
            (tmp / "config.json").write_bytes(config)
            digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
            (tmp / "sha256").write_text(digest + "\n")
            tmp.chmod(0o755)
            try:
                tmp.rename(out)
            except OSError:              # made meanwhile by another process
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    digest = (out / "sha256").read_text().strip()
    return str(out), f"{name}/seed{seed}@sha256:{digest[:16]}"


def prompt(shared: int, question: int, who: str, vocab: int) -> list[int]:
    """``shared`` tokens every prompt starts with, then ``question`` tokens of its own."""
    a, b = random.Random(f"shared-{shared}"), random.Random(f"question-{who}-{question}")
    return ([a.randrange(3, vocab) for _ in range(shared)] +
            [b.randrange(3, vocab) for _ in range(question)])


def model_prompt(model_dir: str, shared: int, question: int, who: str, vocab: int) -> list[int]:
    """A real model (its directory has a tokenizer): real text, Debian's license texts (the
    shared prefix from their start, each question from another place); else ``prompt``."""
    if not Path(model_dir, "tokenizer.json").exists():
        return prompt(shared, question, who, vocab)
    from transformers import AutoTokenizer
    from .realmodel import texts
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [t for text in texts().values() for t in tok(text)["input_ids"]]
    start = shared + 97 * (1 + sum(map(ord, who)) % 50)
    return ids[:shared] + ids[start:start + question]


def model_files(model: str) -> tuple[str, str]:
    """(directory, model id) of a demo model: ``smollm2`` (the real one, converted once) or a
    seeded config in ``models/``."""
    if model == "smollm2":
        from .realmodel import convert
        return convert()
    return materialize_model(model)


# ---- inside a node -------------------------------------------------------------------------
class _Engine:
    """One vLLM engine (this process), with or without the connector."""

    def __init__(self, model_dir: str, max_len: int, connector: dict | None):
        for k, v in ENV.items():
            os.environ.setdefault(k, v)
        start = time.perf_counter()
        from vllm import LLM
        from vllm.config import KVTransferConfig
        kw = {}
        if connector:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVSwitchConnector",
                kv_connector_module_path="hostagent.inference.connectors.vllm", kv_role="kv_both",
                kv_connector_extra_config=connector)
        self.llm = LLM(model=model_dir, load_format="safetensors", skip_tokenizer_init=True,
                       enforce_eager=True, dtype="float32", seed=0, enable_prefix_caching=False,
                       max_model_len=max_len, **kw)
        self.start_seconds = time.perf_counter() - start
        self.vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
        self.backend = None
        if connector:
            from hostagent.inference.connectors.vllm_pool import backends
            self.backend = backends()[0]

    def run(self, tokens: list[int], max_tokens: int, recompute: bool = False) -> dict:
        """Greedy generation; wall time, tokens, logprobs, vLLM's cached-token count and the
        connector's events of this request."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False, logprobs=0,
                            skip_reading_prefix_cache=True if recompute else None)
        seen = len(self.backend.events) if self.backend else 0
        start = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        o = out.outputs[0]
        events = list(self.backend.events)[seen:] if self.backend else []
        return {"seconds": seconds, "tokens": list(o.token_ids),
                "logprobs": [d[t].logprob for t, d in zip(o.token_ids, o.logprobs or [])],
                "cached_tokens": out.num_cached_tokens or 0, "events": events}

    def warm_up(self) -> None:
        """A short unrelated prompt: the timed requests do not pay first-forward costs."""
        self.run(prompt(0, 160, "warm-up", self.vocab), 2)

    def flush(self) -> bool:
        return self.backend.flush(60) if self.backend else True


def _connector(pools, chunk_size, window, concurrency, block_tokens, model_id,
               kv_codec="none") -> dict:
    extra = {"pools": list(pools), "namespace": NS, "chunk_size": chunk_size, "window": window,
             "concurrency": concurrency, "model_id": model_id, "kv_codec": kv_codec}
    return extra | ({"block_tokens": block_tokens} if block_tokens else {})


def _moved(events: list[dict]) -> dict:
    """Chunks moved by this request's probe and load, and from where."""
    out = {}
    for ev in ("probe", "load"):
        es = [e for e in events if e["ev"] == ev]
        out[ev] = {k: sum(e.get(k, 0) for e in es)
                   for k in ("chunks", "bytes", "from_switch", "from_pool", "replicas")}
    load = [e for e in events if e["ev"] == "load"]
    out["load"].update(blocks=sum(e["blocks"] for e in load), tokens=sum(e["tokens"] for e in load),
                       seconds=sum(e["seconds"] for e in load),
                       errors=[e["error"] for e in load if e["error"]])
    out["found"] = [e["found"] for e in events if e["ev"] == "probe"]
    return out


def node_a(model_dir, model_id, pools, chunk_size, window, concurrency, block_tokens, shared,
           question, new_tokens, kv_codec="none") -> dict:
    """Engine A: answer SHARED+QA, save its blocks, wait until the pool acknowledged them."""
    eng = _Engine(model_dir, shared + question + new_tokens + 64,
                  _connector(pools, chunk_size, window, concurrency, block_tokens, model_id,
                             kv_codec))
    eng.warm_up()
    r = eng.run(model_prompt(model_dir, shared, question, "A", eng.vocab), new_tokens)
    flushed = eng.flush()
    saves = [e for e in r["events"] if e["ev"] == "save"]
    return {"start_seconds": eng.start_seconds, "seconds": r["seconds"], "tokens": r["tokens"],
            "flushed": flushed, "keys": [k for e in saves for k in e["keys"]],
            "saved_bytes": sum(e["bytes"] for e in saves), "totals": eng.backend.snapshot()}


class _FirstBlockOnly:
    """Negative control through the ``getter`` seam: every block asked for is answered with the
    bytes of the first block asked for (valid KV, of other tokens)."""

    def __init__(self, inner):
        self.inner, self.first = inner, None

    async def get_block_view(self, ns, key, nchunks=None):
        self.first = self.first or key
        return await self.inner.get_block_view(ns, self.first, nchunks=nchunks)


def node_b(model_dir, model_id, pools, chunk_size, window, concurrency, block_tokens, shared,
           question, new_tokens, ttft_reps, negative, kv_codec="none") -> dict:
    """Engine B: load the prefix (pool, then switch), time TTFT both ways, compare outputs."""
    eng = _Engine(model_dir, shared + question + new_tokens + 64,
                  _connector(pools, chunk_size, window, concurrency, block_tokens, model_id,
                             kv_codec))
    eng.warm_up()
    tokens = model_prompt(model_dir, shared, question, "B", eng.vocab)
    first = eng.run(tokens, 1)                          # misses at the switch: from the pool
    second = eng.run(tokens, new_tokens)                # from the switch
    ttft, ttft_recompute = [], []
    for _ in range(ttft_reps):
        ttft.append(eng.run(tokens, 1)["seconds"])
        ttft_recompute.append(eng.run(tokens, 1, recompute=True)["seconds"])
    recompute = eng.run(tokens, new_tokens, recompute=True)
    out = {"start_seconds": eng.start_seconds, "prompt_tokens": len(tokens),
           "first": {"seconds": first["seconds"], "cached_tokens": first["cached_tokens"],
                     **_moved(first["events"])},
           "second": {k: second[k] for k in ("seconds", "tokens", "logprobs", "cached_tokens")}
           | _moved(second["events"]),
           "ttft": ttft, "ttft_recompute": ttft_recompute,
           "recompute": {k: recompute[k] for k in ("tokens", "logprobs", "cached_tokens")}}
    if negative:
        getter, eng.backend.getter = eng.backend.getter, _FirstBlockOnly(eng.backend.client)
        bad = eng.run(tokens, new_tokens)
        eng.backend.getter = getter
        out["negative"] = {k: bad[k] for k in ("tokens", "logprobs", "cached_tokens")}
    out["totals"] = eng.backend.snapshot()
    out["fetch_path"] = "asyncio" if eng.backend.getter is eng.backend.client else "xdp"
    return out


def node_plain(model_dir, shared, question, new_tokens, ttft_reps) -> dict:
    """Engine B' without any connector: the reference output and recompute TTFT."""
    eng = _Engine(model_dir, shared + question + new_tokens + 64, None)
    eng.warm_up()
    tokens = model_prompt(model_dir, shared, question, "B", eng.vocab)
    r = eng.run(tokens, new_tokens)
    ttft = [eng.run(tokens, 1)["seconds"] for _ in range(ttft_reps)]
    return {"start_seconds": eng.start_seconds, "tokens": r["tokens"],
            "logprobs": r["logprobs"], "cached_tokens": r["cached_tokens"], "ttft": ttft}


# ---- the orchestrator ----------------------------------------------------------------------
def run_vllm_demo(shared: int = 4000, question: int = 40, new_tokens: int = 16,
                  ttft_reps: int = 3, chunk_size: int = 3072, window: int = 64,
                  concurrency: int = 4, block_tokens: int = 128, model: str = "small-llama",
                  baseline: bool = True, negative: bool = True, must_win: bool = True,
                  prefix: str = "vl", json_path: str | None = None,
                  kv_codec: str = "none") -> bool:
    """Run the demo; True when every check held. ``baseline``: also run engine B' without a
    connector on h3; ``must_win``: TTFT with the connector must beat recompute. ``kv_codec``:
    the connectors' codec; with one other than none the greedy tokens are not required to be
    identical, their agreement with recompute is reported."""
    from rich.console import Console
    console = Console()
    if shared < block_tokens:
        raise ValueError(f"the shared prefix ({shared} tokens) must hold a whole block "
                         f"({block_tokens} tokens)")
    model_dir, model_id = model_files(model)
    limit = json.loads(Path(model_dir, "config.json").read_text())["max_position_embeddings"]
    if shared + question + new_tokens + 64 > limit:
        raise ValueError(f"prompt and answer must stay below {limit - 64} tokens for {model}")
    args = [model_dir, model_id]
    conn = [chunk_size, window, concurrency, block_tokens, shared, question, new_tokens]
    t0 = time.monotonic()
    with Lab(prefix, hosts=3, pools=1, chunk_size=chunk_size, pool_capacity="1GiB") as lab:
        pools = lab.pool_addrs
        console.print(f"[bold]{model_id}[/] on h1, h2{', h3' if baseline else ''}: "
                      f"{shared}-token shared prefix + {question}-token questions, "
                      f"{block_tokens}-token blocks in {chunk_size}-byte chunks")
        a = lab.task("h1", f"{__name__}:node_a", *args, pools, *conn, kv_codec)
        console.print(f"h1 (engine A) answered and saved {len(a['keys'])} blocks "
                      f"({a['saved_bytes']:,} bytes; engine start {a['start_seconds']:.0f} s)")
        shared_keys = a["keys"][:shared // block_tokens]
        for key in shared_keys:
            lab.switchd("cache", "admit", "--ns", str(NS), "--key", key)
        console.print(f"admitted the {len(shared_keys)} shared-prefix blocks to the switch")
        b = lab.task("h2", f"{__name__}:node_b", *args, pools, *conn, ttft_reps, negative,
                     kv_codec)
        counters = lab.stats()
        pool = lab.pool_counters()
        c = lab.task("h3", f"{__name__}:node_plain", model_dir, shared, question, new_tokens,
                     ttft_reps) if baseline else None
    load = os.getloadavg()
    result = {"model": {"id": model_id, "dir": model_dir},
              "config": {"shared": shared, "question": question, "new_tokens": new_tokens,
                         "ttft_reps": ttft_reps, "chunk_size": chunk_size, "window": window,
                         "concurrency": concurrency, "block_tokens": block_tokens,
                         "kv_codec": kv_codec},
              "h1": a, "h2": b, "h3": c, "switch": counters, "pool": pool,
              "loadavg": load, "seconds": round(time.monotonic() - t0, 1)}
    second, ref = b["second"]["tokens"], b["recompute"]["tokens"]
    result["agreement"] = sum(x == y for x, y in zip(second, ref)) / max(1, len(ref))
    result["checks"] = report(console, result, must_win)
    write_json(json_path, result)
    ok = all(result["checks"].values())
    med = statistics.median
    print(f"demo-vllm: {'OK' if ok else 'FAILED'} - {b['second']['cached_tokens']} prompt "
          f"tokens loaded through the switch, TTFT {med(b['ttft']):.3f} s vs "
          f"{med(b['ttft_recompute']):.3f} s recomputing; "
          + (f"greedy tokens identical "
             f"{result['checks']['greedy tokens identical with and without the connector']}"
             if kv_codec == "none" else
             f"kv_codec {kv_codec}: greedy agreement with recompute {result['agreement']:.3f}"))
    return ok


def report(console, result: dict, must_win: bool) -> dict[str, bool]:
    """Print the demo's table and checks; return the checks."""
    from rich.table import Table
    med = statistics.median
    cfg, a, b, c = result["config"], result["h1"], result["h2"], result["h3"]
    bt, n = cfg["block_tokens"], cfg["shared"] // cfg["block_tokens"]
    expect = n * bt
    first, second = b["first"], b["second"]
    table = Table(title=f"engine B (h2), {cfg['shared']:,}-token shared prefix, this CPU "
                        f"(load {result['loadavg'][0]:.1f})")
    for col in ("request", "KV from", "loaded", "TTFT s", "probe sw/pool", "load sw/pool",
                "MB"):
        table.add_column(col, justify="right")
    for name, r, ttft in (("1st", first, first["seconds"]), ("next", second, med(b["ttft"]))):
        where = "switch" if r["load"]["from_pool"] == 0 else "pool"
        table.add_row(name, where, f"{r['cached_tokens']:,}", f"{ttft:.3f}",
                      f"{r['probe']['from_switch']}/{r['probe']['from_pool']}",
                      f"{r['load']['from_switch']}/{r['load']['from_pool']}",
                      f"{r['load']['bytes'] / 1e6:.1f}")
    table.add_row("recompute", "-", "0", f"{med(b['ttft_recompute']):.3f}", "", "", "")
    if c:
        table.add_row("h3, no conn.", "-", f"{c['cached_tokens']}", f"{med(c['ttft']):.3f}",
                      "", "", "")
    console.print(table)
    console.print(f"TTFT: 1st request one run, the others medians of {cfg['ttft_reps']} "
                  "(connector and recompute alternating); sw/pool: chunks from each")
    per_block = -(-first["load"]["chunks"] // max(1, first["load"]["blocks"]))
    sent_by_pool = first["probe"]["from_pool"] + first["load"]["from_pool"]
    maxdiff = max((abs(x - y) for x, y in zip(second["logprobs"], b["recompute"]["logprobs"])),
                  default=0.0)
    console.print(f"greedy tokens with the connector {second['tokens']}; max |logprob "
                  f"difference| vs recompute {maxdiff:.2e}")
    s = result["switch"]
    console.print(f"switch: hits={s['get_hit']} misses={s['get_miss']} learned={s['fill']} "
                  f"served {s['hit_bytes']:,} bytes; engine start A {a['start_seconds']:.0f} s, "
                  f"B {b['start_seconds']:.0f} s"
                  + (f", B' {c['start_seconds']:.0f} s" if c else ""))
    coded = cfg.get("kv_codec", "none") != "none"     # lossy: agreement is reported instead
    checks = {
        "greedy tokens identical with and without the connector": coded or (
            second["tokens"] == b["recompute"]["tokens"]
            and (c is None or second["tokens"] == c["tokens"])),
        f"external hit = shared prefix rounded down to whole blocks ({expect})":
            first["cached_tokens"] == second["cached_tokens"] == expect
            and first["load"]["tokens"] == second["load"]["tokens"] == expect,
        "bytes came through the KV protocol":
            first["load"]["bytes"] == second["load"]["bytes"] == n * a["saved_bytes"]
            // max(1, len(a["keys"])) and not first["load"]["errors"] + second["load"]["errors"],
        "1st request: the pool node sent every chunk once, the switch learned it":
            sent_by_pool == n * per_block and s["fill"] >= n * per_block,
        "2nd request served by the switch":
            second["probe"]["from_pool"] + second["load"]["from_pool"] == 0
            and second["load"]["from_switch"] == n * per_block,
    }
    if must_win:
        checks["TTFT with the connector below recompute"] = (
            med(b["ttft"]) < med(b["ttft_recompute"])
            and (c is None or med(b["ttft"]) < med(c["ttft"])))
    if "negative" in b:
        neg = b["negative"]
        checks["negative control: corrupted KV changes the output"] = (
            neg["cached_tokens"] == expect and (neg["tokens"] != second["tokens"] or max(
                abs(x - y) for x, y in zip(neg["logprobs"], second["logprobs"])) > 1e-3))
    for name, ok in checks.items():
        console.print(f"  {'ok ' if ok else 'FAIL'} {name}")
    return checks
