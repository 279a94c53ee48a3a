"""Keyed block authentication (hostagent/common/auth.py), pure Python: a sealed block opens with the
key, namespace and block key it was sealed for and nothing else; any change to its data, length
or header is rejected; the streaming check agrees with the one-shot one; key files and the
process's keyring; request ids of the fetch engine and the asyncio client are random and not
reused."""
import asyncio
import os
import secrets

import pytest

from hostagent.common import auth
from hostagent.common.auth import AuthError, KeyFileError
from hostagent.inference.client import KVClient
from hostagent.inference.fetch.ids import RequestIds

K = bytes(range(32))
NS, KEY = 7, bytes.fromhex("00112233445566778899aabbccddeeff")
CS = 1024
DATA = bytes((i * 13 + 5) & 0xFF for i in range(5 * CS + 300))


def sealed(data=DATA, k=K, ns=NS, key=KEY, cs=CS):
    return auth.seal(k, ns, key, data, cs)


def test_round_trip_and_layout():
    b = sealed()
    assert len(b) == auth.data_offset(CS) + len(DATA) == CS + len(DATA)
    assert b[:4] == auth.MAGIC and b[auth.HEADER_LEN:CS] == bytes(CS - auth.HEADER_LEN)
    assert bytes(auth.open_sealed(K, NS, KEY, b, CS)) == DATA
    # the data starts on a chunk boundary: one chunk more than the data's at these sizes
    for cs in (48, 1024, 3072):
        assert auth.sealed_chunks(3, cs) == 4
    assert auth.header_chunks(8) == 6 and auth.data_offset(40) == 80
    # two seals of the same data differ (random nonce), both open
    b2 = sealed()
    assert b2 != b and bytes(auth.open_sealed(K, NS, KEY, b2, CS)) == DATA


def _flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1:]


@pytest.mark.parametrize("what", ["key", "ns", "block key", "data first byte", "data last byte",
                                  "data middle", "truncated", "extended", "nonce", "tag",
                                  "length field", "magic", "algorithm", "unsealed",
                                  "another block's seal", "chunk size"])
def test_anything_changed_is_rejected(what):
    b, k, ns, key, cs = sealed(), K, NS, KEY, CS
    if what == "key":
        k = bytes(32)
    elif what == "ns":
        ns = NS + 1
    elif what == "block key":
        key = KEY[:-1] + b"\x00"
    elif what == "data first byte":
        b = _flip(b, CS)
    elif what == "data last byte":
        b = _flip(b, len(b) - 1)
    elif what == "data middle":
        b = _flip(b, CS + 3000)
    elif what == "truncated":
        b = b[:-1]
    elif what == "extended":
        b = b + b"\x00"
    elif what == "nonce":
        b = _flip(b, 25)
    elif what == "tag":
        b = _flip(b, 40)
    elif what == "length field":
        b = b[:12] + (len(DATA) - 1).to_bytes(8, "big") + b[20:len(b) - 1]
    elif what == "magic":
        b = _flip(b, 0)
    elif what == "algorithm":
        b = _flip(b, 4)
    elif what == "unsealed":
        b = bytes(CS) + DATA
    elif what == "another block's seal":
        b = sealed(key=bytes(16))
    elif what == "chunk size":
        cs = 512
    with pytest.raises(AuthError):
        auth.open_sealed(k, ns, key, b, cs)


def test_streaming_check_in_pieces_equals_one_shot():
    b = sealed()
    for step in (1, 777, CS, len(DATA)):
        c = auth.StreamCheck(K, NS, KEY, CS)
        c.start(b[:CS], stored_chunks=-(-len(b) // CS))
        for i in range(CS, len(b), step):
            c.feed(b[i:i + step])
        c.finish()


def test_streaming_check_rejects_wrong_count_and_short_feed():
    b = sealed()
    with pytest.raises(AuthError):
        auth.StreamCheck(K, NS, KEY, CS).start(b[:CS], stored_chunks=-(-len(b) // CS) + 1)
    c = auth.StreamCheck(K, NS, KEY, CS)
    c.start(b[:CS])
    c.feed(b[CS:-1])
    with pytest.raises(AuthError):
        c.finish()
    c = auth.StreamCheck(K, NS, KEY, CS)
    c.start(b[:CS])
    c.feed(_flip(b, len(b) - 5)[CS:])
    with pytest.raises(AuthError, match="tag mismatch"):
        c.finish()


def test_keyring_namespaces_and_master_derivation():
    ring = auth.parse_keys(f"# keys\n3 {'ab' * 32}\n* {'cd' * 32}  # the rest\n")
    assert ring.key_for(3) == bytes.fromhex("ab" * 32)
    k4, k5 = ring.key_for(4), ring.key_for(5)
    assert len(k4) == 32 and k4 != k5 and k4 != ring.master and ring.key_for(4) == k4
    only = auth.parse_keys(f"3 {'ab' * 32}\n")
    assert only.covers(3) and not only.covers(4) and only.key_for(4) is None
    assert auth.parse_keys("ef" * 32).master == bytes.fromhex("ef" * 32)
    # a block sealed for namespace 4 under the master's derived key does not open in 5
    b = auth.seal(k4, 4, KEY, DATA, CS)
    with pytest.raises(AuthError):
        auth.open_sealed(k5, 4, KEY, b, CS)


@pytest.mark.parametrize("text", ["", "# nothing\n", "abc", "1 2 3", "x " + "ab" * 32,
                                  "4294967296 " + "ab" * 32, "ab" * 31, "zz" * 32])
def test_bad_key_files_give_one_clear_error(text):
    with pytest.raises(KeyFileError):
        auth.parse_keys(text)


def test_key_file_permissions_and_the_process_keyring(tmp_path, monkeypatch):
    p = tmp_path / "k"
    p.write_text("ab" * 32 + "\n")
    os.chmod(p, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        auth.load_keyring(p)
    os.chmod(p, 0o600)
    assert auth.load_keyring(p).master == bytes.fromhex("ab" * 32)
    with pytest.raises(KeyFileError, match="No such file"):
        auth.load_keyring(tmp_path / "missing")
    monkeypatch.setattr(auth, "_configured", [])
    monkeypatch.setenv(auth.ENV, str(p))
    assert auth.current().master == bytes.fromhex("ab" * 32)
    assert KVClient(["127.0.0.1"]).keyring is auth.current()
    assert KVClient(["127.0.0.1"], auth=None).keyring is None
    auth.configure()                                    # off for this process
    assert auth.current() is None and KVClient(["127.0.0.1"]).keyring is None
    ring = auth.Keyring({1: K})
    auth.configure(keyring=ring)
    assert auth.resolve(auth.DEFAULT) is ring


def test_a_key_file_used_for_a_namespace_must_have_its_key(tmp_path, monkeypatch):
    """``keyring_for``, every connector's rule: the key file (else the process's keyring) must
    load and cover the namespace; a file that lacks it is refused, in one line naming both,
    instead of leaving the namespace's blocks unsealed and unchecked."""
    p = tmp_path / "k"
    p.write_text(f"3 {'ab' * 32}\n")
    os.chmod(p, 0o600)
    assert auth.keyring_for(3, p).key_for(3) == bytes.fromhex("ab" * 32)
    with pytest.raises(KeyFileError) as e:
        auth.keyring_for(4, p)
    assert str(e.value) == (f"key file {p} has no key for namespace 4 (no '4 <hex key>' line "
                            "and no master key): its blocks would be neither sealed nor checked")
    master = tmp_path / "m"
    master.write_text(f"* {'cd' * 32}\n")
    os.chmod(master, 0o600)
    assert auth.keyring_for(0, master).covers(0) and auth.keyring_for(2 ** 32 - 1, master)
    monkeypatch.setattr(auth, "_configured", [])
    monkeypatch.delenv(auth.ENV, raising=False)
    assert auth.keyring_for(4) is None                  # no key file anywhere: off
    monkeypatch.setattr(auth, "_configured", [])
    monkeypatch.setenv(auth.ENV, str(p))
    with pytest.raises(KeyFileError, match=r"^\$KVSWITCH_AUTH_KEY_FILE: key file .* has no key "
                                           r"for namespace 4 "):
        auth.keyring_for(4)
    assert auth.keyring_for(3) is auth.current()
    os.chmod(p, 0o644)
    monkeypatch.setattr(auth, "_configured", [])
    with pytest.raises(KeyFileError, match=r"^\$KVSWITCH_AUTH_KEY_FILE: key file .*: readable"):
        auth.keyring_for(3)
    auth.configure(keyring=auth.Keyring({1: K}))
    with pytest.raises(KeyFileError, match="^the keyring given to hostagent.common.auth."
                                           "configure has no key for namespace 2 "):
        auth.keyring_for(2)


def test_fetch_engine_request_ids_are_random_and_not_reused():
    ids = RequestIds(256, (1 << 24) - 1, hold=100.0)
    idxs = [ids.take_index() for _ in range(256)]
    assert sorted(idxs) == list(range(256)) and idxs != sorted(idxs) and not ids
    for i in idxs:
        ids.give_index(i)
    gens = [ids.generation(3, now=0.0) for _ in range(1000)]
    assert len(set(gens)) > 990 and all(0 < g < 1 << 24 for g in gens)
    steps = {b - a for a, b in zip(gens, gens[1:])}
    assert len(steps) > 900, "generations must not follow a pattern"
    # a retired (index, generation) pair is not drawn again while it is held
    small = RequestIds(4, 3, hold=100.0)                # 3 generations only
    small.retire(0, 1, now=0.0)
    small.retire(0, 2, now=0.0)
    assert {small.generation(0, now=1.0) for _ in range(50)} == {3}
    assert {small.generation(0, now=200.0) for _ in range(200)} == {1, 2, 3}   # expired


def test_asyncio_client_request_ids_are_random_and_not_reused():
    c = KVClient(["127.0.0.1"])
    rids = [c._next_rid() for _ in range(2000)]
    assert len(set(rids)) == len(rids)
    assert len({b - a for a, b in zip(rids, rids[1:])}) > 1900, "not sequential"
    c._waiters[rids[0]] = object()
    c._retire_rid(rids[0])
    assert rids[0] in c._retired
    real = secrets.randbits
    try:
        seq = iter([rids[0], rids[0], 12345])          # the held id is drawn: skipped
        secrets.randbits = lambda n: next(seq)
        assert c._next_rid() == 12345
    finally:
        secrets.randbits = real


# ---- the asyncio client over loopback (a real pool server, no kernel tier) --------------------
def _with_pool(body):
    from hostagent.pool.server import PoolServer
    from hostagent.pool.store import BlockStore

    async def go():
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: PoolServer(BlockStore(16 << 20)), local_addr=("127.0.0.1", 0))
        try:
            return await body(transport.get_extra_info("sockname"))
        finally:
            transport.close()

    return asyncio.run(go())


def test_asyncio_client_seals_checks_and_refuses_a_forged_block():
    ring = auth.Keyring({NS: K})

    async def body(addr):
        async with KVClient([addr], CS, deadline=10, auth=ring) as c, \
                KVClient([addr], CS, deadline=10, auth=None) as raw:
            await c.put_block(NS, KEY, DATA)
            stored, _ = await raw.get_block(NS, KEY)
            assert stored[:4] == auth.MAGIC and stored[CS:] == DATA     # sealed at the pool
            got, stats = await c.get_block(NS, KEY, nchunks=-(-len(DATA) // CS))
            assert got == DATA and stats.auth_failures == 0
            other = bytes(16)                                          # another namespace:
            await c.put_block(NS + 1, other, DATA)                     # not sealed
            assert (await raw.get_block(NS + 1, other))[0] == DATA
            forged = bytearray(stored)
            forged[CS + 10] ^= 0xFF                                     # CRC made to match
            key2 = bytes(range(16))
            await raw.put_block(NS, key2, bytes(forged))
            with pytest.raises(AuthError, match="also when fetched past the switch"):
                await c.get_block(NS, key2)

    _with_pool(body)
