"""What the data-plane cost work (issue #30) changed in the testbed and the pool node: the
switch's bridge forwards without br_netfilter's hooks, and a pool node's XDP GET server attached
natively (HOSTAGENT_XDP_MODE=native, for a node whose peer runs XDP) serves byte-exact through
the switch, from XDP, and gives the interface back to a native XDP_PASS program when it stops."""
import json
import os
import subprocess

import pytest

NS = 7


def _sysctl(ns: str, name: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", name], check=True,
                          capture_output=True, text=True).stdout.strip()


def _xdp(ns: str, dev: str) -> dict:
    out = subprocess.run(["ip", "-n", ns, "-j", "-d", "link", "show", "dev", dev], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)[0].get("xdp") or {}


@pytest.mark.e2e
def test_a_native_pool_server_answers_through_the_switch_from_xdp(monkeypatch):
    from testbed.lab import Lab
    from testbed.lab.topology import namespaces_of
    prefix = f"dc{os.getpid() % 100000}"
    monkeypatch.setenv("HOSTAGENT_XDP_MODE", "native")    # the pool server inherits it
    with Lab(prefix, hosts=1, pools=1, chunk_size=3072,
             switchd_args=("--no-coalesce", "--policy", "off")) as lab:
        sw, p1 = lab.topo.switch_ns, lab.topo.node("p1").netns
        for proto in ("iptables", "ip6tables", "arptables"):
            assert _sysctl(sw, f"net.bridge.bridge-nf-call-{proto}") == "0"
        assert _sysctl(p1, "net.bridge.bridge-nf-call-iptables") == "1"   # only the switch's
        xdp = _xdp(p1, "eth0")
        assert xdp.get("mode") == 1 and xdp["prog"]["name"] == "kv_serve"  # native
        assert "answered by XDP on eth0" in lab.pool_log(0)
        key, block = os.urandom(16), os.urandom(3072 * 200 + 500)
        lab.put("h1", NS, key, block)
        stats, data = lab.get("h1", NS, key)        # misses at the switch: the pool answers
        assert data == block and stats["from_pool"] == 201
        counters = lab.pool_counters()
        assert counters["xdp_hit"] >= 201 - counters["xdp_seg_end"]
        lab.stop_pool(0)
        xdp = _xdp(p1, "eth0")                      # a native passing program is back
        assert xdp.get("mode") == 1 and xdp["prog"]["name"] == "kv_serve_pass"
    assert not namespaces_of(prefix)


def test_an_unknown_xdp_mode_is_refused_in_one_line(monkeypatch):
    from hostagent.pool.xdpserve import NoXdp, XdpServer
    monkeypatch.setenv("HOSTAGENT_XDP_MODE", "turbo")
    with pytest.raises(NoXdp, match="HOSTAGENT_XDP_MODE must be generic or native"):
        XdpServer(1 << 20, "lo", ["127.0.0.1"])
