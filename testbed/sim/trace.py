"""Mooncake-format request traces: load and validate them into numpy arrays, derive the block
request stream a cache sees, and make other traces of the same format (resampled or generated)
so cache policies can be checked on traces they were not tuned on.

Format (Mooncake, FAST'25): JSON lines, one request each, with ``timestamp`` (ms, non-decreasing),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: ids of the request's
``BLOCK_TOKENS``-token prefix blocks, chained (equal ids mean equal prefixes); a request needs
blocks hash_ids[0..k) in order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
# the Mooncake FAST'25 trace that ships with the project (testbed/traces/README.md)
DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "traces" /
                    "mooncake_synthetic_trace.jsonl")
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that is not in the Mooncake format; the message names the line."""


@dataclass
class Trace:
    """A trace as flat arrays: request i's blocks are ``hash_ids[offsets[i]:offsets[i+1]]``."""
    timestamp: np.ndarray        # int64 ms, one per request
    input_length: np.ndarray     # int64 tokens
    output_length: np.ndarray    # int64 tokens
    offsets: np.ndarray          # int64, n_requests + 1
    hash_ids: np.ndarray         # int64, all requests' blocks back to back
    path: str | None = None

    @property
    def n_requests(self) -> int:
        return len(self.timestamp)

    @property
    def n_block_requests(self) -> int:
        return len(self.hash_ids)

    @property
    def distinct_blocks(self) -> int:
        return len(np.unique(self.hash_ids))

    def blocks(self, i: int) -> np.ndarray:
        return self.hash_ids[self.offsets[i]:self.offsets[i + 1]]

    def stream(self) -> "BlockStream":
        """The block requests in replay order, with per-block hints for the policies."""
        lengths = np.diff(self.offsets)
        req = np.repeat(np.arange(self.n_requests), lengths)
        depth = np.arange(len(self.hash_ids)) - self.offsets[:-1][req]
        parent = np.full(len(self.hash_ids), -1, np.int64)
        inner = depth > 0
        parent[inner] = self.hash_ids[np.flatnonzero(inner) - 1]
        # the last block of a prompt holds input_length - (k-1)*BLOCK_TOKENS tokens
        tokens = np.clip(self.input_length[req] - depth * BLOCK_TOKENS, 1, BLOCK_TOKENS)
        return BlockStream(self.hash_ids, req, depth, parent, self.timestamp[req] / 1000.0,
                           tokens / BLOCK_TOKENS)

    def to_requests(self) -> list[dict]:
        return [{"timestamp": int(self.timestamp[i]), "input_length": int(self.input_length[i]),
                 "output_length": int(self.output_length[i]),
                 "hash_ids": self.blocks(i).tolist()} for i in range(self.n_requests)]

    def save(self, path) -> None:
        with open(path, "w") as f:
            for r in self.to_requests():
                f.write(json.dumps(r) + "\n")


@dataclass
class BlockStream:
    """One row per block request: key, request index, depth in its chain, parent key (-1 for
    a chain head), time in seconds, and fill (tokens held / BLOCK_TOKENS)."""
    key: np.ndarray
    request: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    time: np.ndarray
    fill: np.ndarray

    def __len__(self) -> int:
        return len(self.key)


def _int_field(obj: dict, name: str, where: str) -> int:
    v = obj.get(name)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {v!r}")
    return v


def parse_requests(requests, source: str = "<requests>") -> Trace:
    """Validate request dicts (or JSON lines: ``(line number, text)`` pairs) into a Trace."""
    ts, il, ol, lens, ids = [], [], [], [], []
    last_ts = None
    for lineno, obj in requests:
        where = f"{source}:{lineno}"
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in FIELDS if k not in obj]
        if missing:
            raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
        t = _int_field(obj, "timestamp", where)
        if last_ts is not None and t < last_ts:
            raise TraceError(f"{where}: timestamp {t} goes back in time (previous {last_ts})")
        last_ts = t
        h = obj["hash_ids"]
        if not isinstance(h, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in h):
            raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
        ts.append(t)
        il.append(_int_field(obj, "input_length", where))
        ol.append(_int_field(obj, "output_length", where))
        lens.append(len(h))
        ids.extend(h)
    if not ts:
        raise TraceError(f"{source}: no requests")
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Trace(np.array(ts, np.int64), np.array(il, np.int64), np.array(ol, np.int64),
                 offsets, np.array(ids, np.int64), source)


def load_trace(path) -> Trace:
    """Load and validate a Mooncake-format JSONL trace; blank lines are skipped."""
    path = Path(path)
    try:
        with path.open() as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from None
    return parse_requests(lines, str(path))


def as_trace(source) -> Trace:
    """A Trace from a Trace, a path, or a list of request dicts."""
    if isinstance(source, Trace):
        return source
    if isinstance(source, (str, Path)):
        return load_trace(source)
    return parse_requests(enumerate(source, 1))


# ---- other traces of the same format -------------------------------------------------------------
def remap_ids(hash_ids: np.ndarray) -> np.ndarray:
    """Renumber ids 0, 1, 2... in order of first appearance (as Mooncake's traces are)."""
    uniq, first, inv = np.unique(hash_ids, return_index=True, return_inverse=True)
    rank = np.empty(len(uniq), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniq))
    return rank[inv.ravel()]


def _build(ts, il, ol, chains, next_id) -> Trace:
    """Assemble a trace from per-request chains, giving every request whose prompt ends in a
    partial block a fresh last-block id (its text differs from every other request's)."""
    ids, lens = [], []
    for chain, tokens in zip(chains, il):
        chain = list(chain)
        full = tokens // BLOCK_TOKENS
        if tokens % BLOCK_TOKENS and chain and len(chain) > full:
            chain[-1] = next_id
            next_id += 1
        ids.extend(chain)
        lens.append(len(chain))
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Trace(np.asarray(ts, np.int64), np.asarray(il, np.int64), np.asarray(ol, np.int64),
                 offsets, remap_ids(np.array(ids, np.int64)))


def resample(trace: Trace, seed: int, method: str = "zipf", *, n_requests: int | None = None,
             zipf_s: float = 0.9) -> Trace:
    """A different trace over the same prefix trees.

    - ``zipf``: the distinct prompts of ``trace`` (chains without their partial last block) get
      a random popularity rank and requests draw them from Zipf(``zipf_s``) with Poisson
      arrivals at the trace's mean rate: the same shared-prefix structure, new popularity and
      timing (independent reference model, no temporal locality beyond popularity).
    - ``shuffle``: the same requests in a random order on the same timestamps: popularity kept,
      temporal locality destroyed.
    """
    rng = np.random.default_rng(seed)
    n = n_requests or trace.n_requests
    chains = [trace.blocks(i) for i in range(trace.n_requests)]
    next_id = int(trace.hash_ids.max()) + 1 if trace.n_block_requests else 0
    if method == "shuffle":
        order = rng.permutation(trace.n_requests)[:n]
        return _build(trace.timestamp[:n], trace.input_length[order], trace.output_length[order],
                      [chains[i] for i in order], next_id)
    if method != "zipf":
        raise ValueError(f"unknown resampling method {method!r} (zipf, shuffle)")
    # one template per distinct prompt (the chain without its request-specific partial tail)
    templates: dict[tuple, int] = {}
    for i, c in enumerate(chains):
        full = int(trace.input_length[i]) // BLOCK_TOKENS
        templates.setdefault(tuple(c[:max(full, 1)].tolist()), i)
    tmpl = rng.permutation(list(templates.values()))
    p = 1.0 / np.arange(1, len(tmpl) + 1) ** zipf_s
    pick = tmpl[rng.choice(len(tmpl), size=n, p=p / p.sum())]
    span = max(1, int(trace.timestamp[-1] - trace.timestamp[0]))
    ts = np.sort(rng.uniform(0, span, n)).astype(np.int64)
    return _build(ts, trace.input_length[pick], trace.output_length[pick],
                  [chains[i] for i in pick], next_id)


def generate_sessions(n_requests: int, seed: int, *, system_prompts: int = 20,
                      sessions: int = 400, rate_per_s: float = 4.0) -> Trace:
    """A synthetic multi-turn workload, structurally unlike resampling: requests start with one
    of a few shared system prompts (Zipf-popular, 1-8 blocks), belong to Zipf-popular
    conversations whose every turn extends that conversation's previous prompt by 1-6 blocks,
    or (one in five) are one-off documents of 2-60 blocks sharing only the system prompt."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(k):
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    sys_chains = [fresh(int(rng.integers(1, 9))) for _ in range(system_prompts)]
    sys_p = 1.0 / np.arange(1, system_prompts + 1)
    sys_p /= sys_p.sum()
    conv_p = 1.0 / np.arange(1, sessions + 1) ** 0.8
    conv_p /= conv_p.sum()
    conv_of: dict[int, list] = {}
    gaps = rng.exponential(1000.0 / rate_per_s, n_requests)
    ts = np.cumsum(gaps).astype(np.int64)
    chains, il = [], []
    for _ in range(n_requests):
        if rng.random() < 0.2:
            chain = (sys_chains[rng.choice(system_prompts, p=sys_p)]
                     + fresh(int(rng.integers(2, 61))))
        else:
            c = int(rng.choice(sessions, p=conv_p))
            if c not in conv_of or len(conv_of[c]) > 300:
                conv_of[c] = list(sys_chains[rng.choice(system_prompts, p=sys_p)])
            conv_of[c] = conv_of[c] + fresh(int(rng.integers(1, 7)))
            chain = conv_of[c]
        chains.append(chain)
        il.append(len(chain) * BLOCK_TOKENS - int(rng.integers(0, BLOCK_TOKENS)))
    ol = rng.integers(1, 800, n_requests)
    return _build(ts, il, ol, chains, next_id)
