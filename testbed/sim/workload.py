"""The requests a modelled cluster serves (the trace itself, or a resampled trace with a chosen
share of shared content) and the inference node each one is routed to."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .config import MODELS, SimConfig
from .trace import BLOCK_TOKENS, Trace


def mix(x: np.ndarray, salt: int = 0) -> np.ndarray:
    """A 64-bit mixing hash of integer ids (splitmix64), vectorised (in place on a copy)."""
    z = np.array(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15 * (salt + 1) & (2**64 - 1))
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


@dataclass
class Workload:
    """Requests (time-sorted, times in seconds) as flat block arrays, like Trace."""
    time: np.ndarray
    input_length: np.ndarray
    offsets: np.ndarray
    hash_ids: np.ndarray
    resampled: bool = False

    @property
    def n(self) -> int:
        return len(self.time)


def _partial_tail_fresh(offsets, ids, input_length, start_id):
    """Give the partial last block of every prompt an id of its own (its text is the request's)."""
    lens = np.diff(offsets)
    partial = ((input_length % BLOCK_TOKENS != 0) & (lens > input_length // BLOCK_TOKENS)
               & (lens > 0))
    last = offsets[1:][partial] - 1
    ids = ids.copy()
    ids[last] = start_id + np.arange(len(last))
    return ids


def tree_popularity(trees: int, skew: float, rng) -> np.ndarray | None:
    """How often each prefix tree is drawn: uniformly (None) or, with ``skew`` > 0, Zipf(skew)
    over the trees in a random order (hot objects: a few system prompts or documents asked
    for by most users; their first blocks sit on one pool node each, by hash placement)."""
    if skew <= 0:
        return None
    rank = np.empty(trees)
    rank[rng.permutation(trees)] = np.arange(1, trees + 1)
    p = rank ** -skew
    return p / p.sum()


def workload(trace: Trace, cfg: SimConfig, requests: int | None = None,
             sharing: float = 0.0) -> Workload:
    """The requests the cluster serves. With ``requests`` unset and no sharing, the trace itself,
    its timestamps scaled to the cluster's arrival rate. Otherwise a resampled trace: prefix trees
    (requests sharing a first block, i.e. a session or a shared document) are drawn uniformly with
    replacement; each drawn copy keeps the tree's requests and their offsets from its first request
    and starts at a uniform time in [-its duration, run length), and gets fresh block ids (a new
    session), except that with probability ``sharing`` it keeps the tree's original ids (the same
    content asked again, e.g. a popular document); with ``cfg.skew`` > 0 trees are drawn by a
    Zipf popularity instead (``tree_popularity``). Partial last blocks always get fresh ids. The
    run is the first ``requests`` requests inside [0, requests / (nodes x rate)) seconds, so they
    arrive at the configured rate from start to end."""
    rate = cfg.rate_per_node or cfg.load * MODELS[cfg.model].prefill_tokens_per_s / max(
        1.0, float(trace.input_length.mean()))
    total_rate = rate * cfg.nodes
    max_id = int(trace.hash_ids.max()) + 1 if trace.n_block_requests else 1
    if requests is None and sharing == 0 and cfg.skew <= 0:
        t = (trace.timestamp - trace.timestamp[0]) / 1000.0
        span = max(1e-9, float(t[-1]))
        scale = trace.n_requests / total_rate / span
        return Workload(t * scale, trace.input_length.copy(), trace.offsets.copy(),
                        trace.hash_ids.copy())
    n = int(requests or trace.n_requests)
    rng = np.random.default_rng(cfg.seed)
    heads = trace.hash_ids[trace.offsets[:-1]]
    _, group = np.unique(heads, return_inverse=True)
    order = np.argsort(group, kind="stable")                  # requests by tree, in time order
    g_sizes = np.bincount(group)
    g_start = np.zeros(len(g_sizes) + 1, np.int64)
    np.cumsum(g_sizes, out=g_start[1:])
    t_ms = trace.timestamp.astype(np.float64)
    first_t = t_ms[order[g_start[:-1]]]
    last_t = t_ms[order[g_start[1:] - 1]]
    dur = (last_t - first_t) / 1000.0                         # a tree's own duration
    span = n / total_rate
    # trees start uniformly in [-duration, W) and only their requests inside [0, W) count, as
    # many trees as put requests there at the cluster's rate; W is a little longer than the
    # run so that its first n requests fill it from start to end (trees starting in [0, span)
    # and kept whole would spread the run over span + the longest tree, at a lower rate)
    pop = tree_popularity(len(g_sizes), cfg.skew, rng)
    for margin in (1.25, 1.5, 2.0, 4.0, 16.0):
        W = margin * span
        inside_share = g_sizes * W / (W + dur)
        k = int(margin * n / float(np.mean(inside_share) if pop is None
                                   else pop @ inside_share)) + 1
        draws = (rng.integers(0, len(g_sizes), k) if pop is None
                 else rng.choice(len(g_sizes), k, p=pop))
        size = g_sizes[draws]
        copy_of = np.repeat(np.arange(k), size)
        within = np.arange(len(copy_of)) - np.repeat(np.cumsum(size) - size, size)
        req = order[g_start[draws][copy_of] + within]         # original request index
        shared = rng.random(k) < sharing
        id_off = np.where(shared, 0, (np.arange(k) + 1) * max_id)[copy_of]
        start = W - rng.random(k) * (W + dur[draws])
        when = start[copy_of] + (t_ms[req] - first_t[draws][copy_of]) / 1000.0
        inside = (when >= 0) & (when < W)
        if inside.sum() >= n:
            break
    req, id_off, when = req[inside], id_off[inside], when[inside]
    srt = np.argsort(when, kind="stable")[:n]
    req, id_off, when = req[srt], id_off[srt], when[srt]
    lens = np.diff(trace.offsets)[req]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    src = np.repeat(trace.offsets[:-1][req] - offsets[:-1], lens) + np.arange(offsets[-1])
    ids = trace.hash_ids[src] + np.repeat(id_off, lens)
    il = trace.input_length[req]
    ids = _partial_tail_fresh(offsets, ids, il, (k + 2) * max_id)
    return Workload(when, il, offsets, ids, resampled=True)


# ---- routing -----------------------------------------------------------------------------------
def route(wl: Workload, cfg: SimConfig) -> np.ndarray:
    """The inference node of every request."""
    n = cfg.nodes
    if cfg.routing == "random":
        return np.random.default_rng(cfg.seed + 7).integers(0, n, wl.n)
    if cfg.routing == "affinity":       # prefix/session affinity: the first block picks the node
        return (mix(wl.hash_ids[wl.offsets[:-1]], 3) % np.uint64(n)).astype(np.int64)
    # least-loaded: the node whose queue of prefill work empties first
    work = wl.input_length / MODELS[cfg.model].prefill_tokens_per_s
    busy = [(0.0, i) for i in range(n)]
    out = np.empty(wl.n, np.int64)
    for r, (t, w) in enumerate(zip(wl.time.tolist(), work.tolist())):
        free, node = busy[0]
        out[r] = node
        heapq.heapreplace(busy, (max(free, t) + w, node))
    return out
