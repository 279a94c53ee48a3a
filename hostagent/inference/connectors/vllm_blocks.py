"""The vLLM connector's pure part (never vLLM): settings, the pool block layout and its
keys, and the scheduler's plan mapping pool blocks onto vLLM's paged blocks
(``connectors.paged_kv`` copies between them). ``connectors.vllm``
is the vLLM glue.

Blocks and keys are those of the Hugging Face connector (``hostagent.inference.connectors.hf``): a
pool block holds ``block_tokens`` consecutive prompt tokens for every layer, one C-contiguous array
of the KV dtype shaped ``[layers, 2 (K, V), kv_heads, block_tokens, head_dim]`` (keys after RoPE),
and its key is the chained prefix hash of the tokens with ``extra`` = model id + ``|`` + layout
tag + codec tag, and, at the blocks where they apply, the request's ``cache_salt``, LoRA adapter,
multimodal inputs and prompt embeddings (``connectors.block_keys``, the key function
both connectors share). ``block_tokens`` is a multiple of vLLM's block size (``ratio`` vLLM
blocks per pool block).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproto import DEFAULT_CHUNK
from . import options
from .block_keys import KeyExtras, block_keys
from ..block_layout import BlockLayout


# ---- settings ------------------------------------------------------------------------------
class SettingsError(ValueError):
    """A bad ``kv_connector_extra_config``: one line that names the key (None: the whole)."""

    def __init__(self, key: str | None, why: str):
        super().__init__("kvswitch connector: " + (f"kv_connector_extra_config key {key!r}: "
                                                   if key else "") + why)


def resolve_load_mode(mode: str, multiprocessing: bool | None = None) -> str:
    """``load_mode`` as it applies here: ``auto`` is async where vLLM runs its engine core in a
    process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING``, on by default: ``vllm serve``),
    sync where it runs in the caller's (``multiprocessing``: that setting; None reads vLLM's)."""
    if mode != "auto":
        return mode
    if multiprocessing is None:
        from vllm import envs
        multiprocessing = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
    return "async" if multiprocessing else "sync"


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked. Only ``pools`` is required."""
    pools: tuple[str, ...]
    namespace: int = options.DEFAULT_NS   # 0..2^32-1, as every connector's (options.namespace)
    chunk_size: int = DEFAULT_CHUNK    # must be the switch's --chunk-size for hits
    window: int = 64                   # chunks in flight per block
    concurrency: int = 4               # blocks in flight per load or save
    probe_window: int = 64             # chunk-0 probes in flight
    deadline: float = 10.0             # seconds for one block before its load fails (>= 1 ms)
    probe_deadline: float = 2.0        # seconds the scheduler waits for a probe at most (ditto)
    retry_s: float = 5.0               # a silent pool node is asked again after this (doubling)
    silence_s: float = 1.0             # a transfer unanswered this long asks the next holder
    replicas: int = 1                  # pool nodes holding each block (1..len(pools))
    shared_store: bool = False         # pool nodes on one Mooncake Store: any node reads any
    model_id: str | None = None        # names the weights; default: vLLM's model and revision
    block_tokens: int | None = None    # pool block tokens; default: vLLM's block size
    max_pending_save_mib: int = 256    # saves copied out but not yet acknowledged
    fetch_engine: str = "auto"         # auto: the XDP fetch engine where it can run; off
    kv_codec: str = "none"             # none, int8, fp8, int4, int4h, NAME/gTOKENS, pca[/xN][@C]
    load_failure: str = "recompute"    # a block that cannot be loaded: recompute, or fail
    load_mode: str = "auto"            # async: loads beside the engine's steps; sync: in them;
    #                                    auto: async where the engine core has its own process
    auth_key_file: str | None = None   # keyed authentication; default $KVSWITCH_AUTH_KEY_FILE

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        """The settings of a ``kv_connector_extra_config``, checked as every connector's
        options (``hostagent.inference.connectors.options``); SettingsError names the first bad key
        (unknown, of the wrong type, out of range, an address that does not resolve or is no
        node's, a key file that cannot be used or has no key for the namespace), or the whole
        when it is not a mapping."""
        try:
            extra = options.mapping(extra, "kv_connector_extra_config")
            options.known(extra, cls.__dataclass_fields__, "key")
            pools = options.common(
                extra, {"window": (1, 1 << 16), "concurrency": (1, 1024),
                        "probe_window": (1, 1 << 16), "block_tokens": (1, 1 << 20),
                        "max_pending_save_mib": (1, 1 << 20)},
                '["IP[:PORT]", ...]', {"fetch_engine": ("auto", "off"),
                                       "load_failure": ("recompute", "fail"),
                                       "load_mode": ("auto", "async", "sync")})
            options.kv_codec(extra.get("kv_codec", "none"))
        except options.BadOption as exc:
            raise SettingsError(exc.key, exc.why) from None
        return cls(**{**extra, "pools": pools})

    def keyring(self):
        """The clients' ``auth``: the key file's keyring, else the process's (None: off)."""
        from hostagent.common import auth
        return auth.keyring_for(self.namespace, self.auth_key_file)


# ---- layout and keys -----------------------------------------------------------------------
@dataclass(frozen=True)
class PoolLayout(BlockLayout):
    """The pool block layout (``BlockLayout``, the Hugging Face connector's) with vLLM's
    paged block size (``vllm_block``, a pool block is ``ratio`` of them) and the pool's codec."""
    vllm_block: int                    # vLLM's paged block
    kv_codec: str = "none"             # the pool's coding of blocks (hostagent.inference.codec)

    def __post_init__(self):
        if self.block_tokens < 1 or self.block_tokens % self.vllm_block:
            raise ValueError(f"block_tokens {self.block_tokens} must be a positive multiple of "
                             f"vLLM's block_size {self.vllm_block}")
        from ..codec import make
        object.__setattr__(self, "codec", make(self.kv_codec, self.layers, self.kv_heads,
                                               self.block_tokens, self.head_dim, self.dtype))

    @property
    def ratio(self) -> int:
        return self.block_tokens // self.vllm_block

    def extra(self, model_id: str) -> bytes:
        """What block keys carry besides the tokens: model id, layout tag and codec tag (so a
        reader with another codec misses instead of decoding another codec's bytes)."""
        return model_id.encode() + b"|" + self.tag() + self.codec.tag()

    @property
    def coded_bytes(self) -> int:
        """Bytes of a block in the pool (coded)."""
        return self.codec.nbytes

    def keys(self, tokens: Sequence[int], model_id: str,
             extras: KeyExtras | None = None) -> list[bytes]:
        """The chained keys of every full pool block of ``tokens`` (with a request's
        ``extras``: ``hostagent.inference.connectors.block_keys``)."""
        return block_keys(tokens, self.block_tokens, self.extra(model_id), extras)

    def nchunks(self, chunk_size: int) -> int:
        return -(-self.coded_bytes // chunk_size)


# ---- the scheduler's plan ------------------------------------------------------------------
@dataclass
class LoadSpec:
    """Fetch ``keys`` (pool blocks ``first``.. of the request) into vLLM blocks: ``targets[j]``
    lists (sub-block within pool block j, vLLM block id) to write."""
    req_id: str
    keys: list[bytes]
    first: int
    targets: list[list[tuple[int, int]]]
    tokens: int                        # tokens this load provides


@dataclass
class SaveSpec:
    """Put ``keys`` (pool blocks ``first``..), pool block j read from vLLM blocks ``ids[j]``."""
    req_id: str
    keys: list[bytes]
    first: int
    ids: list[list[int]]


@dataclass
class Plan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Tracked:                        # a scheduled request
    keys: list[bytes]                  # every full pool block of its prompt
    block_ids: list[int]               # its vLLM blocks (group 0), from the first
    saved: int                         # leading pool blocks the pool has (found or saved)


def load_targets(layout: PoolLayout, start: int, end: int,
                 block_ids: Sequence[int]) -> list[list[tuple[int, int]]]:
    """For tokens ``start``..``end`` (``end`` on a pool block boundary, ``start`` on a vLLM
    block boundary: vLLM holds the tokens before it), the vLLM blocks each pool block fills."""
    bt, bs, r = layout.block_tokens, layout.vllm_block, layout.ratio
    if end % bt or start % bs or not 0 <= start < end:
        raise ValueError(f"cannot load tokens {start}..{end} with {bt}-token pool blocks")
    return [[(s, block_ids[j * r + s]) for s in range(r) if (j * r + s) * bs >= start]
            for j in range(start // bt, end // bt)]


class Planner:
    """What each scheduled request loads and saves, from what the probe found and what vLLM
    allocated. Loads: only the first step of a (new or resumed) request, or, asynchronously,
    right after vLLM allocated its blocks (``take_load``), the request waiting meanwhile. Saves:
    each full prompt block once all its tokens are computed, unless the pool already had it.
    A request's keys carry its extras (``register``); one whose extras were never registered is
    not saved, so a tenant's KV is never put under keys without its salt."""

    def __init__(self, layout: PoolLayout, model_id: str, load: bool = True,
                 save: bool = True):
        self.layout, self.model_id, self.load, self.save = layout, model_id, load, save
        self._extras: dict[str, KeyExtras] = {}                    # req -> its key extras
        self._matched: dict[str, tuple[list[bytes], int]] = {}   # req -> (keys, found)
        self._loads: dict[str, tuple[int, int]] = {}               # req -> token range
        self._tracked: dict[str, _Tracked] = {}
        self._async_loaded: set[str] = set()   # loaded ahead: vLLM's count says what landed
        self._saving: set[str] = set()         # requests with a save planned

    def register(self, req_id: str, extras: KeyExtras) -> None:
        """What besides its tokens a request's KV depends on (its keys carry it)."""
        self._extras[req_id] = extras

    def keys(self, tokens: Sequence[int], extras: KeyExtras | None = None) -> list[bytes]:
        return self.layout.keys(tokens, self.model_id, extras)

    def request_keys(self, req_id: str, tokens: Sequence[int]) -> list[bytes] | None:
        """A registered request's keys (None: not registered)."""
        extras = self._extras.get(req_id)
        return None if extras is None else self.keys(tokens, extras)

    def loadable(self, prompt_len: int) -> int:
        """Pool blocks a prompt can load: never its last token, whose logits are computed."""
        return max(0, prompt_len - 1) // self.layout.block_tokens

    def matched(self, req_id: str, keys: list[bytes], found: int, num_computed: int) -> int:
        """Record that the pool has the first ``found`` blocks; tokens to load beyond the
        ``num_computed`` vLLM already holds (none when this side does not load; a producer
        probes only not to save again what the pool has)."""
        self._matched[req_id] = (keys, found)
        return max(0, found * self.layout.block_tokens - num_computed) if self.load else 0

    def allocated(self, req_id: str, num_external: int) -> None:
        if num_external > 0:
            _, found = self._matched[req_id]
            end = found * self.layout.block_tokens
            self._loads[req_id] = (end - num_external, end)

    def take_load(self, req_id: str, block_ids: Sequence[int]) -> LoadSpec | None:
        """The load of a request whose blocks vLLM just allocated (``block_ids``, group 0, from
        the first), to run while it waits; None if it loads nothing."""
        if req_id not in self._loads:
            return None
        keys, _ = self._matched[req_id]
        self._async_loaded.add(req_id)
        self._saving.discard(req_id)    # preempted before: its copies were finished then
        return self._load_spec(req_id, keys, list(block_ids))

    def build(self, new: Sequence[tuple[str, Sequence[int], Sequence[int], int, int]],
              cached: Sequence[tuple[str, bool, Sequence[int] | None, int, int]],
              finished: Sequence[str] = ()) -> Plan:
        """One step's plan. ``new``: (req id, prompt tokens, vLLM block ids, tokens computed
        before the step, tokens scheduled); ``cached``: (req id, resumed, new block ids or
        None, computed, scheduled); a resumed request's ids are its whole list."""
        plan = Plan()
        for rid, prompt, block_ids, computed, scheduled in new:
            keys, found = self._matched.pop(rid, (None, 0))
            if keys is None:
                keys = (self.request_keys(rid, prompt) or []) if self.save else []
            self._start(plan, rid, keys, found, list(block_ids), computed)
            self._plan_save(plan, rid, computed + scheduled)
        for rid, resumed, block_ids, computed, scheduled in cached:
            tr = self._tracked.get(rid)
            if resumed:
                keys, found = self._matched.pop(rid, (tr.keys if tr else [], 0))
                ids = list(block_ids) if block_ids is not None else (tr.block_ids if tr else [])
                self._start(plan, rid, keys, max(found, tr.saved if tr else 0), ids, computed)
            elif tr is None:
                continue
            elif block_ids:
                tr.block_ids.extend(block_ids)
            self._plan_save(plan, rid, computed + scheduled)
        for rid in finished:            # a load allocated but not yet scheduled waits
            self.forget(rid)
        return plan

    def forget(self, req_id: str) -> bool:
        """Drop a request; True if a save was planned for it since it last waited for a
        load."""
        for d in (self._extras, self._matched, self._loads, self._tracked):
            d.pop(req_id, None)
        self._async_loaded.discard(req_id)
        saving = req_id in self._saving
        self._saving.discard(req_id)
        return saving

    def _load_spec(self, rid: str, keys: list[bytes], block_ids: list[int]) -> LoadSpec:
        start, end = self._loads.pop(rid)
        bt = self.layout.block_tokens
        return LoadSpec(rid, keys[start // bt:end // bt], start // bt,
                        load_targets(self.layout, start, end, block_ids), end - start)

    def _start(self, plan: Plan, rid: str, keys: list[bytes], found: int,
               block_ids: list[int], computed: int) -> None:
        if rid in self._loads:
            plan.loads.append(self._load_spec(rid, keys, block_ids))
        if rid in self._async_loaded:   # a failed block cut vLLM's count: save it again
            self._async_loaded.discard(rid)
            found = min(found, computed // self.layout.block_tokens)
        self._tracked[rid] = _Tracked(keys, block_ids, found)

    def _plan_save(self, plan: Plan, rid: str, computed_after: int) -> None:
        tr = self._tracked[rid]
        upto = min(len(tr.keys), computed_after // self.layout.block_tokens)
        if not self.save or upto <= tr.saved:
            return
        r = self.layout.ratio
        if len(tr.block_ids) < upto * r:
            raise RuntimeError(f"request {rid}: {len(tr.block_ids)} vLLM blocks known, "
                               f"{upto * r} needed to save {upto} pool blocks")
        plan.saves.append(SaveSpec(rid, tr.keys[tr.saved:upto], tr.saved,
                                   [tr.block_ids[j * r:(j + 1) * r]
                                    for j in range(tr.saved, upto)]))
        tr.saved = upto
        self._saving.add(rid)
