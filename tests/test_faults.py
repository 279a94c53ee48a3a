"""`testbed bench faults`: its bad options (one line, a non-zero exit, before any testbed),
the timeline arithmetic, and tiny runs of the faults the issue names on a live testbed
(switchd SIGKILL while GETs are held, the program detached during fetches, a pool node killed
with and without another replica): every request completes, no wrong byte reaches a node, and
nothing is left behind."""
import subprocess
import sys

import numpy as np
import pytest

from conftest import leaves_no_namespaces, need_mooncake
from testbed.bench.faults import faults as fb
from testbed.bench.serve.serve_workloads import mixed_workload

TESTBED = [sys.executable, "-m", "testbed"]


@pytest.mark.parametrize("args, said", [
    (["--faults", "switchd-kill,meteor"], "unknown fault 'meteor': choose from switchd-kill"),
    (["--fault-seconds", "0"], "--fault-seconds must be > 0, got 0"),
    (["--fault-seconds", "-2"], "--fault-seconds must be > 0, got -2"),
    (["--host-node", "h9"], "--host-node h9: no such node (this testbed has h1..h8)"),
    (["--pools", "1", "--stores", "memory", "--pool-node", "p2"],
     "--pool-node p2: no such node (this testbed has p1..p1)"),
    (["--stores", "memory,tape"], "unknown store 'tape'"),
    (["--pools", "1"], "2 or more with mooncake"),
])
def test_bad_options_are_one_line_before_any_testbed(args, said):
    r = subprocess.run(TESTBED + ["bench", "faults", "--json", "", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], r.stderr


def test_every_fault_runs_with_memory_and_pool_kill_with_each_store():
    runs = fb.runs_for(["flush", "pool-kill"], ["memory", "mooncake", "disk"])
    assert runs == [("flush", "memory"), ("pool-kill", "memory"), ("pool-kill", "mooncake"),
                    ("pool-kill", "disk")]


def test_the_mixed_traffic_has_bursts_in_the_pool_and_zipf_throughout():
    wl = mixed_workload(4, ["10.0.0.1"], 7, seconds=14.0)
    assert wl.params["bursts_at_s"] == [4.0, 10.0]
    for b in wl.params["bursts_at_s"]:     # every node asks for the burst's prefix at once
        asks = [q for reqs in wl.requests for q in reqs if b <= q["at"] < b + 0.2
                and len(q["keys"]) == 32]
        assert len(asks) == 4 and set(asks[0]["keys"]) <= set(wl.preload)
    assert all(r == sorted(r, key=lambda q: q["at"]) for r in wl.requests)


class _Tl(fb.Timeline):
    def __init__(self, at, ttft):
        self.at, self.ttft = np.asarray(at, float), list(ttft)


def test_recovery_is_when_a_window_p50_is_back_within_10_percent():
    at = np.arange(0, 20, 0.1)
    calm = _Tl(at, [0.1] * len(at))
    slow = _Tl(at, [1.0 if 5 <= a < 9 else 0.105 for a in at])   # healed at 5, slow until 9
    assert 3.0 <= fb.recovery_s(slow, calm, 5.0, 20.0) <= 4.0
    never = _Tl(at, [1.0 if a >= 5 else 0.1 for a in at])
    assert fb.recovery_s(never, calm, 5.0, 20.0) is None
    lost = _Tl([1.0, 2.0, 3.0], [0.1, None, 31.0])
    assert lost.failed() == 2 and lost.window(0, 10) == [0.1, 30.0, 31.0]


def test_recovery_on_the_p99_sees_what_the_p50_does_not():
    """A fault that leaves one request in ten slow for a while: the window's p50 is back at once,
    its p99 only when those are gone."""
    at = np.arange(0, 20, 0.05)
    calm = _Tl(at, [0.1] * len(at))
    tail = _Tl(at, [1.0 if 5 <= a < 8 and i % 10 == 0 else 0.1 for i, a in enumerate(at)])
    assert fb.recovery_s(tail, calm, 5.0, 20.0) == 0.0
    assert 2.0 <= fb.recovery_s(tail, calm, 5.0, 20.0, pct=99) <= 3.0


def _clean_and_whole(out, faults):
    assert [r["fault"] for r in out["results"]] == faults
    for r in out["results"]:
        run = r["run"]
        assert r["failed_requests"] == 0 and not run["nodes_failed"], r
        assert r["wrong_bytes"] == 0 and run["requests"] > 0
        assert r["left_behind"] == [], r["left_behind"]
        assert r["fault_at_s"] < r["healed_at_s"] or r["fault"] == "flush"


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_switchd_killed_or_detached_amid_a_burst_and_a_pool_node_killed(tmp_path):
    faults = ["switchd-kill", "detach", "pool-kill"]
    with leaves_no_namespaces("fbt"):
        out = fb.run_faults(faults, ["memory"], nodes=2, pools=1, run_s=12.0,
                            json_path=str(tmp_path / "f.json"), prefix="fbt", baselines=False)
    _clean_and_whole(out, faults)
    kill, detach, pool = out["results"]
    assert kill["run"]["did"]["switchd_exit"] == -9      # SIGKILL, mid-burst
    assert "switchd: serving" in kill["run"]["healing"]["restarted"]
    assert pool["run"]["did"]["exit"] == -9 and pool["blocks_lost"] > 0   # memory: gone


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_pool_node_killed_with_a_second_mooncake_replica_loses_no_block(tmp_path):
    need_mooncake()
    with leaves_no_namespaces("fbm"):
        out = fb.run_faults(["pool-kill"], ["mooncake"], nodes=2, pools=2, run_s=12.0,
                            json_path=str(tmp_path / "f.json"), prefix="fbm", baselines=False)
    _clean_and_whole(out, ["pool-kill"])
    [r] = out["results"]
    assert r["store"] == "mooncake" and r["blocks_lost"] == 0


@pytest.mark.e2e
def test_a_node_sees_its_own_cable_pulled():
    from hostagent.common.netif import has_carrier
    ns, ours, peer = "kvcarrier-test", "kvcarA", "kvcarB"

    def ask(ifname):
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                               f"from hostagent.common.netif import has_carrier as h; "
                               f"print(h({ifname!r}))"], capture_output=True, text=True,
                              check=True).stdout.strip()

    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "link", "add", peer, "type", "veth", "peer", "name", ours,
                        "netns", ns], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", ours, "up"], check=True)
        subprocess.run(["ip", "link", "set", peer, "up"], check=True)
        assert ask(ours) == "True"
        subprocess.run(["ip", "link", "set", peer, "down"], check=True)   # the switch's side
        assert ask(ours) == "False"
    finally:
        subprocess.run(["ip", "link", "del", peer], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert has_carrier("lo")
    with pytest.raises(OSError):
        has_carrier("kvno-such-if")
