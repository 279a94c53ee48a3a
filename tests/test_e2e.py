"""End to end on a veth testbed in namespaces this module creates and always removes: blocks put
and fetched through the switch with real UDP, ordinary traffic through the switch with the
program attached, switchd's lifecycle and its command-line errors."""
import contextlib
import os
import random
import re
import signal
import subprocess
import sys

import pytest

from conftest import leaves_no_namespaces
from testbed.lab import Lab
from testbed.lab.topology import namespaces_of, python_argv

pytestmark = pytest.mark.e2e

NS = 1


@pytest.fixture(scope="module")
def lab():
    with leaves_no_namespaces(f"t{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=2, pools=1,
                # no speculative fills: the tests count what comes from the pool after an admit
                switchd_args=("--port-security", "--fill-headroom", "0")) as running:
        yield running


def test_put_miss_admit_hit_byte_exact(lab):
    key, block = os.urandom(16), random.Random(1).randbytes(100 * 1024 + 17)
    assert lab.put("h1", NS, key, block)["chunks"] == 101

    first, data = lab.get("h1", NS, key)
    assert data == block and first["from_pool"] == 101 and first["from_switch"] == 0

    lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
    before = lab.stats()
    learn, data = lab.get("h2", NS, key)          # misses, learned as the replies pass
    assert data == block and learn["from_pool"] == 101
    hit, data = lab.get("h1", NS, key)            # every chunk from the switch
    assert data == block and hit["from_switch"] == 101 and hit["from_pool"] == 0
    after = lab.stats()
    assert after["fill"] - before["fill"] == 101
    assert after["get_hit"] - before["get_hit"] == 101
    assert after["malformed"] == 0

    ls = lab.switchd("cache", "ls", "--ns", str(NS)).stdout
    assert f"key={key.hex()} chunk=0/101 len=1024" in ls

    # another namespace with the same key never sees it
    with pytest.raises(Exception, match="NOT_FOUND"):
        lab.get("h2", NS + 1, key)

    # evicting the block sends the next fetch back to the pool node
    assert "evicted 101" in lab.switchd("cache", "evict", "--ns", str(NS),
                                        "--key", key.hex()).stdout
    again, data = lab.get("h2", NS, key)
    assert data == block and again["from_pool"] == 101


TCP_SERVER = """
import hashlib, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5201)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); h = hashlib.sha256()
while (b := c.recv(1 << 16)): h.update(b)
c.sendall(h.hexdigest().encode()); c.close()
"""

TCP_CLIENT = """
import hashlib, random, socket, sys
data = random.Random(7).randbytes(8 << 20)
c = socket.create_connection((sys.argv[1], 5201), timeout=20); c.sendall(data)
c.shutdown(socket.SHUT_WR); got = c.recv(64).decode()
print("ok" if got == hashlib.sha256(data).hexdigest() else "mismatch " + got)
"""


def test_ordinary_traffic_crosses_the_switch(lab):
    pool_ip = lab.pool_addrs[0]
    assert " 0% packet loss" in lab.topo.run("h2", ["ping", "-c", "3", "-i", "0.2",
                                                    pool_ip]).stdout
    server = lab.topo.popen("p1", ["python3", "-c", TCP_SERVER], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        r = lab.topo.run("h1", ["python3", "-c", TCP_CLIENT, pool_ip], timeout=60)
        assert r.stdout.strip() == "ok"
    finally:
        server.kill()
        server.wait()
    assert lab.stats()["non_kv"] > 100


def test_restart_keeps_the_cache_and_sigterm_detaches(lab):
    key, block = os.urandom(16), os.urandom(20 * 1024)
    lab.put("h1", NS, key, block)
    lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
    lab.get("h1", NS, key)
    assert lab.stop_switch() == 0
    links = subprocess.run(["ip", "-n", lab.topo.switch_ns, "link", "show"],
                           capture_output=True, text=True).stdout
    assert "xdp" not in links, "SIGTERM must detach the program from every port"
    miss, data = lab.get("h2", NS, key)            # no program: the bridge forwards to the pool
    assert data == block and miss["from_pool"] == 20
    lab.start_switch()
    hit, data = lab.get("h2", NS, key)             # the pinned cache survived the restart
    assert data == block and hit["from_switch"] == 20


@pytest.mark.parametrize("args, message", [
    (["run", "--port", "nosuchif"], "no interface named 'nosuchif'"),
    (["run"], "no ports"),
    (["run", "--port", "h1", "--chunk-size", "1000000"], "is not a multiple of 8 from 8 to 3424"),
    (["cache", "get", "--ns", "1", "--key", "zz"], "is not hex"),
    (["cache", "get", "--ns", "1", "--key", "00" * 16], "is not cached"),
])
def test_switchd_errors_are_one_clear_line(lab, args, message):
    r = lab.switchd(*args, check=False)
    assert r.returncode == (2 if "--chunk-size" in args else 1)     # 2: a bad argument
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("switchd: error:") and message in lines[0]


def test_switchd_environment_errors(tmp_path):
    r = subprocess.run(python_argv("switchd", "--pin-dir", str(tmp_path), "stats"),
                       capture_output=True, text=True)
    assert r.returncode == 1 and "is not on a bpf filesystem" in r.stderr
    r = subprocess.run(python_argv("switchd", "--netns", "no-such-ns", "stats"),
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no network namespace named 'no-such-ns'" in r.stderr
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        *python_argv("switchd", "stats")], capture_output=True, text=True)
    assert r.returncode == 1 and re.search(r"must run as root", r.stderr), r.stderr


def test_four_readers_one_upstream_request_per_chunk():
    prefix = f"c{os.getpid() % 100000}"
    n = 1024                       # chunks: long enough a transfer for the four to overlap
    # a generous round timeout: on a loaded 2-core box a reply can take tens of milliseconds.
    # The pool node's link is 100 Mbit/s, as a link to a storage node is busy in an incast:
    # unshaped on a quiet box its replies came within microseconds, the four readers rarely
    # asked for a chunk while its round was open, and nothing was held (half the runs)
    with Lab(prefix, hosts=4, pools=1, switchd_args=("--pending-timeout-ms", "1000"),
             pool_link_gbit=0.1) as lab4:
        key, block = os.urandom(16), os.urandom(n * 1024)
        lab4.put("h1", NS, key, block)
        lab4.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
        gets_before = lab4.pool_counters().get("rx_get", 0)
        # start late enough that all four have their fetch engine loaded (a first compile; on
        # a loaded box 8 s was sometimes not enough: the readers then ran one after another)
        results = lab4.get_many(["h1", "h2", "h3", "h4"], NS, key, start_delay=12.0)
        upstream = lab4.pool_counters()["rx_get"] - gets_before
        counters = lab4.stats()
    assert not namespaces_of(prefix)
    assert all(data == block for _, data in results), "every reader byte-exact"
    again = counters["expired"] + counters["reasked"]     # rounds asked again upstream
    assert upstream == n + again, f"{upstream} GETs for {n} chunks: {counters}"
    assert counters["expired"] <= 2
    served = [r["from_pool"] + r["replicas"] + r["from_switch"] for r, _ in results]
    assert served == [n] * 4
    assert counters["coalesced"] > 0 and counters["replicas"] > 0
    assert counters["fill"] == n


def _admitted(lab) -> set[str]:
    import json
    listing = json.loads(lab.switchd("cache", "ls", "--json").stdout)
    return {a["key"] for a in listing["admitted"]}


def _wait_for(condition, timeout=8.0):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_policy_admits_hot_blocks_serves_them_and_evicts_colder_ones():
    """A block becomes hot, the daemon admits it, the switch learns it as it passes and serves
    it; hotter blocks then push it out of a cache too small for all of them."""
    prefix = f"p{os.getpid() % 100000}"
    with Lab(prefix, hosts=2, pools=1, cache_entries=100,
             switchd_args=("--interval", "0.2", "--metrics-port", "9435")) as lab:
        blocks = {name: (os.urandom(16), os.urandom(40 * 1024)) for name in "ABC"}
        for key, data in blocks.values():
            lab.put("h1", NS, key, data)
        key_a, data_a = blocks["A"]
        assert lab.get("h1", NS, key_a)[0]["from_pool"] == 40
        assert _wait_for(lambda: key_a.hex() in _admitted(lab)), "hot block A not admitted"
        learn, data = lab.get("h2", NS, key_a)   # learned as the pool's replies pass
        assert data == data_a and learn["from_pool"] + learn["from_switch"] == 40
        hit, data = lab.get("h1", NS, key_a)
        assert data == data_a and hit["from_switch"] == 40
        assert lab.stats()["fill"] >= 40

        for name in "BC":                     # two hotter blocks; room for only two of three
            for _ in range(4):
                lab.get("h2", NS, blocks[name][0])
        assert _wait_for(lambda: key_a.hex() not in _admitted(lab)), "A was not evicted"
        cached = lab.switchd("cache", "ls", "--ns", str(NS)).stdout
        assert key_a.hex() not in cached
        again, data = lab.get("h1", NS, key_a)
        assert data == data_a and again["from_switch"] == 0

        metrics = lab.topo.run("sw", ["python3", "-c", "import urllib.request; print(urllib."
                                      "request.urlopen('http://127.0.0.1:9435/metrics')"
                                      ".read().decode())"]).stdout
    assert 'kvswitch_hits_total{ns="1"}' in metrics
    assert "kvswitch_evictions_total" in metrics and "kvswitch_admissions_total" in metrics
    assert not namespaces_of(prefix)


def test_trace_replay_reports_the_switch_hit_ratio(tmp_path):
    """A small trace with one hot shared prefix: the live switch learns it and serves it."""
    import json
    from testbed.bench.validate.replay import run_replay
    lines = [{"timestamp": 50 * i, "input_length": 2048, "output_length": 8,
              "hash_ids": [0, 1, 2, 100 + i]} for i in range(60)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = run_replay(str(path), capacity=8, speedup=1.0, interval=0.1, log=lambda *_: None)
    live = out["live"]
    assert live["block_requests"] == 240 and live["byte_exact"]
    assert live["switch_hits"] > 100, live         # the shared prefix comes from the switch
    assert out["offline_hit_ratio"]["belady"] == 0.7375


def test_dead_daemon_fails_open_and_a_restart_carries_on(lab):
    """SIGKILL leaves the program attached: hits are still served and everything else still
    forwarded; a new daemon re-attaches to the pinned maps and keeps the cache and counters."""
    import signal
    key, block = os.urandom(16), os.urandom(30 * 1024)
    lab.put("h1", NS, key, block)
    lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
    lab.get("h1", NS, key)
    hits_before = lab.stats()["get_hit"]
    lab.stop_switch(signal.SIGKILL)
    hit, data = lab.get("h2", NS, key)
    assert data == block and hit["from_switch"] == 30, "a dead daemon must not stop hits"
    other = os.urandom(16)
    lab.put("h2", NS, other, b"fresh" * 100)                 # misses still reach the pool
    assert lab.get("h1", NS, other)[1] == b"fresh" * 100
    assert " 0% packet loss" in lab.topo.run("h1", ["ping", "-c", "2", "-i", "0.2",
                                                    lab.pool_addrs[0]]).stdout
    lab.start_switch()
    hit, data = lab.get("h1", NS, key)
    assert data == block and hit["from_switch"] == 30
    assert lab.stats()["get_hit"] >= hits_before + 60, "counters survive the restart"


def test_a_port_running_someone_elses_program_is_refused():
    from testbed.lab.topology import Topology
    with Topology(f"x{os.getpid() % 100000}", hosts=1, pools=1) as topo:
        r = subprocess.run(python_argv("switchd", "--netns", topo.node("h1").netns, "--pin-dir",
                                       topo.pin_dir, "run", "--port", "eth0"),
                           capture_output=True, text=True, timeout=120)
        pins_left = os.path.exists(topo.pin_dir) and os.listdir(topo.pin_dir)
        dir_left = os.path.exists(topo.pin_dir)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "switchd: error: eth0 already runs XDP program 'xdp_pass': remove it first "
        "('switchd detach --port eth0') or start with --force"]
    assert not pins_left, f"a failed start left pinned maps behind: {pins_left}"
    assert not dir_left, "a failed start left the pin directory it made behind"


def test_a_second_daemon_cannot_take_the_first_ones_ports(lab):
    """Not with the same maps (one daemon per pin directory), not with its own maps (the ports
    are another switch's) unless told --force; the first one keeps serving either way."""
    ports = [a for n in lab.topo.nodes for a in ("--port", n.name)]
    same = lab.switchd("run", *ports, check=False)
    assert same.returncode == 1 and "another switchd (pid" in same.stderr
    other_pins = lab.topo.pin_dir + "-other"
    r = subprocess.run(python_argv("switchd", "--netns", lab.topo.switch_ns, "--pin-dir",
                                   other_pins, "run", *ports), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "is served by another switch" in r.stderr, r.stderr
    assert not os.path.exists(other_pins + "/kv_cache"), "a failed start left its maps"
    if os.path.isdir(other_pins):       # what switchd made for its pins, empty: nothing left
        os.rmdir(other_pins)
    assert lab.switch.poll() is None
    key, block = os.urandom(16), os.urandom(10 * 1024)
    lab.put("h1", NS, key, block)
    assert lab.get("h2", NS, key)[1] == block


def test_blocks_arrive_byte_exact_over_lossy_links(lab):
    from testbed.lab.topology import attach_loss
    key, block = os.urandom(16), os.urandom(150 * 1024)
    lab.put("h1", NS, key, block)
    lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
    nodes = [n.netns for n in lab.topo.nodes]
    attach_loss(nodes, 0.05)
    try:
        cold, data = lab.get("h2", NS, key, "--deadline", "20")
        assert data == block
        warm, data = lab.get("h1", NS, key, "--deadline", "20")
        assert data == block and warm["from_switch"] > 100
    finally:
        attach_loss(nodes, 0)
    assert cold["retransmits"] + warm["retransmits"] > 0, "5% loss and no retransmission?"


@contextlib.contextmanager
def held_up_by_another_program(prefix: str):
    """A program holding testbed ``prefix`` up (its Popen, once the testbed is up); killed with
    SIGKILL at the end if still running (no teardown: its namespaces are left behind)."""
    code = ("import time\nfrom testbed.lab.topology import Topology\n"
            f"with Topology({prefix!r}, hosts=1, pools=1):\n"
            "    print('up', flush=True)\n    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_terminated_testbed_program_removes_its_namespaces():
    # `timeout` and a cancelled CI job send SIGTERM; its default action skipped every teardown
    # and left the namespaces behind (a name of its own: the module's lab is up meanwhile)
    prefix = f"t{os.getpid() % 100000}x"
    with leaves_no_namespaces(prefix), held_up_by_another_program(prefix) as p:
        assert namespaces_of(prefix)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 143


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_teardown_waits_for_it(sig):
    """A SIGTERM (or Ctrl-C) raised in the middle of a teardown skipped the rest of it: `timeout`
    stopping a bench between two runs left 18 namespaces. Now it waits for the teardown, then
    the program stops as the signal says (exit 143, KeyboardInterrupt)."""
    prefix = f"t{os.getpid() % 100000}{sig[3].lower()}"
    # Ctrl-C's default action, as in a terminal: a shell starts a background job (`make test
    # &`) with SIGINT ignored, and the child inherited that (the signal did nothing)
    code = ("import os, signal\nimport testbed.lab.topology as t\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"topo = t.Topology({prefix!r}, hosts=2, pools=1).up()\n"
            "real = t.down\n"
            "def down(prefix):\n"
            f"    os.kill(os.getpid(), signal.{sig})     # delivered before the first removal\n"
            "    return real(prefix)\n"
            "t.down = down\n"
            "topo.down()\n"
            "print('went on after the signal', flush=True)\n")
    with leaves_no_namespaces(prefix):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        if sig == "SIGTERM":
            assert r.returncode == 143, (r.returncode, r.stderr[-2000:])
        else:
            assert r.returncode != 0 and "KeyboardInterrupt" in r.stderr, r.stderr[-2000:]
        assert not namespaces_of(prefix) and "went on" not in r.stdout, r.stdout


def test_a_testbed_in_use_is_not_built_over():
    """Building a testbed removes leftovers of its name first: a second program with the same
    name removed a live one's namespaces under it. A live program's name is locked; a dead
    one's leftovers are still removed."""
    from testbed.lab.topology import Topology, TestbedError
    prefix = f"t{os.getpid() % 100000}u"
    with leaves_no_namespaces(prefix):
        with held_up_by_another_program(prefix) as p:
            before = sorted(namespaces_of(prefix))
            with pytest.raises(TestbedError, match=f"in use by process {p.pid}"):
                Topology(prefix, hosts=2, pools=1).up()
            r = subprocess.run(python_argv("testbed", "up", "--name", prefix), text=True,
                               capture_output=True, timeout=60)
            assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert "in use by process" in r.stderr
            assert sorted(namespaces_of(prefix)) == before      # the live one untouched
        assert namespaces_of(prefix)                            # killed: leftovers
        with Topology(prefix, hosts=1, pools=1):                # the dead one's: removed
            pass
