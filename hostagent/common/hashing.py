"""Chained prefix hashing of token sequences into 128-bit block keys, in the style of vLLM.

A sequence is cut into blocks of ``block_tokens`` tokens (only full blocks get a key, as in vLLM:
a partial tail block is never shared). Block i's key covers its parent's key, so equal keys mean
equal prefixes, not just equal blocks:

    key_0 = H(ROOT      || extra || tokens_0)
    key_i = H(key_{i-1} || extra || tokens_i)

where H(x) = SHA-256(b"kvpool/v1" || x) truncated to its first 16 bytes, ROOT is 16 zero bytes,
tokens are unsigned 32-bit little-endian integers, and ``extra`` is an optional, length-prefixed
byte string that separates caches that must never mix (model id, LoRA adapter, ...).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DOMAIN = b"kvpool/v1"
ROOT = bytes(16)
DEFAULT_BLOCK_TOKENS = 16


def block_hashes(tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 extra: bytes = b"", parent: bytes = ROOT) -> list[bytes]:
    """The chained keys of every full block of ``tokens``."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    if len(parent) != 16:
        raise ValueError("parent key must be 16 bytes")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of integers")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in 32 bits unsigned")
    packed = arr.astype("<u4").tobytes()
    extra_field = len(extra).to_bytes(4, "little") + extra
    keys, step = [], 4 * block_tokens
    for start in range(0, (arr.size // block_tokens) * step, step):
        block = packed[start:start + step]
        parent = hashlib.sha256(DOMAIN + parent + extra_field + block).digest()[:16]
        keys.append(parent)
    return keys


# Position-independent passage keys (CacheBlend, hostagent/inference/blend.py): a passage's KV
# computed at positions 0.. is stored under keys of its tokens alone, wherever it appears in a
# prompt.
#     digest = SHA-256(PASSAGE_DOMAIN || len(extra) || extra || len(tokens) || tokens)
#     key_i  = SHA-256(PASSAGE_DOMAIN || digest || i)[:16]       (i: the passage's i-th block)
# Every hashed input starts with PASSAGE_DOMAIN, which differs from DOMAIN at byte 7, so a
# passage key equals a prefix key only if SHA-256 collides.
PASSAGE_DOMAIN = b"kvpool/passage/v1"


def passage_keys(tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 extra: bytes = b"") -> list[bytes]:
    """The keys of a passage's blocks (the last one may be partial: it is padded)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("a passage is a non-empty flat sequence of integers")
    if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
        raise ValueError("token ids must fit in 32 bits unsigned")
    digest = hashlib.sha256(PASSAGE_DOMAIN + len(extra).to_bytes(4, "little") + extra +
                            arr.size.to_bytes(4, "little") + arr.astype("<u4").tobytes()).digest()
    return [hashlib.sha256(PASSAGE_DOMAIN + digest + i.to_bytes(4, "little")).digest()[:16]
            for i in range(-(-arr.size // block_tokens))]
