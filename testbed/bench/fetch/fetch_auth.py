"""Keyed block authentication's cost on the fetch engine, A/B: the same data plain and sealed
(hostagent/common/auth.py) in a keyed namespace, fetched from the switch's cache alternately, fetch
by fetch, on one testbed per chunk size. `testbed bench fetch` measures the same in its rounds
(the xdp-auth rows); this is the low-noise check. ``python -m testbed.bench.fetch.fetch_auth
[JSON]``."""
from __future__ import annotations

import os
import time

import numpy as np

from hostagent.common import auth
from hostagent.inference.fetch import FetchEngine
from switchd.cache import Cache
from switchd.dataplane import DataPlane, pinned_deployment

from ...lab import Lab
from ...results import write_json
from .fetch import AUTH_KEY, MIB, NS, NS_AUTH, PREFIX, _block, _engine, _gbps, _key, _merge
from .throughput import fill_cache


def auth_ab(chunk_sizes=(3072,), sizes_mib=(2, 64), reps: int = 30, json_path: str | None = None,
            log=print) -> dict:
    """The engine fetching the same data plain and sealed (hostagent/common/auth.py), alternating
    fetch by fetch from the switch's cache, ``reps`` pairs per block (a third of that at 8 MiB
    and more): the cost of keyed authentication with less noise than a full run's rounds.
    ``python -m testbed.bench.fetch.fetch_auth [JSON]``."""
    started, load0, out = time.monotonic(), os.getloadavg(), []
    for cs in chunk_sizes:
        nch = {m: -(-(m * MIB) // cs) for m in sizes_mib}
        lab = Lab(PREFIX, hosts=1, pools=1, chunk_size=cs, pool_capacity="1GiB",
                  cache_entries=max(65536, 1 << (2 * sum(nch.values()) + 1).bit_length()),
                  switchd_args=("--no-coalesce", "--policy", "off"))
        with lab:
            dp = DataPlane(pinned_deployment(lab.topo.pin_dir), programs=False)
            try:
                for m, n in nch.items():
                    data = _block(n, cs)
                    fill_cache(Cache(dp), NS, _key(f"b{m}"), 0, n, n)
                    sealed = auth.seal(AUTH_KEY, NS_AUTH, _key(f"a{m}"), data, cs)
                    Cache(dp).put_chunks(NS_AUTH, _key(f"a{m}"), 0, np.frombuffer(
                        sealed, np.uint8).reshape(-1, cs), len(sealed) // cs)
            finally:
                dp.bpf.cleanup()
            with FetchEngine(lab.pool_addrs, cs, netns=lab.topo.node("h1").netns,
                             arena_bytes=2 * sum(n + 1 for n in nch.values()) * cs,
                             auth=auth.Keyring({NS_AUTH: AUTH_KEY})) as e:
                for m, n in nch.items():
                    data, pairs = _block(n, cs), reps if m < 8 else max(3, reps // 3)
                    _engine(e, _key(f"b{m}"), n, data, 2)                       # warm
                    _engine(e, _key(f"a{m}"), n, data, 2, ns=NS_AUTH)
                    runs = {"plain": [], "auth": []}
                    for _ in range(pairs):
                        runs["plain"].append(_engine(e, _key(f"b{m}"), n, data, 1))
                        runs["auth"].append(_engine(e, _key(f"a{m}"), n, data, 1, ns=NS_AUTH))
                    s = {k: _merge(v) for k, v in runs.items()}
                    row = {"chunk_bytes": cs, "block_bytes": n * cs, "pairs": pairs,
                           "plain_gbytes_per_s": _gbps(n * cs, s["plain"]["seconds"]),
                           "auth_gbytes_per_s": _gbps(n * cs, s["auth"]["seconds"]),
                           "byte_exact": s["plain"]["exact"] and s["auth"]["exact"],
                           "plain_cpu_ms_per_fetch": s["plain"]["cpu_ms_per_fetch"],
                           "auth_cpu_ms_per_fetch": s["auth"]["cpu_ms_per_fetch"],
                           "timeouts": s["plain"]["timeouts"] + s["auth"]["timeouts"]}
                    row["auth_vs_plain"] = row["plain_gbytes_per_s"] and round(
                        row["auth_gbytes_per_s"] / row["plain_gbytes_per_s"], 3)
                    out.append(row)
                    log(f"  {cs} B, {m} MiB: plain {row['plain_gbytes_per_s']} GB/s, with "
                        f"authentication {row['auth_gbytes_per_s']} GB/s: x{row['auth_vs_plain']}")
    res = {"results": out, "load_average_before": [round(x, 2) for x in load0],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "seconds": round(time.monotonic() - started, 1)}
    write_json(json_path, res)
    return res


if __name__ == "__main__":
    import sys
    auth_ab(json_path=sys.argv[1] if len(sys.argv) > 1 else None)
