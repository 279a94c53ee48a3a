"""A fabric of switches end to end (issue 43): two racks of two inference nodes, each behind a
rack switch whose uplink (2:1 oversubscribed) reaches a pool-side switch in front of the pool
node. A block read by all four hosts at once leaves the pool node about once and crosses each
uplink about once, byte-exact; a rack switch whose daemon is killed, or whose program is then
detached, keeps its rack reading through the switch above. Bad fabric shapes get one line."""
import os
import signal

import pytest

from conftest import leaves_no_namespaces
from testbed.lab.fabric import Fabric, FabricLab
from testbed.lab.topology import TestbedError as FabricError, bridge_pass

pytestmark = pytest.mark.e2e

NS = 9
CHUNK = 3072
CHUNKS = 160                        # 0.47 MiB: 0.2 s over the pool's 20 Mbit/s link
HOSTS = ["h1", "h2", "h3", "h4"]


def test_a_block_read_by_every_host_leaves_the_pool_once_and_each_uplink_once():
    key, block = os.urandom(16), os.urandom(CHUNKS * CHUNK)
    with leaves_no_namespaces(f"fb{os.getpid() % 100000}") as prefix, \
            FabricLab(prefix, racks=2, hosts_per_rack=2, pools=1, chunk_size=CHUNK,
                      link_gbit=0.1, pool_link_gbit=0.02) as lab:
        lab.put("h1", NS, key, block)
        egress, gets = lab.link_bytes("p1", "tx"), lab.pool_counters().get("rx_get", 0)
        uplinks = {r: lab.uplink_bytes(r) for r in ("r1", "r2")}
        results = lab.get_many(HOSTS, NS, key, start_delay=5.0)
        upstream = lab.pool_counters()["rx_get"] - gets
        egress = lab.link_bytes("p1", "tx") - egress
        crossed = {r: lab.uplink_bytes(r) - uplinks[r] for r in uplinks}
        racks = {r: lab.box_counters(r) for r in ("r1", "r2")}
        agg = lab.counters()

        assert all(data == block for _, data in results), "every reader byte-exact"
        assert upstream <= 1.05 * CHUNKS, (upstream, agg)
        assert egress <= 1.1 * len(block), (egress / len(block), agg)
        for r, n in crossed.items():
            assert len(block) <= n <= 1.1 * len(block), (r, n / len(block), racks[r])
            assert racks[r]["coalesced"] > 0, (r, racks[r])
        assert agg["coalesced"] > 0, "the two racks' GETs met on the pool side"

        # fail-open per box: r1's daemon killed (its program serves on from the pins), then
        # its program detached (r1 forwards as a plain bridge); r1's hosts read through agg
        lab.stop_box("r1", signal.SIGKILL)
        key2, block2 = os.urandom(16), os.urandom(CHUNKS * CHUNK)
        lab.put("h3", NS, key2, block2)
        assert all(d == block2 for _, d in lab.get_many(["h1", "h2"], NS, key2)), "killed"
        r1 = lab.topo.box("r1")
        lab.box_switchd("r1", "detach", *[a for p in r1.ports for a in ("--port", p)])
        bridge_pass(r1.netns, r1.ports, True)
        before = lab.counters()["get_hit"]
        assert all(d == block2 for _, d in lab.get_many(["h1", "h2"], NS, key2)), "detached"
        assert lab.counters()["get_hit"] > before, "the switch above answered r1's reads"


@pytest.mark.parametrize("shape, message", [
    ({"racks": 0}, "--racks must be at least 1"),
    ({"hosts_per_rack": 64}, "a switch has at most 64 ports"),
    ({"racks": 10, "hosts_per_rack": 10}, "a testbed holds 99"),
    ({"oversub": 0}, "--oversub must be > 0"),
])
def test_a_fabric_that_cannot_be_built_says_why(shape, message):
    with pytest.raises(FabricError, match=message):
        Fabric("fbad", 0, 1, **shape)


def test_tiny_fabric_serve_runs_every_mode_byte_exact(tmp_path):
    """`testbed bench serve --racks` at a tiny scale: the issue's JSON shape, every mode and
    workload byte-exact, and the burst's prefix leaves the pool less often with kvswitch at both
    levels than with none."""
    import json
    import subprocess
    from testbed.lab.topology import python_argv
    path = tmp_path / "fabric.json"
    r = subprocess.run(python_argv("testbed", "bench", "serve", "--racks", "2",
                                   "--hosts-per-rack", "2", "--pools", "1", "--scale", "0.1",
                                   "--json", str(path)), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(path.read_text())
    assert out["config"]["burst_prefix_bytes"] > 0 and out["config"]["racks"] == 2
    rows = {(row["workload"], row["mode"]): row for row in out["results"]}
    assert set(rows) == {(w, m) for w in ("burst", "zipf", "incast")
                         for m in ("bridge", "rack", "pool-side", "fabric")}
    for (w, _), row in rows.items():
        assert row["byte_exact"], row
        assert len(row["uplink_bytes"]) == 2 and len(row["pool_egress_bytes"]) == 1
        if w != "incast":
            assert row["wrong_bytes"] == 0 and set(row["hit_ratio"]) == {"rack", "pool-side"}
    assert rows[("burst", "bridge")]["hit_ratio"] == {"rack": None, "pool-side": None}
    assert sum(rows[("burst", "fabric")]["pool_egress_bytes"]) < \
        sum(rows[("burst", "bridge")]["pool_egress_bytes"])
    # four readers at once: the block leaves the pool once per rack with rack switches alone,
    # once with both levels (frames' headers on top)
    assert rows[("incast", "rack")]["pool_x_block"] > 1.9
    assert rows[("incast", "fabric")]["pool_x_block"] < 1.1
