"""Tenant isolation and port security end to end, attacked the way a tenant could from its own
port (testbed.security crafts the frames inside the attacker's namespace): requests for another
tenant's namespace wrapped in IP options, fragments or a VLAN tag, frames with another host's
source, forged replies, rounds opened toward an address nobody answers, GETs the pool cannot
answer sent over and over (issue 26's stall) and, on a switch that learns every port's source,
first frames claiming another host's or the pool's identity (issue 26's capture). The pool
node's own request counters are the ground truth of what got through."""
import json
import os
import statistics
import time

import pytest

from conftest import leaves_no_namespaces
from testbed.lab import Lab
from testbed.lab.tasks import stop_task
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
        running.start_switch("--port-ns", f"h2={ATTACKER_NS}", "--policy", "off", *binds)
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
    # stalling until the victim's fetch is done (and 100 rounds at least), in 2 s slices
    stop = os.path.join(lab.tmp.name, "stop-black-hole")
    staller = lab.start_task("h3", "testbed.lab.tasks:until_stopped", stop,
                             "testbed.security:stall_rounds", "198.18.0.250",
                             "02:00:00:00:00:fa", VICTIM_NS, key.hex(), chunks, 1024, 2.0)
    deadline = time.monotonic() + 20

    def met_own_round(c):          # its GETs met its own open rounds: held, or asked again
        return c["coalesced"] + c["reasked"]

    while met_own_round(lab.stats()) < met_own_round(before) + 2 * chunks:   # rounds held open
        assert time.monotonic() < deadline, "the stalling host never opened rounds"
        time.sleep(0.2)
    got, fetched = lab.get("h1", VICTIM_NS, key, "--deadline", "10")
    stop_task(stop, rounds=101)
    stalled = staller.result(60)
    after = lab.stats()
    assert fetched == data and got["from_pool"] + got["from_switch"] == chunks
    assert stalled["rounds"] > 100
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    met = sum(after[k] - before[k] for k in ("other_dest", "unheld"))
    assert met > chunks // 2, ("few GETs met the staller's rounds", moved, got)


@pytest.mark.parametrize("attacker", ["p1", "h2", "h3"])
def test_forged_replies_from_a_tenant_port_never_reach_another_host(lab, attacker):
    """Issue 26: 500 GET_REPLY frames from h2's own address reached h1. Replies come from pool
    ports only: sprayed from h2 (bound, limited) and h3 (no checks at all), from their own
    source and the pool's, none reaches h1 (its packet tap, behind its XDP_PASS program); the
    same frames from the pool's port do (the control: the tap sees what arrives)."""
    key, data = os.urandom(16), os.urandom(64 * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    before = lab.stats()
    sniffer = lab.start_task("h1", "testbed.security:sniff_marked", 6.0)
    time.sleep(1.5)
    args = (lab.topo.node("h1").ip, lab.mac("h1"), VICTIM_NS, key.hex(), 64, 2)
    sent = lab.task(attacker, "testbed.security:forge_replies", *args)["sent"]
    sent += lab.task(attacker, "testbed.security:forge_replies", *args,
                     (lab.mac("p1"), lab.pool_addrs[0]))["sent"]
    seen = sniffer.result(120)["marked"]
    got, fetched = lab.get("h1", VICTIM_NS, key)
    after = lab.stats()
    assert fetched == data and got["chunks"] == 64
    if attacker == "p1":
        assert seen > sent // 10, f"the control: {seen} of {sent} replies from the pool's port"
        return
    assert seen == 0, f"{seen} forged replies of {sent} reached h1"
    dropped = sum(after[k] - before[k] for k in ("not_from_pool", "spoofed"))
    assert dropped >= sent, (dropped, sent)


@pytest.mark.parametrize("how", ["csum", "port0"])
def test_gets_the_pool_cannot_answer_do_not_stall_another_hosts_fetch(lab, how):
    """Issue 26: GETs with room 0 for every chunk of a block, over and over, from a same-tenant
    host (h3), with the bare pseudo-header sum as UDP checksum (the pool's kernel drops them)
    or from UDP port 0 (its reply cannot be sent), kept rounds open at the switch and h1's
    fetch failed after 22.5 s. At this test's rate (a pass of 1,024 GETs every ~55 ms, ~15,000
    frames/s) the code before the fix failed one fetch in three and took 0.9-1.6 s for the
    others (bench/results/security-stall.json).
    Now the switch holds none of them: h1's fetch of that block (never cached: no policy here)
    takes at most twice as long as without the attack, or 0.25 s (the best of three under
    attack against the median of three before and three after)."""
    chunks = 1024
    key, data = os.urandom(16), os.urandom(chunks * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    quiet = [lab.get("h1", VICTIM_NS, key)[0]["seconds"] for _ in range(3)]
    counter = {"csum": "bad_udp_csum", "port0": "port_zero"}[how]
    before = lab.stats()
    # attacking until h1's fetches under attack are done (and 100 passes at least), in 2 s
    # slices (it attacked for 40 s: the test waited for the rest)
    stop = os.path.join(lab.tmp.name, f"stop-{how}")
    staller = lab.start_task("h3", "testbed.lab.tasks:until_stopped", stop,
                             "testbed.security:unanswerable_gets", lab.pool_addrs[0],
                             lab.mac("p1"), VICTIM_NS, key.hex(), chunks, how, 2.0, 0.05)
    deadline = time.monotonic() + 30           # (switchd stats compiles its map reader)
    while lab.stats()[counter] < before[counter] + 4 * chunks:     # the attack is running
        assert time.monotonic() < deadline, "the staller's GETs never reached the switch"
        time.sleep(0.2)
    attacked, retransmits = [], []
    for _ in range(3):
        got, fetched = lab.get("h1", VICTIM_NS, key, "--deadline", "20")
        assert fetched == data and got["chunks"] == chunks
        attacked.append(got["seconds"])
        retransmits.append(got["retransmits"])
    after = lab.stats()
    stop_task(stop, frames=100 * chunks + 1)
    stalled = staller.result(90)
    quiet += [lab.get("h1", VICTIM_NS, key)[0]["seconds"] for _ in range(3)]  # and after it
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert stalled["frames"] > 100 * chunks and moved[counter] > 20 * chunks, (stalled, moved)
    assert moved.get("coalesced", 0) == 0, moved                    # nobody was held
    # the best of three: the machine's other load makes single fetches noisy; a stall (issue
    # 26) delays every one of them by 0.9 s or more. A quiet fetch now takes ~8 ms, and the
    # attacker's ~15,000 frames/s share the same two cores: a bound of twice that would measure
    # the CPU the flood takes, so the bound is twice quiet or 0.25 s, whichever is larger
    assert min(attacked) <= max(2 * statistics.median(quiet), 0.25), (attacked, quiet, moved)
    print(f"{how}: quiet {quiet}, under attack {attacked} ({retransmits} retransmissions), "
          f"{stalled}")


# ---- a switch that learns every port's source (--port-security) -----------------------------
@pytest.fixture(scope="module")
def learning_lab():
    """Every port secured: p1 bound to the pool node before any frame (its address given, its
    MAC asked for on p1), h1..h3 bound to their first source no other port owns."""
    with leaves_no_namespaces(f"seb{os.getpid() % 10000}") as prefix, \
            Lab(prefix, hosts=3, pools=1, switch=False) as running:
        running.start_switch("--port-security")
        yield running


def _ports(lab) -> dict:
    return {r["port"]: r for r in json.loads(lab.switchd("port", "ls", "--json").stdout)["ports"]}


def test_the_pool_port_is_bound_before_any_frame(learning_lab):
    lab = learning_lab
    p1 = _ports(lab)["p1"]
    assert (p1["role"], p1["mac"], p1["ip"]) == ("pool", lab.mac("p1"), lab.pool_addrs[0])


def test_a_first_frame_with_another_hosts_identity_captures_nothing(learning_lab):
    """Issue 26: h2's first frame was an ARP reply with h1's MAC and IP; the switch bound h2's
    port to h1 and h2 received 111 of h1's replies. h1 has spoken (its PUT) when h2 tries."""
    lab = learning_lab
    key, data = os.urandom(16), os.urandom(300 * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    ports = _ports(lab)
    assert ports["h1"]["mac"] == lab.mac("h1") and ports["h2"]["mac"] is None, ports
    before = lab.stats()
    thief = lab.start_task("h2", "testbed.security:impersonate", lab.mac("h1"),
                           lab.topo.node("h1").ip, 4.0)
    time.sleep(0.5)
    got, fetched = lab.get("h1", VICTIM_NS, key)
    loot = thief.result(60)
    after = lab.stats()
    assert fetched == data and got["chunks"] == 300
    assert loot["captured"] == loot["captured_kv"] == 0, loot
    assert _ports(lab)["h2"]["mac"] is None, "h2 was bound to h1's identity"
    assert after["src_taken"] - before["src_taken"] >= loot["sent"]


def test_a_first_frame_with_the_pools_identity_captures_nothing(learning_lab):
    """Issue 26: with the pool's MAC and address as its first frame, h2 got every GET and
    answered with forged replies. Here h3 claims the pool's identity (and sprays forged replies
    from it) while h1 fetches: no GET reaches h3, h1's block is the pool's, and the pool saw
    the GETs."""
    lab = learning_lab
    key, data = os.urandom(16), os.urandom(128 * 1024)
    lab.put("h1", VICTIM_NS, key, data)
    assert _ports(lab)["h3"]["mac"] is None
    pool_before = lab.pool_counters()
    thief = lab.start_task("h3", "testbed.security:impersonate", lab.mac("p1"),
                           lab.pool_addrs[0], 4.0)
    forger = lab.start_task("h3", "testbed.security:forge_replies", lab.topo.node("h1").ip,
                            lab.mac("h1"), VICTIM_NS, key.hex(), 128, 2,
                            (lab.mac("p1"), lab.pool_addrs[0]))
    time.sleep(0.5)
    got, fetched = lab.get("h1", VICTIM_NS, key)
    loot, forged = thief.result(60), forger.result(60)
    assert fetched == data and got["from_pool"] == got["chunks"] == 128
    assert loot["captured_kv"] == 0, loot
    assert lab.pool_counters().get("rx_get", 0) - pool_before.get("rx_get", 0) >= 128
    assert _ports(lab)["p1"]["mac"] == lab.mac("p1") and _ports(lab)["h3"]["mac"] is None
    assert forged["sent"] > 0


def test_a_relearn_needs_the_operator(learning_lab):
    lab = learning_lab
    lab.task("h2", "testbed.security:foreign_requests", "plain", "get", lab.pool_addrs[0],
             lab.mac("p1"), 2, os.urandom(16).hex(), 1, 1024, 0.2)     # h2 speaks: it binds
    h2 = lab.topo.node("h2")
    assert (_ports(lab)["h2"]["mac"], _ports(lab)["h2"]["ip"]) == (lab.mac("h2"), h2.ip)
    out = lab.switchd("port", "relearn", "h2").stdout
    assert out.startswith(f"h2 unbound (was {lab.mac('h2')} {h2.ip})")
    assert _ports(lab)["h2"]["mac"] is None
    out = lab.switchd("port", "bind", "h2", h2.ip).stdout      # its MAC asked for on h2 alone
    assert out.strip().endswith(f"h2 bound to {lab.mac('h2')} {h2.ip}")
    assert (_ports(lab)["h2"]["mac"], _ports(lab)["h2"]["ip"]) == (lab.mac("h2"), h2.ip)
    r = lab.switchd("port", "relearn", "nonesuch", check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
