"""Identities owned fabric-wide (issue 63) on crafted frames through BPF_PROG_TEST_RUN: with port
security a trunk owns the sources it carries (KV_PF_SOURCES). A rack switch's uplink owns the
pool nodes behind it (switchd writes them before any frame), so no host port binds to or speaks
as a pool node; the pool-side switch's downlinks each own their rack's hosts as first seen, so a
host of one rack cannot speak as a host of another. A GET to a group MAC is never answered."""
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from kvproto.frames import XDP
from switchd.cache import Cache
from switchd.dataplane import PF, ROLE_HOST, ROLE_POOL, DataPlane, Deployment
from switchd.ports import ip_raw, mac_raw, own, owners, set_role
from testbed.lab.topology import scratch_ports
from xdp.libbpf import xdp_test_run
from xdp_fixtures import KEY, PAYLOAD, get_frame

pytestmark = pytest.mark.bpf

PORTS = {}
POOL_MAC, POOL_IP = "02:00:00:00:00:65", "198.18.0.101"
VICTIM_MAC, VICTIM_IP = "02:00:00:00:01:01", "198.18.1.1"       # a host of rack 1
TENANT_MAC, TENANT_IP = "02:00:00:00:02:01", "198.18.2.1"       # a host of rack 2


@pytest.fixture(scope="module")
def dp():
    """A rack switch's ports (host, host2 secured; up: the uplink) and a pool-side switch's
    (dn1, dn2: downlinks) in one data plane, port security on."""
    with scratch_ports(("host", "host2"), ("uplk", "spare"), ("dn1", "dn2"),
                       prefix="kvsrc") as ends:
        PORTS.update(ends)
        d = DataPlane(Deployment(chunk_size=1024, cache_entries=4096, pin_dir=None))
        for port in ("host", "host2"):
            set_role(d, port, ROLE_HOST, secured=True)
        set_role(d, "uplk", ROLE_POOL, trunk=True, owns_sources=True)
        for port in ("dn1", "dn2"):
            set_role(d, port, ROLE_HOST, trunk=True, owns_sources=True)
        own(d, PORTS["uplk"], POOL_MAC, POOL_IP)          # the pool node behind the uplink
        yield d


def run(dp, frame, port):
    return xdp_test_run(dp.ingress.fd, bytes(frame), ifindex=PORTS[port])


def arp_from(mac, ip):
    return Ether(src=mac, dst="ff:ff:ff:ff:ff:ff") / ARP(op=1, hwsrc=mac, psrc=ip,
                                                         pdst="198.18.0.254")


def udp_from(mac, ip, dst="198.18.0.101"):
    return Ether(src=mac, dst=POOL_MAC) / IP(src=ip, dst=dst) / UDP(sport=4000, dport=4001)


def test_trunks_own_their_sources_and_are_checked(dp):
    cfg = {k.value: v for k, v in dp.ports.items()}
    assert cfg[PORTS["uplk"]].flags & PF["SOURCES"] and cfg[PORTS["dn1"]].flags & PF["SOURCES"]
    assert dp.get("port_checks") == 1


def test_a_rack_host_that_speaks_first_as_the_pool_node_is_refused(dp):
    before = dp.counters()
    for frame in (arp_from(POOL_MAC, POOL_IP), udp_from(POOL_MAC, POOL_IP),
                  arp_from("02:00:00:00:00:99", POOL_IP), udp_from("02:00:00:00:00:99", POOL_IP)):
        assert run(dp, frame, "host")[0] == XDP.DROP
    after = dp.counters()
    assert after["src_taken"] - before["src_taken"] == 4 and after["src_learned"] == \
        before["src_learned"]
    assert not {k.value: v for k, v in dp.ports.items()}[PORTS["host"]].flags & PF["BOUND"]
    macs, ips = owners(dp)
    assert macs[mac_raw(POOL_MAC)] == ips[ip_raw(POOL_IP)] == PORTS["uplk"], "still the uplink's"
    # the pool node itself, behind the uplink, speaks as usual
    assert run(dp, arp_from(POOL_MAC, POOL_IP), "uplk")[0] == XDP.PASS


def test_a_host_of_one_rack_cannot_speak_as_a_host_of_another(dp):
    """The pool-side switch: the victim's rack (dn1) carried its source first; the same source
    from another rack's downlink (dn2), its MAC or its address, is dropped, and the bait that
    would teach the pool side's bridge the victim's MAC on dn2 never passes."""
    assert run(dp, arp_from(VICTIM_MAC, VICTIM_IP), "dn1")[0] == XDP.PASS
    assert run(dp, udp_from(TENANT_MAC, TENANT_IP), "dn2")[0] == XDP.PASS
    before = dp.counters()["src_taken"]
    for frame in (arp_from(VICTIM_MAC, VICTIM_IP), udp_from(VICTIM_MAC, VICTIM_IP),
                  udp_from(TENANT_MAC, VICTIM_IP), udp_from(VICTIM_MAC, TENANT_IP)):
        assert run(dp, frame, "dn2")[0] == XDP.DROP
    assert dp.counters()["src_taken"] - before == 4
    macs, ips = owners(dp)
    assert macs[mac_raw(VICTIM_MAC)] == ips[ip_raw(VICTIM_IP)] == PORTS["dn1"]
    assert macs[mac_raw(TENANT_MAC)] == ips[ip_raw(TENANT_IP)] == PORTS["dn2"]
    assert run(dp, udp_from(VICTIM_MAC, VICTIM_IP), "dn1")[0] == XDP.PASS, "its own rack's"


def test_a_source_a_trunk_owns_is_never_bound_by_a_host_port(dp):
    """On a rack switch, a host of another rack reached this uplink first: a host port here
    claiming it is refused as a pool node's identity is."""
    assert run(dp, arp_from("02:00:00:00:03:01", "198.18.3.1"), "uplk")[0] == XDP.PASS
    assert run(dp, arp_from("02:00:00:00:03:01", "198.18.3.1"), "host2")[0] == XDP.DROP
    assert not {k.value: v for k, v in dp.ports.items()}[PORTS["host2"]].flags & PF["BOUND"]


def test_a_get_to_a_group_mac_is_never_answered_from_the_cache():
    """A reply's source is the GET's destination swapped in: answering a GET sent to a group
    MAC would send a reply from ff:ff:ff:ff:ff:ff. It goes on to the pool node unheld."""
    with scratch_ports(("ghost", "gpool"), prefix="kvgrp") as ends:
        d = DataPlane(Deployment(chunk_size=1024, cache_entries=256, pin_dir=None))
        try:
            set_role(d, "gpool", ROLE_POOL)
            Cache(d).put(5, KEY, 3, PAYLOAD, nchunks=9)
            for dst in ("ff:ff:ff:ff:ff:ff", "01:00:5e:00:00:01"):
                frame = bytes(get_frame(dst_mac=dst))
                before = d.counters()
                assert xdp_test_run(d.ingress.fd, frame, ifindex=ends["ghost"]) == (XDP.PASS, frame)
                after = d.counters()
                assert after["group_dest"] - before["group_dest"] == 1
                assert after["get_hit"] == before["get_hit"] and len(d.pending) == 0
            unicast = xdp_test_run(d.ingress.fd, bytes(get_frame()), ifindex=ends["ghost"])
            assert unicast[0] == XDP.TX
        finally:
            d.bpf.cleanup()
