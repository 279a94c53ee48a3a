"""Chained prefix hashing against fixed vectors (SHA-256 of the documented byte layout)."""
import hashlib

import pytest

from hostagent.common.hashing import ROOT, block_hashes


def _by_hand(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    body = b"".join(t.to_bytes(4, "little") for t in tokens)
    return hashlib.sha256(b"kvpool/v1" + parent + len(extra).to_bytes(4, "little") + extra +
                          body).digest()[:16]


def test_fixed_vectors():
    keys = block_hashes(list(range(40)), block_tokens=16)
    assert [k.hex() for k in keys] == [
        "59127feb09fc1621888e41b779a2b0dc",
        "ab67c956f1cca3b9f7b3f2effed55ec3",
    ]
    assert len(keys) == 2  # the 8-token tail is not a full block
    assert keys[0] == _by_hand(ROOT, list(range(16)))
    assert keys[1] == _by_hand(keys[0], list(range(16, 32)))


def test_prefix_chaining():
    a = block_hashes([1] * 32 + [2] * 16)
    b = block_hashes([1] * 32 + [3] * 16)
    c = block_hashes([9] * 16 + [1] * 16)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[1] != a[1], "same block after a different prefix must get another key"


def test_extra_keys_separate_caches():
    assert block_hashes([5] * 16, extra=b"llama-3-8b") != block_hashes([5] * 16, extra=b"lora-1")


@pytest.mark.parametrize("tokens", [[-1] * 16, [2 ** 32] * 16])
def test_token_ids_must_fit_u32(tokens):
    with pytest.raises(ValueError):
        block_hashes(tokens)
