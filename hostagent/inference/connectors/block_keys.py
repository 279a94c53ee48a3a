"""Block keys that carry everything that makes two blocks' KV differ, for both connectors (the
vLLM connector's ``PoolLayout.keys`` and the Hugging Face connector's ``KVConnector.keys``).

Equal tokens do not make equal KV: a LoRA adapter changes the weights, a multimodal input's
placeholder tokens stand for an image or a clip whose embeddings differ, prompt embeddings
replace tokens altogether, and vLLM's ``cache_salt`` keeps tenants' caches apart on purpose.
``KeyExtras`` names those, and ``block_keys`` puts each into the chained keys at the block where
it applies, as vLLM's own prefix-cache hashing does (``generate_block_hash_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py``):

  adapter   ("lora", name, path) in every block
  mm        ("mm", identifier, offset of its first placeholder from the block's start) in each
            block its placeholder tokens overlap
  salt      ("salt", cache_salt) in the first block; the chain carries it to every later one
  embeds    ("embeds", SHA-256 of the block's prompt embeddings) in each block they cover

Block i's key is ``hostagent.common.hashing.block_hashes``'s chain, one block at a time, with
``extra`` the connector's (model id, layout, codec) for a block without items, else

    b"kvkeys/v1" || len(extra) (4 bytes, little-endian) || extra || JSON of the block's items

(compact JSON of ``[[tag, value, ...], ...]``): unambiguous, and a request without extras keeps
the keys it had before, so blocks stored before keys carried extras are still found.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hostagent.common.hashing import ROOT, block_hashes

EXTRAS_DOMAIN = b"kvkeys/v1"


@dataclass(frozen=True)
class MMInput:
    """One multimodal input of a prompt: its content hash and the placeholder tokens it fills
    (vLLM's ``MultiModalFeatureSpec.identifier`` and ``mm_position``)."""
    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class KeyExtras:
    """What besides the tokens a prompt's KV depends on (module docstring)."""
    cache_salt: str | None = None
    adapter: tuple[str, str] | None = None       # (name, path) of a LoRA adapter
    mm: tuple[MMInput, ...] = ()                 # sorted by offset
    embeds: Any = field(default=None, compare=False)   # prompt embeddings [tokens, hidden]
    embeds_id: str | None = None                 # what equality compares for ``embeds``

    def __bool__(self) -> bool:
        return bool(self.cache_salt or self.adapter or self.mm or self.embeds is not None)

    def items(self, start: int, end: int) -> list[list]:
        """The items of the block of tokens ``start``..``end``."""
        out: list[list] = []
        if self.adapter:
            out.append(["lora", *self.adapter])
        for m in self.mm:
            if m.offset < end and start < m.offset + m.length:
                out.append(["mm", m.identifier, m.offset - start])
        if start == 0 and self.cache_salt:
            out.append(["salt", self.cache_salt])
        if self.embeds is not None and start < len(self.embeds):
            out.append(["embeds", _embeds_digest(self.embeds[start:end])])
        return out


NO_EXTRAS = KeyExtras()


def with_embeds(extras: KeyExtras, embeds) -> KeyExtras:
    """``extras`` plus prompt embeddings (compared by their digest)."""
    from dataclasses import replace
    return replace(extras, embeds=embeds, embeds_id=_embeds_digest(embeds))


def block_keys(tokens: Sequence[int], block_tokens: int, extra: bytes,
               extras: KeyExtras | None = None) -> list[bytes]:
    """The chained keys of every full block of ``tokens`` (module docstring)."""
    if not extras:
        return block_hashes(tokens, block_tokens, extra=extra)
    tokens = list(tokens)
    head = EXTRAS_DOMAIN + len(extra).to_bytes(4, "little") + extra
    keys, parent = [], ROOT
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        end = start + block_tokens
        items = extras.items(start, end)
        own = head + json.dumps(items, separators=(",", ":")).encode() if items else extra
        [parent] = block_hashes(tokens[start:end], block_tokens, extra=own, parent=parent)
        keys.append(parent)
    return keys


def _embeds_digest(embeds) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (hex)."""
    import torch
    t = embeds.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def vllm_request_extras(request) -> KeyExtras:
    """The extras of a vLLM ``Request`` (``vllm.v1.request``; read by attribute, so this module
    never imports vLLM): its ``cache_salt``, ``lora_request`` (name and path, as vLLM's own
    hashing), ``mm_features`` (identifier and placeholder range) and ``prompt_embeds``."""
    lora = getattr(request, "lora_request", None)
    mm = tuple(sorted((MMInput(str(f.identifier), int(f.mm_position.offset),
                               int(f.mm_position.length))
                       for f in getattr(request, "mm_features", None) or ()),
                      key=lambda m: (m.offset, m.identifier)))
    extras = KeyExtras(getattr(request, "cache_salt", None) or None,
                       (str(lora.lora_name), str(lora.lora_path or "")) if lora else None, mm)
    embeds = getattr(request, "prompt_embeds", None)
    return with_embeds(extras, embeds) if embeds is not None else extras


__all__ = ["KeyExtras", "MMInput", "NO_EXTRAS", "block_keys", "vllm_request_extras",
           "with_embeds"]
