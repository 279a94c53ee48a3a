"""The vLLM connector's numbers in vLLM's own metrics: ``KVSwitchStats`` (vLLM's
``KVConnectorStats``), which the scheduler's connector (probes) and the worker's (loads and
saves) fill and vLLM carries to its stat loggers, and ``KVSwitchPromMetrics``
(``KVConnectorPromMetrics``), which vLLM's Prometheus logger asks the connector class for
(``build_prom_metrics``) and feeds every interval's stats: they appear on ``/metrics`` as

  vllm:kvswitch_blocks_asked_total             pool blocks probed at admission (loadable ones)
  vllm:kvswitch_blocks_found_total             of those, the leading ones the pool or switch had
  vllm:kvswitch_blocks_loaded_total{source}    blocks loaded into the paged cache, by where
                                               their chunks came from: switch, pool, both
  vllm:kvswitch_load_failures_total{reason}    blocks that failed to load: not_cached (the
                                               block was gone), read_failed (anything else)
  vllm:kvswitch_load_bytes_total               bytes fetched by loads
  vllm:kvswitch_load_seconds                   histogram: one request's load, first block
                                               asked to the last one copied
  vllm:kvswitch_blocks_saved_total             blocks the pool acknowledged
  vllm:kvswitch_save_bytes_total               bytes those saves moved
  vllm:kvswitch_save_failures_total{reason}    blocks not saved: failed, refused (another
                                               copy is there), dropped (its node out of use),
                                               shed (too much unacknowledged)

and vLLM's periodic log line ("KV Transfer metrics: ...") carries the interval's sums.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

SOURCES = ("switch", "pool", "both")
LOAD_FAILURES = ("not_cached", "read_failed")
SAVE_FAILURES = ("failed", "refused", "dropped", "shed")
COUNTERS = ("blocks_asked", "blocks_found", "load_bytes", "blocks_saved", "save_bytes",
            *(f"blocks_loaded_{s}" for s in SOURCES),
            *(f"load_failures_{r}" for r in LOAD_FAILURES),
            *(f"save_failures_{r}" for r in SAVE_FAILURES))
LOAD_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class KVSwitchStats(KVConnectorStats):
    """One interval's counts (``COUNTERS``) and load latencies (``load_seconds``), plain ints,
    floats and a list: vLLM sends them between its processes."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {**dict.fromkeys(COUNTERS, 0), "load_seconds": []}

    def count(self, name: str, n: int = 1) -> None:
        self.data[name] = self.data.get(name, 0) + n

    def clone_and_reset(self) -> KVSwitchStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data.get("load_seconds") and not any(self.data.get(k) for k in COUNTERS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d, lat = self.data, sorted(self.data.get("load_seconds", []))
        out = {"blocks asked": d.get("blocks_asked", 0), "found": d.get("blocks_found", 0)}
        out |= {f"loaded from {s}": d.get(f"blocks_loaded_{s}", 0) for s in SOURCES}
        out |= {f"load failed {r}": d.get(f"load_failures_{r}", 0) for r in LOAD_FAILURES}
        out |= {"loads": len(lat), "load MB": round(d.get("load_bytes", 0) / 1e6, 3),
                "load p50 (ms)": round(lat[len(lat) // 2] * 1e3, 1) if lat else 0,
                "blocks saved": d.get("blocks_saved", 0),
                "save MB": round(d.get("save_bytes", 0) / 1e6, 3),
                "saves not made": sum(d.get(f"save_failures_{r}", 0) for r in SAVE_FAILURES)}
        return out


class KVSwitchPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvswitch_*`` metrics (module docstring), one child per engine (and label)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        plain = {"blocks_asked": "Pool blocks the kvswitch connector probed at admission",
                 "blocks_found": "Probed pool blocks the pool or the switch had",
                 "load_bytes": "Bytes the kvswitch connector's loads fetched",
                 "blocks_saved": "Blocks the kvswitch connector saved (acknowledged)",
                 "save_bytes": "Bytes the kvswitch connector's saves moved"}
        for name, doc in plain.items():
            self._add(name, doc, None, {name: ()})
        self._add("blocks_loaded", "Blocks the kvswitch connector loaded, by where their "
                  "chunks came from", "source", {f"blocks_loaded_{s}": (s,) for s in SOURCES})
        self._add("load_failures", "Blocks the kvswitch connector failed to load, by why",
                  "reason", {f"load_failures_{r}": (r,) for r in LOAD_FAILURES})
        self._add("save_failures", "Blocks the kvswitch connector did not save, by why",
                  "reason", {f"save_failures_{r}": (r,) for r in SAVE_FAILURES})
        hist = self._histogram_cls(name="vllm:kvswitch_load_seconds",
                                   documentation="Seconds of one request's kvswitch load",
                                   buckets=list(LOAD_SECONDS_BUCKETS), labelnames=labelnames)
        self._load_seconds = {i: hist.labels(*lv) for i, lv in per_engine_labelvalues.items()}

    def _add(self, name: str, doc: str, label: str | None,
             fields: dict[str, tuple[str, ...]]) -> None:
        metric = self._counter_cls(name=f"vllm:kvswitch_{name}", documentation=doc,
                                   labelnames=self._labelnames + ([label] if label else []))
        for field_name, extra in fields.items():
            self._counters[field_name] = {i: metric.labels(*lv, *extra)
                                          for i, lv in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, children in self._counters.items():
            n = transfer_stats_data.get(name, 0)
            if n:
                children[engine_idx].inc(n)
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self._load_seconds[engine_idx].observe(seconds)
