"""`testbed bench loss`: fetching blocks over lossy links. Every node's veth end drops a share of
the KV frames it receives (an XDP loss injector: this kernel has no netem), in both directions;
h1 fetches a block through the switch cold (misses, learned as the replies pass), then h2 fetches
it again (hits). Reports completion time, retransmissions and byte-exactness per loss rate."""
from __future__ import annotations

import os
import statistics

from ...lab import Lab
from ...results import write_json
from ...lab import attach_loss

NS = 9


def run_loss(losses: list[float], block_mib: float, reps: int, json_path: str | None,
             log=print) -> dict:
    block, key = os.urandom(int(block_mib * (1 << 20))), os.urandom(16)
    results = []
    log(f"bench loss: losses {', '.join(f'{x:g}' for x in losses)} %; building the testbed ...")
    with Lab(f"ls{os.getpid() % 10000}", hosts=2, pools=1) as lab:
        lab.put("h1", NS, key, block)
        nodes = [n.netns for n in lab.topo.nodes]
        for loss in losses:
            log(f"bench loss: {loss:g} % ...")
            attach_loss(nodes, loss / 100)
            rows = {"miss": [], "hit": []}
            exact, retransmits = True, {"miss": 0, "hit": 0}
            for _ in range(reps):
                lab.switchd("cache", "evict", "--ns", str(NS), "--key", key.hex())
                lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
                for node, kind in (("h1", "miss"), ("h2", "hit")):
                    stats, data = lab.get(node, NS, key)
                    exact &= data == block
                    rows[kind].append(stats["seconds"])
                    retransmits[kind] += stats["retransmits"]
            attach_loss(nodes, 0)
            row = {"loss_percent": loss, "byte_exact": exact, "repetitions": reps,
                   **{f"{k}_completion_s_p50": round(statistics.median(v), 4)
                      for k, v in rows.items()},
                   **{f"{k}_completion_s_max": round(max(v), 4) for k, v in rows.items()},
                   **{f"{k}_retransmits": v for k, v in retransmits.items()}}
            results.append(row)
            log(f"loss {loss:4}%: cold fetch p50 {row['miss_completion_s_p50']:.3f}s "
                f"(max {row['miss_completion_s_max']:.3f}s, {retransmits['miss']} retransmits), "
                f"switch hit fetch p50 {row['hit_completion_s_p50']:.3f}s "
                f"({retransmits['hit']} retransmits), byte-exact {exact}")
    out = {"block_bytes": len(block), "results": results}
    write_json(json_path, out)
    return out
