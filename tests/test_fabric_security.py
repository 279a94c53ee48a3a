"""Tenant isolation across a fabric (issue 63), end to end on two racks of two hosts behind rack
switches and a pool-side switch, every switch started with --port-security alone (no static
bindings). Before: a rack host whose first frame carried the pool node's identity got its port
bound to it and received the PUTs of hosts in both racks; a host of rack 2 claiming a rack-1
host's source received that host's replies. Now the rack switch's uplink owns the pool node (it
declares what is behind it) and the pool-side switch's downlinks own their racks' hosts: both
attacks capture nothing, and the victims' PUTs and GETs go on."""
import json
import os
import time

import pytest

from conftest import leaves_no_namespaces
from testbed.lab.fabric import FabricLab

pytestmark = pytest.mark.e2e

NS = 1
CHUNK = 1024


@pytest.fixture(scope="module")
def fabric():
    with leaves_no_namespaces(f"fs{os.getpid() % 100000}") as prefix, \
            FabricLab(prefix, racks=2, hosts_per_rack=2, pools=1, chunk_size=CHUNK,
                      switchd_args=("--port-security",)) as lab:
        yield lab


def ports(lab, box: str) -> dict:
    out = lab.box_switchd(box, "port", "ls", "--json").stdout
    return {r["port"]: r for r in json.loads(out)["ports"]}


def test_a_rack_host_speaking_first_as_the_pool_node_is_refused(fabric):
    lab = fabric
    assert ports(lab, "r1")["h2"]["mac"] is None, "h2 has not spoken yet"
    thief = lab.start_task("h2", "testbed.security:impersonate", lab.mac("p1"),
                           lab.pool_addrs[0], 4.0)
    time.sleep(0.5)
    blocks = {}
    for node in ("h1", "h3"):                   # h2's rack mate, and a host of the other rack
        key, data = os.urandom(16), os.urandom(64 * CHUNK)
        lab.put(node, NS, key, data)
        blocks[node] = (key, data)
    loot = thief.result(60)
    assert loot["captured_kv"] == 0, loot
    assert ports(lab, "r1")["h2"]["mac"] != lab.mac("p1"), "h2 bound to the pool's identity"
    for node, (key, data) in blocks.items():
        got, fetched = lab.get(node, NS, key, "--no-cache")
        assert fetched == data, node
    assert lab.box_counters("r1")["src_taken"] > 0


def test_a_host_of_rack_2_claiming_a_rack_1_host_gets_none_of_its_replies(fabric):
    """h4's first frame claims h1's identity (its port is unbound until then)."""
    lab = fabric
    assert ports(lab, "r2")["h4"]["mac"] is None, "h4 has not spoken yet"
    key, data = os.urandom(16), os.urandom(96 * CHUNK)
    lab.put("h1", NS, key, data)                 # h1 has spoken: rack 1's downlink owns it

    def refused():                               # by rack 2's switch (its uplink carried h1's
        return lab.box_counters("r2")["src_taken"] + lab.counters()["src_taken"]   # ARP) or agg

    before = refused()
    thief = lab.start_task("h4", "testbed.security:impersonate", lab.mac("h1"),
                           lab.topo.node("h1").ip, 4.0)
    time.sleep(0.5)
    for _ in range(3):                           # uncached fetches: every chunk from the pool
        got, fetched = lab.get("h1", NS, key, "--no-cache")
        assert fetched == data and got["chunks"] == 96
    loot = thief.result(60)
    assert loot["captured_kv"] == 0, loot
    assert refused() > before, "the claim was dropped on its way"
    assert ports(lab, "r2")["h4"]["mac"] != lab.mac("h1"), "h4 bound to h1's identity"
