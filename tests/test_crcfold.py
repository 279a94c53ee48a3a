"""Folding chunk CRCs into the CRC of their concatenation (hostagent.inference.fetch.crcfold), which
the fetch engine's verification rests on: pure Python, checked against zlib."""
import random
import zlib

import numpy as np
import pytest

from hostagent.inference.fetch.crcfold import CRC_IMPL, Folder, combine, crc32


def test_combine_is_zlibs_crc32_combine():
    rng = random.Random(1)
    for la, lb in [(0, 5), (5, 0), (1, 1), (1000, 777), (3072, 3072)]:
        a, b = rng.randbytes(la), rng.randbytes(lb)
        assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_the_crc_in_use_is_zlibs():
    data = random.Random(3).randbytes(10_000)
    assert crc32(data) == zlib.crc32(data) and CRC_IMPL in ("isal", "zlib-ng", "zlib")


@pytest.mark.parametrize("chunk", [8, 1024, 3072])
def test_fold_is_the_crc_of_the_concatenation(chunk):
    f = Folder(chunk, span=64)
    rng = random.Random(chunk)
    for m in (1, 2, 3, 7, 63, 64):
        data = rng.randbytes(chunk * m)
        crcs = np.array([zlib.crc32(data[i * chunk:(i + 1) * chunk]) for i in range(m)],
                        np.uint32)
        assert f.fold(crcs) == zlib.crc32(data)
    with pytest.raises(ValueError):
        f.fold(np.zeros(65, np.uint32))


def test_bad_chunks_finds_exactly_the_corrupted_ones():
    chunk = 1024
    f = Folder(chunk, span=16)
    data = bytearray(random.Random(2).randbytes(chunk * 40))
    crcs = np.array([zlib.crc32(data[i * chunk:(i + 1) * chunk]) for i in range(40)], np.uint32)
    assert f.bad_chunks(memoryview(data), crcs) == []
    data[3 * chunk + 10] ^= 1
    data[39 * chunk] ^= 0x80
    assert f.bad_chunks(memoryview(data), crcs) == [3, 39]      # runs of 16, 16 and 8
    crcs[17] ^= 1                                    # a wrong CRC is a bad chunk too
    assert f.bad_chunks(memoryview(data), crcs) == [3, 17, 39]
    assert Folder(chunk).bad_chunks(memoryview(data), crcs) == [3, 17, 39]   # one run of 40


def test_bad_chunks_checks_runs_with_holes_between_them():
    """A lossy round leaves runs of every length (single chunks too) with holes between them;
    each chunk is checked against its own CRC whatever run it falls in."""
    chunk = 512
    f = Folder(chunk, span=8)
    rng = random.Random(5)
    data = bytearray(rng.randbytes(chunk * 60))
    crcs = np.array([zlib.crc32(data[i * chunk:(i + 1) * chunk]) for i in range(60)], np.uint32)
    for trial in range(20):
        idx = np.array(sorted(rng.sample(range(60), rng.randint(1, 60))), np.int64)
        assert f.bad_chunks(memoryview(data), crcs[idx], idx) == []
        broken = sorted(rng.sample(idx.tolist(), min(3, idx.size)))
        for b in broken:
            data[b * chunk + rng.randrange(chunk)] ^= 1 << rng.randrange(8)
        assert f.bad_chunks(memoryview(data), crcs[idx], idx) == broken
        for b in broken:
            data[b * chunk:(b + 1) * chunk] = bytes(chunk)
            crcs[b] = zlib.crc32(bytes(chunk))
