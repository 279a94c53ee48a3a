"""PUT assembly on a pool node (hostagent.pool.assembly): chunks in any order, once; budgets per
namespace, per source and node-wide, charged in real memory; the largest holder gives way when
the node runs out; full-size chunks but the last; expiry on progress only."""
import pytest

from hostagent.pool.assembly import (BLOCK_OVERHEAD, CHUNK_OVERHEAD, Assembler, PutBudgets,
                                     StoreError)
from kvproto import Status, checksum

KEY = bytes(range(16))


def _put(a, chunk, n, payload, key=KEY):
    return a.add(1, key, chunk, n, payload, checksum(payload))


def test_assembler_takes_chunks_in_any_order_once():
    a = Assembler(1 << 20, 10)
    assert not _put(a, 2, 3, b"z")                               # the short last chunk first
    assert not _put(a, 0, 3, b"xx")
    assert not _put(a, 0, 3, b"xx")                              # retransmission
    with pytest.raises(StoreError, match="immutable"):
        _put(a, 0, 3, b"yy")
    with pytest.raises(StoreError, match="one size"):
        _put(a, 1, 3, b"yyy")
    with pytest.raises(StoreError, match="block has 3 chunks"):
        _put(a, 1, 4, b"yy")
    assert _put(a, 1, 3, b"yy")
    assert a.take(1, KEY) == (2, [b"xx", b"yy", b"z"], [checksum(c) for c in (b"xx", b"yy",
                                                                              b"z")])
    assert a.used == 0 and len(a) == 0
    with pytest.raises(StoreError, match="longer than the others"):
        _put(a, 0, 2, b"ab")
        _put(a, 1, 2, b"abc")
    with pytest.raises(StoreError, match="at least one byte"):
        _put(a, 0, 2, b"", key=bytes(16))


def test_assembler_is_bounded_and_drops_stale_blocks():
    now = [0.0]
    unit = 6 + CHUNK_OVERHEAD + BLOCK_OVERHEAD               # what a new block's first chunk costs
    whole = 6 + 6 + 1 + 3 * CHUNK_OVERHEAD + BLOCK_OVERHEAD     # the least 3 chunks can need
    a = Assembler(PutBudgets(total=whole + 100, per_ns=10 ** 6, per_source=10 ** 6, timeout=5),
                  max_block=100, clock=lambda: now[0])
    _put(a, 0, 3, b"x" * 6)
    assert a.used == unit and a.payload_bytes == 6
    with pytest.raises(StoreError) as e:                          # a second block does not fit
        _put(a, 0, 3, b"y" * 6, key=bytes(16))
    assert e.value.status == Status.NO_SPACE
    with pytest.raises(StoreError, match="larger than the 100 bytes"):
        _put(a, 0, 20, b"y" * 6, key=bytes(16))
    now[0] = 4.0
    _put(a, 2, 3, b"x" * 2)                                      # progress: not stale yet
    now[0] = 8.0
    for _ in range(5):
        _put(a, 0, 3, b"x" * 6)                                  # re-sent: not progress
    now[0] = 9.5
    assert a.expire() == 1 and a.used == 0 and a.expired_blocks == 1
    assert a.counters["resent_chunks"] == 5
    now[0] = 20.0
    _put(a, 0, 2, b"q" * 6)
    now[0] = 30.0
    _put(a, 0, 2, b"r" * 6, key=bytes(16))                       # room made by expiring
    assert len(a) == 1


def _src_put(a, ns, key, chunk, n, payload, source):
    return a.add(ns, key, chunk, n, payload, checksum(payload), source)


def test_one_tenant_filling_its_budgets_leaves_another_room():
    """Namespace 2 (from h2) fills its byte and block budgets: its own PUTs are refused NO_SPACE,
    namespace 1's are not; a source is bounded across namespaces too."""
    budgets = PutBudgets(total=1 << 20, per_ns=256 << 10, per_source=300 << 10, blocks=64,
                         blocks_per_ns=8, blocks_per_source=12, timeout=10)
    a = Assembler(budgets, clock=lambda: 0.0)
    refused = 0
    for i in range(400):                                          # many incomplete blocks
        try:
            _src_put(a, 2, i.to_bytes(16, "big"), 0, 64, bytes(1024), "h2")
        except StoreError as e:
            assert e.status == Status.NO_SPACE
            refused += 1
    assert refused == 400 - 8 and a.ns_blocks[2] == 8 and a.counters["refused_ns"] == refused
    with pytest.raises(StoreError, match="namespace 2 holds"):    # their other chunks
        for i in range(8):
            for c in range(1, 63):
                _src_put(a, 2, i.to_bytes(16, "big"), c, 64, bytes(1024), "h2")
    assert a.ns_bytes[2] <= budgets.per_ns and a.ns_bytes[2] > budgets.per_ns - 2048
    for c in range(3):                                            # the other tenant is unaffected
        assert not _src_put(a, 1, KEY, c, 4, bytes(1024), "h1")
    assert _src_put(a, 1, KEY, 3, 4, bytes(10), "h1")
    with pytest.raises(StoreError, match="h2 holds"):             # h2 in another namespace:
        for i in range(20):                                       # its source budget binds
            _src_put(a, 3, i.to_bytes(16, "big"), 0, 64, bytes(1024), "h2")


def test_when_the_node_budget_runs_out_the_largest_holder_gives_way():
    """Tenants together over the node-wide budget: a smaller tenant's PUT takes the largest
    holder's oldest incomplete block; the largest holder itself is refused."""
    now = [0.0]
    budgets = PutBudgets(total=64 << 10, per_ns=40 << 10, per_source=1 << 20, blocks=8,
                         blocks_per_ns=8, blocks_per_source=8, timeout=10)
    a = Assembler(budgets, clock=lambda: now[0])
    for ns in (2, 3):
        for i in range(4):
            now[0] += 0.1
            _src_put(a, ns, i.to_bytes(16, "big"), 0, 8, bytes(1024), f"h{ns}")
    assert len(a) == 8                                            # every block slot is taken
    _src_put(a, 1, KEY, 0, 4, bytes(1024), "h1")                  # ns 1 holds none: room made
    assert a.counters["reclaimed_blocks"] == 1 and (2, (0).to_bytes(16, "big")) not in a
    with pytest.raises(StoreError, match="incomplete blocks are waiting"):   # ns 3: the largest
        _src_put(a, 3, (9).to_bytes(16, "big"), 0, 8, bytes(1024), "h3")
    assert a.counters["refused_total"] == 1


def test_chunks_are_full_size_but_the_last():
    a = Assembler(PutBudgets(chunk_size=1024))
    with pytest.raises(StoreError, match="this pool's chunks are 1024 bytes") as e:
        _put(a, 0, 4, bytes(1000))                                # short, not the last
    assert e.value.status == Status.BAD_REQUEST
    with pytest.raises(StoreError, match="longer than the others"):
        _put(a, 3, 4, bytes(1030))                                # the last, too long
    assert not _put(a, 3, 4, bytes(10)) and not _put(a, 0, 4, bytes(1024))
    with pytest.raises(StoreError, match="pool's chunks"):
        _put(a, 0, 1, bytes(2000), key=bytes(16))                 # a one-chunk block, too long
    b = Assembler(PutBudgets())                                   # no pool size: the block's
    assert not _put(b, 1, 3, bytes(512))
    with pytest.raises(StoreError, match="one size"):
        _put(b, 0, 3, bytes(511))                                 # a short one in the middle
    _put(b, 2, 3, bytes(2), key=bytes(16))                        # the last first: a floor
    with pytest.raises(StoreError, match="one size"):
        _put(b, 0, 3, bytes(1), key=bytes(16))                    # a full chunk under it


def test_what_a_chunk_costs_is_what_it_takes_in_memory():
    """The accounting is real memory: 50,000 tiny chunks grow Python's heap by about what the
    assembler charges for them (not ~200 times the payload, as when only payload counted)."""
    import gc
    import tracemalloc
    n, size = 50_000, 8
    a = Assembler(PutBudgets(total=1 << 30, per_ns=1 << 30, per_source=1 << 30), clock=lambda: 0.0)
    datagrams = [bytes(48) + i.to_bytes(size, "little") for i in range(n)]
    crcs = [checksum(d[48:]) for d in datagrams]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(n):                                  # payloads cut from datagrams, as decoded
        a.add(1, KEY, i, n + 1, datagrams[i][48:], crcs[i] | 0x80000000, "h2")
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert a.payload_bytes == n * size
    ratio = grown / a.used
    print(f"heap growth {grown} bytes for {a.used} charged ({ratio:.2f} per charged byte, "
          f"{grown / n:.0f} per {size}-byte chunk)")
    assert 0.6 < ratio <= 1.0, (grown, a.used)
