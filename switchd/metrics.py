"""Prometheus metrics of a running switch, read from the maps at scrape time: packet and hit
counters, bytes served, hit ratio, admissions, evictions and occupancy, per namespace."""
from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from .dataplane import DataPlane
from .manager import CacheManager


class SwitchCollector:
    def __init__(self, dp: DataPlane, manager: CacheManager | None):
        self.dp, self.manager = dp, manager

    def collect(self):
        counters = self.dp.counters()
        total = CounterMetricFamily("kvswitch_data_plane", "Data-plane counters (kvproto.h "
                                    "KV_STAT_*)", labels=["counter"])
        for name, value in counters.items():
            total.add_metric([name], value)
        yield total
        hits = CounterMetricFamily("kvswitch_hits", "GETs answered by the switch", labels=["ns"])
        misses = CounterMetricFamily("kvswitch_misses", "GETs the switch could not answer",
                                     labels=["ns"])
        served = CounterMetricFamily("kvswitch_served_bytes", "Payload bytes served by the switch",
                                     labels=["ns"])
        ratio = GaugeMetricFamily("kvswitch_hit_ratio", "Hits / (hits + misses) since start",
                                  labels=["ns"])
        for ns, c in sorted(self.manager.popularity.ns_counters().items()
                            if self.manager else []):
            label = [str(ns)]
            hits.add_metric(label, c["hits"])
            misses.add_metric(label, c["misses"])
            served.add_metric(label, c["hit_bytes"])
            asked = c["hits"] + c["misses"]
            ratio.add_metric(label, c["hits"] / asked if asked else 0.0)
        yield from (hits, misses, served, ratio)
        occupancy = GaugeMetricFamily("kvswitch_cached_chunks", "Chunks held", labels=["ns"])
        quota = GaugeMetricFamily("kvswitch_quota_chunks", "Chunk quota (0: shared space)",
                                  labels=["ns"])
        if self.manager:
            for ns, u in sorted(self.manager.usage().items()):
                occupancy.add_metric([str(ns)], u["chunks"])
                quota.add_metric([str(ns)], u["quota_chunks"])
            yield CounterMetricFamily("kvswitch_admissions", "Blocks admitted by the policy",
                                      value=self.manager.admissions)
            yield CounterMetricFamily("kvswitch_evictions", "Blocks evicted by the policy",
                                      value=self.manager.evictions)
        yield occupancy
        yield quota
        yield GaugeMetricFamily("kvswitch_capacity_chunks", "Chunks the cache holds",
                                value=self.dp.deployment.cache_entries)


def serve_metrics(port: int, dp: DataPlane, manager: CacheManager | None,
                  addr: str = "0.0.0.0") -> None:
    REGISTRY.register(SwitchCollector(dp, manager))
    start_http_server(port, addr=addr)
