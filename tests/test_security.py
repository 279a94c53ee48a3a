"""Tenant isolation and port security end to end, attacked the way a tenant could from its own
port (testbed.security crafts the frames inside the attacker's namespace): requests for another
tenant's namespace wrapped in IP options, fragments or a VLAN tag, frames with another host's
source, and rounds opened toward an address nobody answers. The pool node's own request counters
are the ground truth of what got through."""
import os
import time

import pytest

from conftest import leaves_no_namespaces
from testbed.lab import Lab
from testbed.security import WRAPPINGS

pytestmark = pytest.mark.e2e

VICTIM_NS, ATTACKER_NS = 1, 2
CHUNKS = 8


@pytest.fixture(scope="module")
def lab():
    """h1: tenant 1; h2: tenant 2, its port limited to namespace 2; both ports bound to their
    host's source. h3: another host of tenant 1 on a port without checks, where every crafted
    frame must work (the control)."""
    with leaves_no_namespaces(f"sec{os.getpid() % 10000}") as prefix, \
            Lab(prefix, hosts=3, pools=1, switch=False) as running:
        binds = [a for h in ("h1", "h2") for a in
                 ("--port-bind", f"{h}={running.mac(h)},{running.topo.node(h).ip}")]
        running.start_switch("--port-ns", f"h2={ATTACKER_NS}", *binds)
        yield running


@pytest.fixture(scope="module")
def block(lab):
    key, data = os.urandom(16), os.urandom(CHUNKS * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    return key, data


def _attack(lab, node, kind, op, key, source=None):
    return lab.task(node, "testbed.security:foreign_requests", kind, op, lab.pool_addrs[0],
                    lab.mac("p1"), VICTIM_NS, key.hex() if op == "get" else os.urandom(16).hex(),
                    CHUNKS, 1024, 1.0, source)


@pytest.mark.parametrize("op", ["get", "put"])
@pytest.mark.parametrize("kind", WRAPPINGS)
def test_no_cross_tenant_request_gets_through(lab, block, kind, op):
    key, _ = block
    control = _attack(lab, "h3", kind, op, key)       # the same frames from a port without checks
    assert control["replies" if op == "get" else "acks"] == CHUNKS, \
        f"{kind} {op}s must work from a port of the namespace, else this test proves nothing"
    before = lab.pool_counters()
    attack = _attack(lab, "h2", kind, op, key)
    spoofed = _attack(lab, "h2", kind, op, key, source=(lab.mac("h1"), lab.topo.node("h1").ip))
    after = lab.pool_counters()
    assert attack["replies"] == attack["acks"] == spoofed["replies"] == spoofed["acks"] == 0
    for counter in ("rx_get", "rx_put"):
        assert after.get(counter, 0) == before.get(counter, 0), f"{counter} reached the pool"
    stats = lab.stats()
    assert stats["spoofed"] > 0 and (stats["unchecked"] > 0 or stats["denied"] > 0)


def test_a_host_impersonating_another_captures_none_of_its_replies(lab):
    key, data = os.urandom(16), os.urandom(300 * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    spoofed_before = lab.stats()["spoofed"]
    thief = lab.start_task("h2", "testbed.security:impersonate", lab.mac("h1"),
                           lab.topo.node("h1").ip, 4.0)
    got, fetched = lab.get("h1", VICTIM_NS, key)
    loot = thief.result(60)
    assert fetched == data and got["chunks"] == 300
    assert loot["captured_kv"] == 0, loot
    assert lab.stats()["spoofed"] - spoofed_before >= loot["sent"]


def test_black_holed_rounds_cannot_stall_another_hosts_fetch(lab):
    """h3 keeps rounds open for every chunk of a block toward an address nobody answers, every
    10 ms; h1's fetch of that block through the switch still completes byte-exact."""
    chunks = 200
    key, data = os.urandom(16), os.urandom(chunks * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    lab.switchd("cache", "admit", "--ns", str(VICTIM_NS), "--key", key.hex())
    before = lab.stats()
    # 20 s of stalling: the victim's `hostagent get` may first compile its fetch engine
    staller = lab.start_task("h3", "testbed.security:stall_rounds", "198.18.0.250",
                             "02:00:00:00:00:fa", VICTIM_NS, key.hex(), chunks, 1024, 20.0)
    deadline = time.monotonic() + 20
    while lab.stats()["coalesced"] < before["coalesced"] + 2 * chunks:   # rounds are held open
        assert time.monotonic() < deadline, "the stalling host never opened rounds"
        time.sleep(0.2)
    got, fetched = lab.get("h1", VICTIM_NS, key, "--deadline", "10")
    stalled = staller.result(60)
    after = lab.stats()
    assert fetched == data and got["from_pool"] + got["from_switch"] == chunks
    assert stalled["rounds"] > 100
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert after["other_dest"] - before["other_dest"] > chunks // 2, ("few GETs met open rounds",
                                                                      moved, got)
