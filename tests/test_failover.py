"""Placement and failover in the product's clients (hostagent.common.pools): which nodes hold a
block, a silent node left out with a back-off, and the asyncio client against real pool nodes
over loopback UDP: a PUT to every holder, a GET that moves on from a silent holder within its
silence limit (the old client waited out the deadline), from a holder that lost the block, and
the options that set it checked in one line."""
import asyncio
import os
import socket
import time

import pytest

from conftest import local_pool
from hostagent.common.pools import Placement, pool_for, rendezvous
from hostagent.common.transfer import BlockNotFound, NoAnswer, Silent
from hostagent.inference.client import KVClient

POOLS = [("198.18.0.101", 19286), ("198.18.0.102", 19286), ("198.18.0.103", 19286)]
KEY = bytes(range(16))


def test_holders_are_the_first_replicas_of_the_rendezvous_order():
    key = os.urandom(16)
    order = rendezvous(POOLS, 5, key)
    assert sorted(order) == sorted(POOLS) and order[0] == pool_for(POOLS, 5, key)
    assert rendezvous(list(reversed(POOLS)), 5, key) == order      # not the list's order
    p = Placement(POOLS, replicas=2)
    assert p.holders(5, key) == order[:2] and p.read_order(5, key) == order[:2]
    shared = Placement(POOLS, shared=True)       # one store behind every node: any reads
    assert shared.holders(5, key) == order[:1] and shared.read_order(5, key) == order
    spread = Placement(POOLS, replicas=3, spread=True)
    firsts = {spread.read_order(5, key)[0] for _ in range(60)}
    assert firsts == set(POOLS)                  # every holder serves the hot block's readers


@pytest.mark.parametrize("replicas", [0, 4])
def test_replicas_beyond_the_pool_are_refused(replicas):
    with pytest.raises(ValueError, match=r"replicas .* not in 1\.\.3"):
        Placement(POOLS, replicas=replicas)


def test_a_silent_node_goes_to_the_end_and_its_back_off_doubles(caplog):
    p = Placement(POOLS, replicas=3, retry_s=0.05)
    key = os.urandom(16)
    first, *rest = p.read_order(1, key)
    caplog.set_level("WARNING", logger="kvswitch.pools")
    p.failed(first, "read", NoAnswer("nothing"))
    assert p.read_order(1, key) == rest and not p.usable(first)      # not asked meanwhile
    p.failed(first, "read", NoAnswer("nothing"))          # failing again: twice as long
    assert p._down[first][1] == pytest.approx(0.1)
    time.sleep(0.12)
    assert p.usable(first) and p.read_order(1, key)[0] == first       # asked again
    assert p.suspect(first) and p.read_order(1, key, wary=True) == rest   # not by the wary
    p.answered(first)
    assert not p.suspect(first) and p.read_order(1, key, wary=True)[0] == first
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said                  # one line when it goes, one when it is back
    assert "does not answer" in said[0] and "asked of the next node holding them" in said[0]
    assert said[1].endswith("answers again")
    assert not p.readable(1, key) or p.usable(first)


def _silent_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s


def _key_first_on(place: Placement, addr) -> bytes:
    while True:
        key = os.urandom(16)
        if place.read_order(1, key)[0] == addr:
            return key


def test_a_put_reaches_every_holder_and_a_get_moves_on_from_a_silent_one():
    """Two live nodes take a PUT each; with one of three holders silent, a GET that asks it
    first moves on after the silence limit (0.3 s here, the deadline 20 s) and gets the
    block byte-exact; the silent node is then left out, so the next GET does not wait."""
    quiet = _silent_socket()
    data = os.urandom(50_000)

    async def body():
        async with local_pool() as a, local_pool() as b:
            addrs = [a.sock.getsockname(), b.sock.getsockname(), quiet.getsockname()]
            writer = Placement([f"{h}:{p}" for h, p in addrs[:2]], replicas=2)
            async with KVClient(writer, chunk_size=1024, deadline=20) as c:
                put = await c.put_block(1, KEY, data)
            assert put.chunks == 2 * 49                  # both holders acknowledged every chunk
            assert all(len(x.store) == 1 for x in (a, b))
            place = Placement([f"{h}:{p}" for h, p in addrs], replicas=3, silence_s=0.3)
            silent = (addrs[2][0], addrs[2][1])
            async with KVClient(place, chunk_size=1024, deadline=20) as c:
                t0 = time.monotonic()
                got, _ = await _get_asking_first(c, place, silent)
                first = time.monotonic() - t0
                t0 = time.monotonic()
                again, _ = await c.get_block(1, KEY)
                second = time.monotonic() - t0
            return got, again, first, second, place.usable(silent)

    got, again, first, second, usable = asyncio.run(body())
    quiet.close()
    assert got == data and again == data
    assert 0.3 <= first < 3.0, first             # one silence, not the 20 s deadline
    assert second < 0.3 and not usable, second   # the silent node is left out


async def _get_asking_first(c: KVClient, place: Placement, addr):
    """``c.get_block(1, KEY)`` with ``addr`` asked first (read_order pinned for the call)."""
    real = place.read_order

    def pinned(ns, key, wary=False):
        order = real(ns, key, wary)
        return [addr] + [a for a in order if a != addr]
    place.read_order = pinned
    try:
        return await c.get_block(1, KEY)
    finally:
        place.read_order = real


def test_a_holder_that_lost_the_block_sends_the_get_to_the_next():
    """A holder restarted empty answers NOT_FOUND: the block comes from its other holder; with
    one holder NOT_FOUND is the answer (BlockNotFound), and a silent lone holder fails with
    NoAnswer at the deadline rather than moving on to nobody."""
    data = os.urandom(10_000)
    quiet = _silent_socket()

    async def body():
        async with local_pool() as a, local_pool() as b:
            addrs = [f"{h}:{p}" for h, p in (a.sock.getsockname(), b.sock.getsockname())]
            place = Placement(addrs, replicas=2)
            holders = place.holders(1, KEY)
            async with KVClient([f"{holders[1][0]}:{holders[1][1]}"], 1024) as c:
                await c.put_block(1, KEY, data)          # on the second holder alone
            async with KVClient(place, 1024, deadline=5) as c:
                got, stats = await c.get_block(1, KEY)
            async with KVClient([f"{holders[0][0]}:{holders[0][1]}"], 1024) as c:
                with pytest.raises(BlockNotFound):
                    await c.get_block(1, KEY)
            lone = "%s:%d" % quiet.getsockname()
            async with KVClient([lone], 1024, deadline=0.5) as c:
                with pytest.raises(NoAnswer) as e:
                    await c.get_block(1, KEY)
            assert not isinstance(e.value, Silent)
            return got, stats

    got, stats = asyncio.run(body())
    quiet.close()
    assert got == data and stats.from_pool == 10


def test_a_put_skips_a_silent_holder_and_fails_fast_when_none_answers():
    quiet = _silent_socket()
    data = os.urandom(5_000)

    async def body():
        async with local_pool() as a:
            live = "%s:%d" % a.sock.getsockname()
            place = Placement([live, "%s:%d" % quiet.getsockname()], replicas=2,
                              silence_s=0.3)
            async with KVClient(place, 1024, deadline=20) as c:
                t0 = time.monotonic()
                put = await c.put_block(1, KEY, data)     # the silent one is not waited for
                took = time.monotonic() - t0
                place.failed(place.pools[0], "save", NoAnswer("test"))
                t1 = time.monotonic()
                with pytest.raises(Silent, match="no node holding block"):
                    await c.put_block(1, bytes(16), data)
                none = time.monotonic() - t1
            return put, took, none, len(a.store)

    put, took, none, stored = asyncio.run(body())
    quiet.close()
    assert put.chunks == 5 and stored == 1
    assert took < 3.0 and none < 0.05, (took, none)


@pytest.mark.parametrize("extra,said", [
    ({"replicas": 3}, "'replicas': 3 is not an integer in 1..2"),
    ({"replicas": 0}, "'replicas': 0 is not an integer in 1..2"),
    ({"replicas": "2"}, "'replicas': '2' is not an integer in 1..2"),
    ({"shared_store": "yes"}, "'shared_store': 'yes' is not true or false"),
    ({"silence_s": 0}, "'silence_s': 0 is not a number of seconds"),
])
def test_the_connectors_refuse_a_bad_placement_in_one_line(extra, said):
    from hostagent.inference.connectors.store import StoreConfigError, StoreSettings
    from hostagent.inference.connectors.vllm_blocks import Settings, SettingsError
    opts = {"pools": ["198.18.0.101", "198.18.0.102"], **extra}
    with pytest.raises(SettingsError) as e:
        Settings.from_extra(opts)
    assert said in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(StoreConfigError) as e:
        StoreSettings.from_options(opts, "lmcache")
    assert said in str(e.value)
    good = Settings.from_extra({"pools": opts["pools"], "replicas": 2, "shared_store": False,
                                "silence_s": 0.5})
    assert good.replicas == 2 and good.silence_s == 0.5


def test_hostagent_refuses_more_replicas_than_pools():
    from click.testing import CliRunner
    from hostagent.cli import main
    r = CliRunner().invoke(main, ["get", "--pool", "198.18.0.101", "--key", "00" * 16,
                                  "--replicas", "2"])
    assert r.exit_code == 2 and "2 replicas, but 1 --pool node(s)" in r.output


def test_a_left_out_holder_is_not_asked_and_a_suspect_is_bounded_by_the_silence():
    """The stall a killed pool node caused under `vllm serve` (bench vllm --workload busy): a
    block its live holder lacks was asked of the silent one, the last holder, until the deadline
    (the scheduler's probe, every step). Now: while the silent node is left out the live
    holder's NOT_FOUND is the answer at once; past its back-off it is asked again but, a suspect,
    only for the silence limit; a wary caller never asks it; a background check (``due`` then
    ``recheck``) claims it once and learns whether it answers."""
    quiet = _silent_socket()

    async def body():
        async with local_pool() as a:
            live, silent = a.sock.getsockname(), quiet.getsockname()
            place = Placement([f"{h}:{p}" for h, p in (live, silent)], replicas=2,
                              silence_s=0.3, retry_s=0.2)
            out = {}
            async with KVClient(place, 1024, deadline=20) as c:
                place.failed(silent, "read", NoAnswer("killed"))
                t0 = time.monotonic()
                with pytest.raises(BlockNotFound):
                    await c.get_block(1, KEY)                 # the live holder's answer
                out["left_out"] = time.monotonic() - t0
                await asyncio.sleep(0.25)                     # the back-off is over
                assert place.read_order(1, KEY, wary=True) == [live]
                real = place.read_order                       # the live node asked first
                place.read_order = lambda ns, key, wary=False: [
                    x for x in (live, silent) if x in real(ns, key, wary)]
                t0 = time.monotonic()
                with pytest.raises(Silent):
                    await c.get_block(1, KEY)                 # NOT_FOUND, then the suspect
                out["suspect"] = time.monotonic() - t0
                place.read_order = real
                out["backoff"] = place._down[silent][1]
                place._down[silent] = (0.0, out["backoff"])   # past its back-off again
                assert place.due(1, KEY) == silent and place.due(1, KEY) is None   # once
                await c.recheck(silent, 1, KEY)
                out["rechecked"] = place._down[silent][1]
                place.failed(live, "read", NoAnswer("a test's"))
                await c.recheck(live, 1, KEY)                 # NOT_FOUND is an answer
                out["live_suspect"] = place.suspect(live)
            return out

    out = asyncio.run(body())
    quiet.close()
    assert out["left_out"] < 0.25, out               # not one silence, let alone the deadline
    assert 0.3 <= out["suspect"] < 2.0, out          # the silence limit, not the 20 s deadline
    assert out["backoff"] == pytest.approx(0.4) and out["rechecked"] == pytest.approx(0.8)
    assert not out["live_suspect"]


def test_the_switchs_answers_in_a_nodes_name_do_not_clear_its_suspicion():
    """The switch answers a GET for a chunk it holds in the pool node's name (FROM_SWITCH): that
    says nothing of the node, which stays a suspect; a reply of its own clears it."""
    import dataclasses
    from kvproto import Flag, Message
    data = os.urandom(3_000)

    async def body():
        async with local_pool() as a:
            addr = a.sock.getsockname()
            place = Placement(["%s:%d" % addr])
            async with KVClient(place, 1024, deadline=5) as c:
                await c.put_block(1, KEY, data)
                place.failed(addr, "read", NoAnswer("a test's"))
                place._down[addr] = (0.0, 5.0)                # its back-off is over
                real = a.send

                def as_switch(parts, to):         # one datagram, in parts
                    m = Message.decode(b"".join(parts))
                    real([dataclasses.replace(m, flags=m.flags | Flag.FROM_SWITCH).encode()], to)
                a.send = as_switch
                got, _ = await c.get_block(1, KEY)
                after_switch = place.suspect(addr)
                a.send = real
                again, _ = await c.get_block(1, KEY)
            return got, again, after_switch, place.suspect(addr)

    got, again, after_switch, after_node = asyncio.run(body())
    assert got == data == again and after_switch and not after_node


def test_a_node_another_client_hears_from_is_not_taken_for_silent():
    """The placement's ``heard`` is every client's: a node whose server is too busy to answer
    this transfer while it answers another client (the fetch engine's GETs, served in its
    kernel) is not silent; once nobody hears from it, one silence moves the read on."""
    quiet = _silent_socket()

    async def body():
        async with local_pool() as a:
            live, silent = a.sock.getsockname(), quiet.getsockname()
            place = Placement([f"{h}:{p}" for h, p in (silent, live)], replicas=2,
                              silence_s=0.3)
            async with KVClient([f"{h}:{p}" for h, p in (live,)], 1024) as w:
                await w.put_block(1, KEY, b"x" * 3000)
            heard_until = time.monotonic() + 1.0

            async def other_client():                 # replies to "the engine" for 1 s
                while time.monotonic() < heard_until:
                    place.heard[silent] = time.monotonic()
                    await asyncio.sleep(0.05)
            beat = asyncio.ensure_future(other_client())
            async with KVClient(place, 1024, deadline=20) as c:
                t0 = time.monotonic()
                got, _ = await _get_asking_first(c, place, silent)
                took = time.monotonic() - t0
            await beat
            return got, took

    got, took = asyncio.run(body())
    quiet.close()
    assert got == b"x" * 3000 and 1.2 <= took < 3.0, took   # heard for 1 s, then one silence


def test_when_every_holder_went_silent_the_last_is_waited_for():
    """Every holder a suspect at once (the reader's own cable, say): no holder is ``doubtful``,
    and the last one asked is waited for until the deadline instead of one silence (the link
    may be back by then); a suspect beside an answering holder is doubtful."""
    q1, q2 = _silent_socket(), _silent_socket()
    a1, a2 = q1.getsockname(), q2.getsockname()
    place = Placement([f"{h}:{p}" for h, p in (a1, a2)], replicas=2, silence_s=0.3)
    place.failed(a1, "read", NoAnswer("a test's"))
    assert place.doubtful(a1, 1, KEY) and not place.doubtful(a2, 1, KEY)
    place.failed(a2, "read", NoAnswer("a test's"))
    assert not place.doubtful(a1, 1, KEY) and not place.doubtful(a2, 1, KEY)

    async def body():
        async with KVClient(place, 1024, deadline=1.5) as c:
            t0 = time.monotonic()
            with pytest.raises(NoAnswer):
                await c.get_block(1, KEY)
            return time.monotonic() - t0

    took = asyncio.run(body())
    q1.close()
    q2.close()
    assert 1.4 <= took < 3.0, took          # the deadline, not two silences (0.6 s)
