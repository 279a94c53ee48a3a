"""Keyed block authentication end to end, on a veth testbed this module creates and always
removes (h1, h2, a pool node, the switch): a forged chunk that gets past every other check is
never handed out. Injected onto the reader's link with the pool node's addresses, the right
request id and a correct CRC (a compromised hop, or a forger that guessed the id), it lands in
the arena and the tag check refuses it: the block is fetched again past the switch and comes
out byte-exact. Put in the switch's cache with a valid CRC (`switchd cache put`), `hostagent get`
refetches past the cache and writes the real block. Stored forged at the pool node, `hostagent
get` exits 1 with one line and writes nothing."""
import json
import os
import random
import socket

import pytest

from conftest import leaves_no_namespaces
from hostagent.common import auth
from hostagent.inference.fetch import FetchEngine
from kvproto import PORT, Flag, Message, Op
from kvproto.frames import ipv4_frame
from testbed.lab import Lab
from testbed.lab.topology import python_argv
from xdp import netns

pytestmark = pytest.mark.e2e

NS, CS = 4, 3072
KEY_TEXT = f"{NS} {'5a' * 32}\n"            # the key file's text: namespace 4's key
RING = auth.parse_keys(KEY_TEXT)


@pytest.fixture(scope="module")
def lab():
    with leaves_no_namespaces(f"fa{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=2, pools=1, chunk_size=CS, pool_capacity="256MiB",
                switchd_args=("--policy", "off")) as running:
        yield running


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("auth") / "ns.key"
    p.write_text(KEY_TEXT)
    os.chmod(p, 0o600)
    return p


def put_sealed(lab, size, seed):
    """A block sealed with the namespace's key, stored as the pool node stores anything."""
    rnd = random.Random(seed)
    key, data = rnd.randbytes(16), rnd.randbytes(size)
    lab.put("h1", NS, key, auth.seal(RING.key_for(NS), NS, key, data, CS))
    return key, data


def inject(lab, frames):
    """Frames sent onto h1's link from the switch's side (past the switch's checks)."""
    with netns.inside(lab.topo.switch_ns):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        try:
            s.bind(("h1", 0))
            for f in frames:
                s.send(f)
        finally:
            s.close()


def test_a_forged_chunk_injected_with_the_pools_addresses_is_never_handed_out(lab):
    key, data = put_sealed(lab, 600_000, seed=1)
    n_data = -(-len(data) // CS)
    with FetchEngine(lab.pool_addrs, CS, netns=lab.topo.node("h1").netns, threaded=False,
                     auth=RING) as e:
        t = e.submit(NS, key, nchunks=n_data)          # the data's chunk count: +1 stored
        assert t.nchunks == n_data + 1
        route = e._routes[(lab.pool_addrs[0], PORT)]
        forged = bytes(CS)                              # chunk 5: zeros, with their own CRC
        msg = Message(Op.GET_REPLY, NS, key, 5, t.nchunks, (t.idx << 24) | t.gen,
                      int(Flag.FROM_SWITCH), payload=forged)
        frame = ipv4_frame(route.mac, e._mac, lab.pool_addrs[0], route.src, PORT, e.port,
                           msg.encode(), ip_id=0)
        before = e.counters()
        inject(lab, [frame])
        e.wait([t])
        after = e.counters()
        assert after["accepted"] > before["accepted"], "the forged chunk must have landed"
        assert t.error is None, t.error
        blk = t.result
        assert blk.tobytes() == data and blk.nchunks == n_data
        assert blk.stats.auth_failures == 1 and blk.stats.checksum_errors == 0
        blk.release()
        # a damaged chunk (its bytes do not match the CRC it carries; CRCs are not checked on
        # the way for an authenticated block): the tag fails, the CRCs find it, it alone is
        # asked again, and the block comes out byte-exact without a second fetch
        t = e.submit(NS, key, nchunks=n_data)
        damaged = Message(Op.GET_REPLY, NS, key, 7, t.nchunks, (t.idx << 24) | t.gen,
                          payload=forged, csum=12345)
        inject(lab, [ipv4_frame(route.mac, e._mac, lab.pool_addrs[0], route.src, PORT, e.port,
                                damaged.encode(), ip_id=0)])
        e.wait([t])
        assert t.error is None, t.error
        assert t.result.tobytes() == data and not t.auth_retried
        assert t.result.stats.auth_failures == 1 and t.result.stats.checksum_errors == 1
        t.result.release()
        # the same frame from another host's address never lands at all
        t = e.submit(NS, key, nchunks=n_data)
        spoof = ipv4_frame("02:00:00:00:99:99", e._mac, "198.18.0.99", route.src, PORT, e.port,
                           Message(Op.GET_REPLY, NS, key, 5, t.nchunks, (t.idx << 24) | t.gen,
                                   payload=forged).encode(), ip_id=0)
        before = e.counters()
        inject(lab, [spoof])
        e.wait([t])
        assert e.counters()["wrong_source"] - before["wrong_source"] >= 1
        assert t.result.tobytes() == data and t.result.stats.auth_failures == 0
        t.result.release()


def _cli_get(lab, node, key, out, key_file):
    r = lab.topo.run(node, python_argv("hostagent", "get", "--pool", lab.pool_addrs[0],
                                       "--chunk-size", str(CS), "--ns", str(NS),
                                       "--key", key.hex(), "--out", str(out),
                                       "--auth-key-file", str(key_file)), check=False)
    return r.returncode, r.stderr.strip().splitlines(), r.stdout


def test_hostagent_get_refetches_past_a_forged_chunk_in_the_switch_cache(lab, key_file,
                                                                         tmp_path):
    key, data = put_sealed(lab, 300_000, seed=2)
    stored = auth.sealed_chunks(-(-len(data) // CS), CS)
    forged = tmp_path / "forged"
    forged.write_bytes(bytes(range(256)) * (CS // 256))
    lab.switchd("cache", "put", "--ns", str(NS), "--key", key.hex(), "--chunk", "3",
                "--nchunks", str(stored), "--file", str(forged))
    out = tmp_path / "out"
    code, lines, stdout = _cli_get(lab, "h2", key, out, key_file)
    assert code == 0, lines
    assert out.read_bytes() == data
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["auth_failures"] == 1, got
    assert any("failed authentication" in ln and "past the switch's cache" in ln
               for ln in lines), lines


def test_hostagent_get_writes_nothing_when_the_pool_holds_a_forged_block(lab, key_file,
                                                                         tmp_path):
    rnd = random.Random(3)
    # an attacker without the key stores its own bytes: unsealed, or sealed with its own key
    for i, sealed in enumerate((False, True)):
        key, data = rnd.randbytes(16), rnd.randbytes(100_000)
        lab.put("h2", NS, key, auth.seal(bytes(32), NS, key, data, CS) if sealed
                else bytes(CS) + data)
        out = tmp_path / f"out{i}"
        code, lines, stdout = _cli_get(lab, "h1", key, out, key_file)
        assert code == 1, (lines, stdout)
        errors = [ln for ln in lines if ln.startswith("hostagent: error:")]
        assert len(errors) == 1 and "failed authentication" in errors[0], lines
        assert "Traceback" not in "\n".join(lines)
        assert not out.exists() or out.stat().st_size == 0
        assert stdout == ""


def test_an_unsealed_block_read_with_its_size_is_refused_as_unauthenticated(lab):
    """A reader passing the data's chunk count (as the connectors do) of a block a keyless
    writer stored: its replies say another chunk count; refused as AuthError, not handed out."""
    rnd = random.Random(4)
    key, data = rnd.randbytes(16), rnd.randbytes(5 * CS)
    lab.put("h2", NS, key, data)
    with FetchEngine(lab.pool_addrs, CS, netns=lab.topo.node("h1").netns, threaded=False,
                     auth=RING) as e:
        with pytest.raises(auth.AuthError, match="not sealed with this namespace's key"):
            e.get_block(NS, key, nchunks=5)
        with FetchEngine(lab.pool_addrs, CS, netns=lab.topo.node("h2").netns,
                         auth=None) as plain:                 # without a key: as it is
            assert plain.get_block(NS, key, nchunks=5).tobytes() == data
