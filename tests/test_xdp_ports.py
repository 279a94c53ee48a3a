"""The switch's port checks on crafted frames through BPF_PROG_TEST_RUN: a secured host port
binds to the first source it sees and drops spoofed ones, two ports never own one source, a
relearn needs the operator, a pool port bound first cannot be claimed, and switchd finds a
port's node by ARP out of that port alone."""
import json
import socket
import subprocess

import pytest
from scapy.layers.l2 import ARP, Ether

from kvproto.frames import XDP
from switchd import ports
from switchd.dataplane import ROLE_HOST, ROLE_POOL, SwitchError
from switchd.ports import resolve, set_role
from xdp_fixtures import (HOST_IP, HOST_MAC, OTHER_IP, OTHER_MAC, POOL_IP, POOL_MAC, get_frame,
                          reply_frame)
from xdp_switch import HOST2_IP, PORTS, cache, dp, ports_namespace, run  # noqa: F401

pytestmark = pytest.mark.bpf


def test_a_secured_port_binds_to_its_first_source(dp, cache):
    host = socket.if_indextoname(PORTS["host"])
    set_role(dp, host, ROLE_HOST, secured=True)
    try:
        assert host not in dp.port_sources()
        before = dp.counters()
        frame = bytes(get_frame())
        assert run(dp, frame) == (XDP.PASS, frame)          # a miss; it binds the port
        assert dp.port_sources()[host] == (HOST_MAC, HOST_IP)
        assert dp.counters()["src_learned"] - before["src_learned"] == 1
        assert run(dp, get_frame(src=OTHER_IP))[0] == XDP.DROP
        set_role(dp, host, ROLE_HOST, secured=True)     # a restarted daemon keeps it
        assert dp.port_sources()[host] == (HOST_MAC, HOST_IP)
        assert run(dp, get_frame(src=OTHER_IP))[0] == XDP.DROP
    finally:
        set_role(dp, host, ROLE_HOST)
    assert host not in dp.port_sources()
    assert run(dp, get_frame(src=OTHER_IP))[0] == XDP.PASS


def test_only_ports_without_checks_are_spared_the_port_lookup(dp, cache):
    """kv_port_clear: switchd marks a port without checks (its frames skip the kv_ports lookup)
    and clears the mark before the port gets checks, so a secured port's spoofed frame is
    dropped though the port was marked a moment before; unsecured again, it is marked again."""
    clear = dp.bpf.get_table(b"kv_port_clear")
    _unsecure(dp, "host", "host2")
    assert clear[clear.Key(PORTS["host"])].value == 1
    _secure(dp, "host2", (OTHER_MAC, OTHER_IP))           # some port has checks: port_checks on
    try:
        assert dp.get("port_checks") == 1
        assert run(dp, get_frame(src=OTHER_IP))[0] == XDP.PASS    # host: no checks, marked
        _secure(dp, "host", (HOST_MAC, HOST_IP))
        assert clear[clear.Key(PORTS["host"])].value == 0
        assert run(dp, get_frame(src=OTHER_IP))[0] == XDP.DROP    # spoofed
        assert run(dp, get_frame(src=HOST_IP))[0] == XDP.PASS
    finally:
        _unsecure(dp, "host", "host2")
    assert clear[clear.Key(PORTS["host"])].value == 1
    assert run(dp, get_frame(src=OTHER_IP))[0] == XDP.PASS


def _secure(dp, port, source=None):
    set_role(dp, socket.if_indextoname(PORTS[port]),
             ROLE_POOL if port == "pool" else ROLE_HOST, secured=True, source=source)


def _unsecure(dp, *ports):
    for port in ports:
        set_role(dp, socket.if_indextoname(PORTS[port]),
                 ROLE_POOL if port == "pool" else ROLE_HOST)


def _arp(mac, ip):
    return bytes(Ether(src=mac, dst="ff:ff:ff:ff:ff:ff") / ARP(op=2, hwsrc=mac, psrc=ip, pdst=ip))


def test_two_ports_never_learn_the_same_source(dp, cache):
    """h1 spoke first; h2's first frame is an ARP reply with h1's MAC and address (issue 26:
    the switch bound h2 to h1 and h2 received h1's replies). It is dropped, h2 stays unbound,
    and binds to its own source when it sends one."""
    _secure(dp, "host")
    _secure(dp, "host2")
    try:
        assert run(dp, _arp(HOST_MAC, HOST_IP), port="host")[0] == XDP.PASS   # h1 binds
        before = dp.counters()
        for frame in (_arp(HOST_MAC, HOST_IP), bytes(get_frame()),
                      _arp(OTHER_MAC, HOST_IP), bytes(get_frame(src_mac=HOST_MAC, src=HOST2_IP))):
            assert run(dp, frame, port="host2")[0] == XDP.DROP
        after = dp.counters()
        assert after["src_taken"] - before["src_taken"] == 4
        assert after["src_learned"] == before["src_learned"]
        host, host2 = (socket.if_indextoname(PORTS[p]) for p in ("host", "host2"))
        assert dp.port_sources() == {host: (HOST_MAC, HOST_IP)}
        assert run(dp, _arp(OTHER_MAC, HOST2_IP), port="host2")[0] == XDP.PASS
        assert dp.port_sources()[host2] == (OTHER_MAC, HOST2_IP)
        macs, ips = ports.owners(dp)
        assert sorted(macs.values()) == sorted(ips.values()) == sorted([PORTS["host"],
                                                                        PORTS["host2"]])
    finally:
        _unsecure(dp, "host", "host2")
    assert ports.owners(dp) == ({}, {}), "unsecured ports own nothing"


def test_a_relearn_needs_the_operator(dp, cache):
    _secure(dp, "host")
    try:
        assert run(dp, _arp(HOST_MAC, HOST_IP))[0] == XDP.PASS
        assert run(dp, _arp(OTHER_MAC, OTHER_IP))[0] == XDP.DROP          # sticky
        host = socket.if_indextoname(PORTS["host"])
        assert ports.relearn(dp, host) == (HOST_MAC, HOST_IP)
        assert host not in dp.port_sources() and ports.owners(dp) == ({}, {})
        assert run(dp, _arp(OTHER_MAC, OTHER_IP))[0] == XDP.PASS          # binds anew
        assert dp.port_sources()[host] == (OTHER_MAC, OTHER_IP)
        assert run(dp, _arp(HOST_MAC, HOST_IP))[0] == XDP.DROP
    finally:
        _unsecure(dp, "host")


def test_a_pool_port_bound_before_any_frame_cannot_be_claimed(dp, cache):
    """switchd binds a pool port to its node (the address given, its MAC asked for by ARP
    out of that port) before attaching; an explicit binding takes a source a port learned."""
    _secure(dp, "host")
    try:
        assert run(dp, _arp(POOL_MAC, POOL_IP))[0] == XDP.PASS      # learned before the pool's
        _secure(dp, "pool", (POOL_MAC, POOL_IP))                    # binding: the operator wins
        host, pool = (socket.if_indextoname(PORTS[p]) for p in ("host", "pool"))
        assert dp.port_sources() == {pool: (POOL_MAC, POOL_IP)}
        for frame in (_arp(POOL_MAC, POOL_IP), bytes(reply_frame()),
                      bytes(get_frame(src_mac=POOL_MAC, src=POOL_IP))):
            assert run(dp, frame)[0] == XDP.DROP
        assert run(dp, bytes(reply_frame()), port="pool")[0] == XDP.PASS
        assert host not in dp.port_sources()
    finally:
        _unsecure(dp, "host", "pool")


def test_a_ports_node_is_found_by_arp_out_of_that_port_alone():
    """switchd.ports.resolve: an ARP probe out of one port, answered on that port (here by the
    veth end facing it, holding the address); an address nobody holds is one clear error."""
    for args in (["link", "set", "host2port", "up"], ["link", "set", "spare", "up"],
                 ["addr", "replace", "198.18.0.77/32", "dev", "spare"]):
        subprocess.run(["ip", *args], check=True)
    mac = json.loads(subprocess.run(["ip", "-j", "link", "show", "spare"], capture_output=True,
                                    text=True, check=True).stdout)[0]["address"]
    assert resolve("host2port", "198.18.0.77") == mac
    with pytest.raises(SwitchError, match="nothing at 198.18.0.78 answered ARP on port "
                                          "host2port"):
        resolve("host2port", "198.18.0.78", timeout=0.5)


# ---- puts ----------------------------------------------------------------------------------
