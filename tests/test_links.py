"""Shaped links (testbed.lab.links) end to end: a 4 MiB block over a 100 Mbit/s link takes
block/rate whether the pool node's XDP answers it or the switch's XDP does, ordinary TCP runs at
the rate, the link namespaces go with the testbed, and bad rates get one clear line."""
import hashlib
import json
import os
import statistics
import subprocess
import time

import pytest

from conftest import leaves_no_namespaces
from testbed.lab import Lab
from testbed.lab.topology import namespaces_of, python_argv

pytestmark = pytest.mark.e2e

NS = 3
GBIT = 0.1
BLOCK = 4 << 20


def _within(seconds: float, nbytes: int, gbit: float, tol: float = 0.10) -> bool:
    expect = nbytes * 8 / (gbit * 1e9)
    return abs(seconds - expect) <= tol * expect


def test_a_4mib_fetch_takes_block_over_rate_from_the_pool_and_from_the_switch():
    key, block = os.urandom(16), os.urandom(BLOCK)
    digest = hashlib.sha256(block).hexdigest()
    with leaves_no_namespaces(f"l{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=1, pools=1, chunk_size=3072, switch=False,
                link_gbit=GBIT, pool_link_gbit=GBIT) as lab:
        assert f"{prefix}-lh1" in namespaces_of(prefix)
        lab.put("h1", NS, key, block)
        args = (lab.pool_addrs, 3072, NS, key.hex())
        pool = lab.task("h1", "testbed.lab.links:timed_fetches", *args, 2)
        assert all(r["sha256"] == digest and r["from_pool"] == r["chunks"] for r in pool)
        lab.start_switch()
        lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
        fill, hit = lab.task("h1", "testbed.lab.links:timed_fetches", *args, 2)
        assert hit["sha256"] == digest and hit["from_switch"] == hit["chunks"]
        least = BLOCK * 8 / (GBIT * 1e9)
        fetches = (*pool, fill, hit)                 # pool node's XDP, switch's XDP
        for r in fetches:
            # no frame passes the link faster than its rate, whoever sent it (XDP_TX included)
            assert r["seconds"] >= 0.9 * least, (r, least)
            # the engine paces to what the link delivers: no queue overrun (on a quiet machine
            # it overran the link's queue: 30-40 retransmissions, switch hits 1.5-2.7x); one
            # fetch on a loaded box may take longer
            assert r["seconds"] <= 1.25 * least and r["retransmits"] <= 0.01 * r["chunks"], \
                (r, least)
        # block/rate within 10 % (the frames' headers alone make it 1.027x)
        assert statistics.median(r["seconds"] for r in fetches) <= 1.10 * least, (fetches, least)
        # stack traffic, both directions through the same link
        server = lab.topo.popen("p1", ["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL)
        try:
            listening = time.monotonic() + 20   # the client must not race the server's start
            while not lab.topo.run("p1", ["ss", "-ltnH", "sport = :5201"], check=False).stdout:
                assert time.monotonic() < listening, "iperf3 -s never listened"
                time.sleep(0.1)
            r = lab.topo.run("h1", ["iperf3", "-c", lab.pool_addrs[0], "-t", "3", "-J", "-R"],
                             timeout=60)
        finally:
            try:
                server.wait(10)                 # -1: it ends after its one client
            except subprocess.TimeoutExpired:   # the client failed: say that, not this
                server.kill()
                server.wait()
        bps = json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"]
        assert 0.9 * GBIT * 1e9 <= bps <= 1.02 * GBIT * 1e9, bps
    assert not namespaces_of(prefix)


@pytest.mark.parametrize("args, message", [
    (["--link-gbit", "0"], "must be > 0 Gbit/s"),
    (["--pool-link-gbit", "-1"], "must be > 0 Gbit/s"),
    (["--link-delay-us", "100"], "needs --link-gbit or --pool-link-gbit"),
])
def test_bad_link_options_are_one_clear_line(args, message):
    r = subprocess.run(python_argv("testbed", "up", "--name", f"b{os.getpid() % 100000}",
                                   *args), capture_output=True, text=True)
    assert r.returncode != 0
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not namespaces_of(f"b{os.getpid() % 100000}")
