"""One inference node of `testbed bench serve --tiers` (a testbed.lab task in the node's
namespace): the serving loop of testbed.bench.serve.serve_node with a node-DRAM tier
(hostagent.inference.node_tier.NodeTier, holding the fetch engine's zero-copy blocks and the blocks
the node computed) and hostagent.common.tier_policy deciding, per request:

  1. every prefix block is a use of it (the policy's popularity, with its depth);
  2. node DRAM first (a hit: no network), the rest fetched at once with the XDP fetch engine
     (the switch or the owner pool node; a pool node stages a block back from its disk);
  3. the leading run of found blocks is cached; fetched blocks of it are promoted into node
     DRAM (``promote``), the rest computed (modelled prefill) and put there (the engine's save);
  4. what node DRAM evicts is written down to the pool if the policy demotes it (``demote``:
     a block this node has not written before) or dropped;
  5. blocks due now (``write_down``: computed or held, not yet written) go to the pool through
     a background writer (every one with write-down ``all``).

Every block used is checked byte for byte against its content (node hits too).
"""
from __future__ import annotations

import time

from hostagent.inference.fetch.engine import FetchEngine
from hostagent.inference.node_tier import NodeTier, view_of

from .serve_node import BLOCK_TOKENS, Writer, common_start, placement
from .serve_tiers_pool import policy_config
from .serve_workloads import payload


def serve(pools: list[str], chunk_size: int, ns: int, block_bytes: int, requests: list[dict],
          start_at: float | str, prefill_tok_s: float, policy: dict, node_bytes: int) -> dict:
    from hostagent.common.tier_policy import TierPolicy
    pol = TierPolicy(policy_config(policy))
    t0 = [time.monotonic()]
    clock = lambda: time.monotonic() - t0[0]      # noqa: E731 - the policy's time
    written: set[bytes] = set()
    writer = Writer(placement(pools), chunk_size, ns, block_bytes)

    def write(key: bytes) -> None:
        written.add(key)
        writer.q.put([key])

    def evicted(_ns: int, key: bytes, _obj, nbytes: int) -> None:
        if key not in written and pol.demote(key, "node", clock(), nbytes) == "pool":
            write(key)

    value = (lambda _ns, key, nbytes: pol.order_key(key, nbytes)) if pol.evict_by_value else None
    tier = NodeTier(node_bytes, "value" if value else "lru", value, evicted)
    out = {"ttft": [], "fetch": [], "blocks": 0, "hits": {"node": 0, "switch": 0, "pool": 0},
           "byte_exact": True, "fetch_errors": 0, "computed": 0, "node_tier": None}
    try:
        with FetchEngine(pools, chunk_size) as eng:
            time.sleep(max(0.0, common_start(start_at) - time.time()))
            t0[0] = time.monotonic()
            for req in requests:
                arrival = t0[0] + req["at"]
                time.sleep(max(0.0, arrival - time.monotonic()))
                start = time.monotonic()
                now = clock()
                keys = [bytes.fromhex(k) for k in req["keys"]]
                for d, k in enumerate(keys):
                    pol.access(k, now, d, block_bytes)
                src: list = [None] * len(keys)
                held: dict[bytes, object] = {}
                for i, k in enumerate(keys):
                    lease = tier.lease(ns, k)
                    if lease is not None:
                        src[i], held[k] = "node", lease
                need = [i for i, s in enumerate(src) if s is None]
                got = eng.get_blocks([(ns, keys[i], None) for i in need], return_exceptions=True) \
                    if need else []
                fetched = {}
                for i, b in zip(need, got):
                    if isinstance(b, BaseException):
                        out["fetch_errors"] += type(b).__name__ != "BlockNotFound"
                        continue
                    s = b.stats
                    src[i] = "switch" if 2 * (s.from_switch + s.replicas) >= s.chunks else "pool"
                    fetched[i] = b
                run = next((i for i, s in enumerate(src) if s is None), len(keys))
                fetch_done = time.monotonic()
                for i, k in enumerate(keys):          # what the request uses, checked
                    if i >= run:
                        break
                    data = held[k].view if src[i] == "node" else view_of(fetched[i])
                    out["byte_exact"] &= data == payload(k, block_bytes)
                    out["hits"][src[i]] += 1
                for lease in held.values():
                    lease.release()
                for i, b in fetched.items():
                    if i < run:
                        written.add(keys[i])                   # the pool has it
                        if pol.promote(keys[i], now, None, block_bytes) and \
                                tier.put(ns, keys[i], b):
                            continue
                    b.release()
                compute = max(0, req["tokens"] - run * BLOCK_TOKENS) / prefill_tok_s
                time.sleep(compute)
                now = clock()
                for k in keys[run:]:                           # the engine's saves
                    tier.put(ns, k, payload(k, block_bytes))
                out["computed"] += len(keys) - run
                for i, k in enumerate(keys):
                    if k not in written and (i >= run or src[i] == "node") and \
                            pol.write_down(k, now, block_bytes) == "now":
                        write(k)
                out["ttft"].append(time.monotonic() - arrival)
                out["fetch"].append(fetch_done - start)
                out["blocks"] += len(keys)
            tier.clear()
    finally:                    # also when the engine fails: else its thread keeps us alive
        writer.close()
    out["written"], out["write_errors"] = writer.written, writer.errors
    out["node_tier"] = tier.stats()
    return out
