"""`make demo`: an inference node fetches a multi-chunk KV block through the switch twice over.

Brings up a switch, two inference nodes and a pool node; puts a block (keyed by the chained
prefix hash of a token sequence) on the pool node; admits it to the switch; fetches it from h1
(misses: the pool answers, the switch learns the chunks as they pass) and from h2 (hits: the
switch answers at the driver layer); prints where every chunk came from and a byte-exact check.
The last line starts with `demo: OK` only when all of that held.
"""
from __future__ import annotations

import hashlib
import random

from rich.console import Console
from rich.table import Table

from hostagent.common.hashing import block_hashes
from kvproto import DEFAULT_CHUNK

from ..lab import Lab

NS = 1


def run_demo(chunks: int = 256, chunk_size: int = DEFAULT_CHUNK, prefix: str = "demo",
             store: str = "memory") -> bool:
    console = Console()
    rng = random.Random(2025)
    tokens = [rng.randrange(128_000) for _ in range(64)]          # a 64-token shared prefix
    key = block_hashes(tokens, block_tokens=16)[-1]                 # its 4th block's chained key
    block = rng.randbytes(chunks * chunk_size - 100)                # not a whole number of chunks
    want = hashlib.sha256(block).hexdigest()
    console.print(f"[bold]block[/] ns={NS} key={key.hex()} {len(block):,} bytes "
                  f"= {chunks} chunks of {chunk_size} B")

    with Lab(prefix, hosts=2, pools=1, chunk_size=chunk_size, store=store) as lab:
        put = lab.put("h1", NS, key, block)
        console.print(f"put from h1 to pool p1: {put['chunks']} chunks acknowledged")
        lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
        console.print("admitted the block to the switch (learned as pool replies pass)")
        results = [("h1", *lab.get("h1", NS, key)), ("h2", *lab.get("h2", NS, key))]
        counters = lab.stats()

    table = Table(title="where the chunks came from")
    for col in ("node", "pool node", "switch", "retransmits", "seconds", "byte-exact"):
        table.add_column(col, justify="right")
    exact = {}
    for node, res, data in results:
        exact[node] = data == block and res["sha256"] == want
        table.add_row(node, str(res["from_pool"]), str(res["from_switch"]),
                      str(res["retransmits"]), f"{res['seconds']:.3f}",
                      "yes" if exact[node] else "NO")
    console.print(table)
    console.print(f"switch counters: hits={counters['get_hit']} misses={counters['get_miss']} "
                  f"learned={counters['fill']} served {counters['hit_bytes']:,} bytes")

    h1, h2 = results[0][1], results[1][1]
    checks = {
        "byte-exact at h1 and h2": all(exact.values()),
        "h1 served by the pool node": h1["from_pool"] == chunks,
        "switch learned every chunk": counters["fill"] == chunks,
        "h2 served by the switch": h2["from_switch"] == chunks,
    }
    for name, ok in checks.items():
        console.print(f"  {'ok ' if ok else 'FAIL'} {name}")
    ok = all(checks.values())
    print(f"demo: {'OK' if ok else 'FAILED'} - {chunks} chunks, h1 {h1['from_pool']} from pool, "
          f"h2 {h2['from_switch']} from switch, byte-exact {all(exact.values())}")
    return ok
