"""The Python codec and the C header agree: struct kvhdr as BCC compiles it has the codec's field
order, offsets and sizes, and the cache value header is what switchd assumes."""
import ctypes

import pytest

import xdp

from kvproto import FIELDS, HEADER, HEADER_LEN
from switchd.dataplane import CACHE_VAL_HEADER, DataPlane, Deployment

pytestmark = pytest.mark.bpf


def _struct_layout(ctype):
    return [(name, getattr(ctype, name).offset, getattr(ctype, name).size)
            for name, _ in ctype._fields_]


def _codec_layout():
    import struct
    out, offset = [], 0
    for name, code in zip(FIELDS, ["H", "B", "B", "H", "H", "I", "I", "16s", "I", "I", "H", "H",
                                   "I"]):
        size = struct.calcsize("!" + code)
        out.append((name, offset, size))
        offset += size
    assert offset == HEADER.size
    return out


def test_kvhdr_matches_the_codec():
    from bcc import BPF
    b = BPF(text=b'#include "kvproto.h"\nBPF_ARRAY(probe, struct kvhdr, 1);',
            cflags=xdp.cflags())
    leaf = b.get_table(b"probe").Leaf
    assert ctypes.sizeof(leaf) == HEADER_LEN
    assert _struct_layout(leaf) == _codec_layout()
    assert HEADER.format == "!HBBHHII16sIIHHI"


@pytest.mark.parametrize("chunk", [256, 1024, 3072])
def test_cache_value_is_header_plus_chunk(chunk):
    dp = DataPlane(Deployment(chunk_size=chunk, cache_entries=16, pin_dir=None), programs=False)
    assert ctypes.sizeof(dp.cache.Leaf) == CACHE_VAL_HEADER + chunk
    assert dp.cache.Leaf.data.offset == CACHE_VAL_HEADER
    assert ctypes.sizeof(dp.pending.Key) == 24             # struct kv_cache_key
    assert ctypes.sizeof(dp.blocks.Leaf) == 16             # struct kv_block
