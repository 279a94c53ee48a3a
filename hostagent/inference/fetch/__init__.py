"""The inference node's block fetch engine: whole KV blocks at line rate, with XDP doing every
per-chunk step and Python deciding per transfer and per step, never per chunk. docs/fetch.md
tells the whole story; each module owns one concern:

    program   xdp/kvfetch.c compiled (once, cached), loaded with maps of the engine's sizes,
              its maps mmapped as numpy arrays; the programs it may take the place of on the
              node's interface (loading, attaching, libbpf and namespaces: the xdp package)
    netpath   namespaces, addresses, next hops and the GET headers to each pool node
    engine    FetchEngine: lifecycle, the send ring and its test-run calls, the step loop
    transfers per-transfer state, round trips, windows, loss recovery
    verify    CRC checks of what arrived (crcfold), finished transfers as Blocks
    authcheck keyed authentication of sealed blocks over the arena (hostagent/common/auth.py)
    ids       random transfer indexes and generations (request ids), not reused while
              replies may come
    block     Block (a zero-copy view of the arena) and the slot allocator
    crcfold   many chunk CRCs checked with one CRC call
    client    AsyncFetchClient (KVClient's interface) and open_client, the automatic choice
              between the engine and the asyncio KVClient

    from hostagent.inference.fetch import FetchEngine
    with FetchEngine(["198.18.0.101"], chunk_size=3072) as e:      # in the node's netns
        blk = e.get_block(ns, key)            # Block: .numpy(), .torch(dtype), .view
        ...
        blk.release()
"""
from hostagent.common.block import Block
from .client import AsyncFetchClient, open_client
from .engine import EngineStats, FetchEngine, LinkDown, NoReply
from xdp import NoXdp


__all__ = ["AsyncFetchClient", "Block", "EngineStats", "FetchEngine", "LinkDown", "NoReply",
           "NoXdp", "open_client"]
