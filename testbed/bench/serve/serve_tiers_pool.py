"""The pool node of `testbed bench serve --tiers`: `hostagent serve` (DRAM store, disk tier)
with hostagent.common.tier_policy's pool side plugged in: the PUTs it stores and the GETs (chunk 0,
one a fetch) that reach it feed the policy; DRAM gives way in the policy's order (``value``
mode: lowest value first, else least recent) through the store's ``set_policy``, and the
policy's demotion gate decides which evicted blocks go to disk. GETs are answered by the
server process (HOSTAGENT_XDP_SERVE=0) so that every one is seen.

  python -m testbed.bench.serve.serve_tiers_pool '<policy JSON>' <hostagent serve options>
"""
from __future__ import annotations

import json
import os
import sys


def policy_config(d: dict):
    from hostagent.common.tier_policy import PolicyConfig, TierCost
    kw = dict(d)
    if "costs" in kw:
        kw["costs"] = {k: TierCost(*v) for k, v in kw["costs"].items()}
    return PolicyConfig(**kw)


def attach(store, side, cfg) -> None:
    """Plug the policy's pool side into ``store``: its eviction order and demotion gate, every
    stored PUT counted (a block's first use) and every fetch the server sees (``on_get``: a GET
    of chunk 0, staged hits included, which the server answers without ``handle``)."""
    def demote_fn(ns: int, key: bytes, nbytes: int) -> bool:
        d = store.disk
        free = d.capacity - d.used if d is not None else 0     # (an empty tier is falsy)
        return side.demote_fn(ns, key, nbytes, free)

    store.on_get = side.get
    by_value = cfg.demote == "value"
    store.set_policy("value" if by_value else "lru", side.value_fn if by_value else None,
                     demote_fn)
    put_chunk = store.put_chunk

    def put(ns, key, chunk, nchunks, payload, crc, source=""):
        done = put_chunk(ns, key, chunk, nchunks, payload, crc, source)
        if done is not False:
            side.put(ns, key, nchunks * len(payload))
        return done

    store.put_chunk = put


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = policy_config(json.loads(argv.pop(0)))
    os.environ["HOSTAGENT_XDP_SERVE"] = "0"
    from hostagent import cli
    from hostagent.common.tier_policy import PoolSide
    side = PoolSide(cfg)
    make_store = cli._make_store

    def make(ctx, v):
        store = make_store(ctx, v)
        attach(store, side, cfg)
        return store

    cli._make_store = make
    cli.main(["serve", *argv])


if __name__ == "__main__":
    main()
