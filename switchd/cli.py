"""The `switchd` command line: run the switch daemon, read its counters, edit its cache by hand.

Every command accepts --netns (act inside that network namespace) and --pin-dir (where the maps
are pinned). Errors the user can fix print one line and exit non-zero.
"""
from __future__ import annotations

import ctypes
import json
import socket
import sys
import time

import click

from kvproto.cli import chunk_option, one_line_errors, with_config
from xdp import NoXdp, netns
from xdp.attach import MODES, detach_port
from xdp.loader import preflight

from .cache import Cache, parse_key
from .run_options import (check_trunks, parse_bindings, parse_pool_ports, parse_port_ns,
                          parse_quotas, parse_share, parse_source, parse_uplinks)
from .slots import Slots
from .policy import DEFAULT_POLICY, POLICIES
from .dataplane import (DEFAULT_PIN_DIR, DataPlane, Deployment, SwitchError, ifindex,
                        pinned_deployment)


class Context:
    def __init__(self, netns_name: str | None, pin_dir: str):
        self.netns, self.pin_dir = netns_name, pin_dir

    def enter(self) -> None:
        preflight(self.pin_dir)
        if self.netns:
            if not netns.exists(self.netns):
                raise SwitchError(f"no network namespace named {self.netns!r}")
            netns.enter(self.netns)

    def maps(self) -> DataPlane:
        """The pinned maps of a running (or crashed) switch."""
        self.enter()
        return DataPlane(pinned_deployment(self.pin_dir), programs=False)


pass_ctx = click.make_pass_decorator(Context)


@click.group(cls=one_line_errors("switchd", SwitchError, NoXdp))
@click.option("--netns", "netns_name", metavar="NAME", help="Network namespace of the ports.")
@click.option("--pin-dir", default=DEFAULT_PIN_DIR, show_default=True,
              help="bpffs directory holding the switch's maps.")
@click.pass_context
def main(ctx, netns_name, pin_dir):
    """In-network KV-cache switch: XDP data plane control daemon."""
    ctx.obj = Context(netns_name, pin_dir.rstrip("/"))


@main.command("check")
@chunk_option(help="The chunk size to compile the switch's programs for.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def check_cmd(chunk_size, as_json):
    """What this kernel grants the switch's programs, feature by feature; run it first. Exits
    non-zero when something the switch needs is refused."""
    from xdp.features import emit
    from .check import switch_check
    preflight()
    sys.exit(emit("switchd", switch_check(chunk_size), as_json))


# config-file keys that are not spelled like their option, and tables that become option values
CONFIG_KEYS = {"port_namespaces": "port_ns", "port_bindings": "port_bind"}
TABLE_KEYS = ("quotas", "port_namespaces", "port_bindings")


@main.command()
@click.option("--port", "ports", multiple=True, metavar="IF", help="Switch port (repeatable).")
@click.option("--pool-port", "pool_ports", multiple=True, metavar="IF[=IP]",
              help="Port facing a pool node; only its replies pass and are learned "
                   "(repeatable). With the node's IPv4 address the port is bound to the node "
                   "before any frame is seen (its MAC asked for by ARP on that port); "
                   "--port-security needs it.")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML file with the same keys.")
@chunk_option(help="Chunk payload bytes (the hosts' and pool nodes' --chunk-size).")
@click.option("--cache-entries", type=int, default=65536, show_default=True,
              help="Chunks the cache holds.")
@click.option("--mode", type=click.Choice(MODES), default="native", show_default=True,
              help="XDP attach mode.")
@click.option("--coalesce/--no-coalesce", default=True, show_default=True,
              help="Hold concurrent misses for a chunk and replicate its reply.")
@click.option("--pending-timeout-ms", type=click.FloatRange(min=0, min_open=True), default=50,
              show_default=True, help="A held round older than this is retried upstream.")
@click.option("--policy", type=click.Choice([*POLICIES, "off"]), default=DEFAULT_POLICY,
              show_default=True, help="Admission/eviction policy (off: admit by hand).")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between policy steps.")
@click.option("--fill-headroom", type=click.IntRange(min=0), default=None,
              help="Chunks kept free for speculative fills, blocks cached on their first miss "
                   "before the policy decides (default 1/16 of the cache; 0: off).")
@click.option("--quota", "quotas", multiple=True, metavar="NS=SIZE",
              help="Byte quota of a namespace, e.g. 3=64MiB (repeatable).")
@click.option("--metrics-port", type=click.IntRange(1, 65535),
              help="Serve Prometheus metrics on this port.")
@click.option("--port-ns", "port_ns", multiple=True, metavar="IF=NS[,NS...]",
              help="Limit a port to these namespaces (repeatable); requests for others, and "
                   "frames the data plane cannot check, are dropped.")
@click.option("--uplink", "uplinks", multiple=True, metavar="IF[=IP[,IP...]]",
              help="Port to the switch above, towards the pool nodes (repeatable): replies "
                   "from every pool node behind it pass and are learned, also those that "
                   "switch made from its cache; never bound to a source. With the pool nodes' "
                   "IPv4 addresses their identities are the uplink's before any frame is seen "
                   "(their MACs asked for by ARP there); --port-security needs them.")
@click.option("--downlink", "downlinks", multiple=True, metavar="IF",
              help="Port to a switch below, a rack of inference nodes (repeatable): many "
                   "nodes' GETs, no replies; never bound to a source (the switch below binds "
                   "each of its nodes).")
@click.option("--cache-share", metavar="K/N", default=None,
              help="Cache only blocks whose key falls in share K of N (a split placement in a "
                   "fabric: the switches of different levels hold different parts of the hot "
                   "set, DistCache-style; default: every block).")
@click.option("--port-security", is_flag=True, default=False,
              help="Bind every port to one source (MAC, IPv4): pool ports to their node, the "
                   "others to the first source they send that no other port owns (sticky: "
                   "'switchd port relearn'); frames with another source are dropped.")
@click.option("--port-bind", "port_bind", multiple=True, metavar="IF=[MAC,]IP",
              help="Bind a port to this source before any frame is seen (repeatable); without "
                   "a MAC, the one answering ARP for IP on that port.")
@click.option("--force", is_flag=True, default=False,
              help="Take ports that run another XDP program (or another switch's).")
@pass_ctx
def run(obj: Context, config, **_):
    """Load the data plane, attach it to the ports, and run until SIGINT/SIGTERM."""
    from .daemon import Daemon, Settings
    v = with_config(click.get_current_context(), config, CONFIG_KEYS, TABLE_KEYS)
    pool_ports, pool_addrs = parse_pool_ports(v["pool_ports"])
    uplinks, uplink_pools = parse_uplinks(v["uplinks"])
    downlinks = list(v["downlinks"])
    hosts = list(v["ports"])
    ports = hosts + [p for p in pool_ports + uplinks + downlinks if p not in hosts]
    if not ports:
        raise SwitchError("no ports: give --port IF (repeatable) or a --config with 'ports'")
    bindings = {p: (None, a) for p, a in pool_addrs.items()}
    bindings.update(parse_bindings(v["port_bind"], ports))
    check_trunks(hosts, uplinks, downlinks, pool_ports, bindings)
    if v["port_security"]:
        unbound = [p for p in pool_ports if p not in bindings]
        if unbound:
            raise SwitchError(f"--port-security binds pool ports before any frame is seen: give "
                              f"the pool node's address, --pool-port {unbound[0]}=IP (or "
                              f"--port-bind {unbound[0]}=[MAC,]IP)")
        undeclared = [p for p in uplinks if p not in uplink_pools]
        if undeclared:
            raise SwitchError(f"--port-security reserves the pool nodes' identities on every "
                              f"switch: give those behind uplink {undeclared[0]}, --uplink "
                              f"{undeclared[0]}=IP[,IP...]")
    dep = Deployment(v["chunk_size"], v["cache_entries"], obj.pin_dir)
    settings = Settings(
        ports, pool_ports, v["mode"], v["coalesce"], v["pending_timeout_ms"] / 1000,
        None if v["policy"] == "off" else v["policy"], v["interval"], parse_quotas(v["quotas"]),
        v["metrics_port"], parse_port_ns(v["port_ns"], ports), v["fill_headroom"],
        v["port_security"], bindings, v["force"], uplinks, downlinks, uplink_pools,
        parse_share(v["cache_share"]))
    obj.enter()
    Daemon(dep, settings).run()


def _render_counters(counters: dict[str, int], dep: Deployment, used: int) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"switch counters (cache {used}/{dep.cache_entries} chunks of "
                        f"{dep.chunk_size} B)")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for name, value in counters.items():
        table.add_row(name, f"{value:,}")
    Console().print(table)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--watch", type=click.FloatRange(min=0, min_open=True), metavar="SECS",
              help="Refresh every SECS seconds.")
@pass_ctx
def stats(obj: Context, as_json, watch):
    """Counters of the running switch, read from its pinned maps."""
    dp = obj.maps()
    while True:
        counters = dp.counters()
        used = Slots.of(dp).summary()[1]     # read only: no Cache (it grants a region)
        if as_json:
            click.echo(json.dumps({"counters": counters, "cache_entries": used,
                                   "cache_capacity": dp.deployment.cache_entries,
                                   "chunk_size": dp.deployment.chunk_size}))
        else:
            _render_counters(counters, dp.deployment, used)
        if not watch:
            return
        time.sleep(watch)


@main.command()
@click.option("--port", "ports", multiple=True, required=True, metavar="IF")
@pass_ctx
def detach(obj: Context, ports):
    """Remove the XDP program from ports (after a crash, say)."""
    obj.enter()
    for p in ports:
        detach_port(p)
        click.echo(f"detached {p}")


@main.command()
@pass_ctx
def reset(obj: Context):
    """Remove the pinned maps (the cache and counters are lost)."""
    import shutil
    obj.enter()
    shutil.rmtree(obj.pin_dir, ignore_errors=True)
    click.echo(f"removed {obj.pin_dir}")


# ---- port security --------------------------------------------------------------------------
@main.group()
def port():
    """Port roles and bindings (port security): list, bind by hand, relearn."""


@port.command("ls")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def port_ls(obj, as_json):
    """Every port with its role, checks and the source it is bound to."""
    from .ports import table
    rows = table(obj.maps())
    if as_json:
        click.echo(json.dumps({"ports": rows}))
        return
    for r in rows:
        bound = f"bound to {r['mac']} {r['ip']}" if r["mac"] else (
            "not bound yet" if r["secured"] else "unsecured")
        limit = f", namespaces {','.join(map(str, r['namespaces']))}" if r["namespaces"] else ""
        click.echo(f"{r['port']}: {r['role']}, {bound}{limit}")


@port.command("relearn")
@click.argument("ifname", metavar="IF")
@pass_ctx
def port_relearn(obj, ifname):
    """Unbind a secured port: it binds to the next source it sends that no other port owns."""
    from .ports import relearn
    before = relearn(obj.maps(), ifname)
    was = f" (was {before[0]} {before[1]})" if before else ""
    click.echo(f"{ifname} unbound{was}: it binds to the source of its next frame")


@port.command("bind")
@click.argument("ifname", metavar="IF")
@click.argument("spec", metavar="[MAC,]IP")
@pass_ctx
def port_bind(obj, ifname, spec):
    """Bind a port to a source now (without a MAC: the one answering ARP for IP on that port);
    a port that had that MAC or address loses its binding."""
    from .dataplane import PF
    from .ports import claim, resolve
    mac, addr = parse_source(spec, f"port bind {ifname} {spec}")
    dp = obj.maps()
    index = ifindex(ifname)
    try:
        cfg = dp.ports[dp.ports.Key(index)]
    except KeyError:
        raise SwitchError(f"port {ifname} is not a port of this switch") from None
    mac = mac or resolve(ifname, addr)
    lost = claim(dp, index, mac, addr)
    ctypes.memmove(cfg.mac, bytes.fromhex(mac.replace(":", "")), 6)
    cfg.ip = int.from_bytes(socket.inet_aton(addr), "little")
    cfg.flags |= PF["SECURED"] | PF["BOUND"]
    dp.mark_clear(index, False)          # checked from now on: before the flag is written
    dp.ports[dp.ports.Key(index)] = cfg
    dp.set("port_checks", 1)
    for other in lost:
        click.echo(f"{socket.if_indextoname(other)} lost its binding")
    click.echo(f"{ifname} bound to {mac} {addr}")


# ---- cache ----------------------------------------------------------------------------------
ns_opt = click.option("--ns", type=click.IntRange(0, 0xFFFFFFFF), required=True,
                      help="Namespace id.")
key_opt = click.option("--key", required=True, help="Block key, 32 hex digits.")


@main.group()
def cache():
    """Inspect and edit cache entries and the admit set by hand."""


@cache.command("put")
@ns_opt
@key_opt
@click.option("--chunk", type=click.IntRange(0), default=0, show_default=True)
@click.option("--nchunks", type=click.IntRange(1), default=1, show_default=True)
@click.option("--file", "path", type=click.File("rb"), required=True,
              help="Payload of the chunk ('-' for stdin).")
@pass_ctx
def cache_put(obj, ns, key, chunk, nchunks, path):
    """Put one chunk into the switch cache."""
    Cache(obj.maps()).put(ns, parse_key(key), chunk, path.read(), nchunks)
    click.echo(f"put ns={ns} key={key} chunk={chunk}")


@cache.command("get")
@ns_opt
@key_opt
@click.option("--chunk", type=click.IntRange(0), default=0, show_default=True)
@click.option("--out", type=click.File("wb"), help="Write the payload here.")
@pass_ctx
def cache_get(obj, ns, key, chunk, out):
    """Show one cached chunk."""
    got = Cache(obj.maps()).get(ns, parse_key(key), chunk)
    if got is None:
        raise SwitchError(f"chunk {chunk} of block {key} (ns {ns}) is not cached")
    entry, payload = got
    if out:
        out.write(payload)
    click.echo(json.dumps(entry.as_dict()))


@cache.command("ls")
@click.option("--ns", type=click.IntRange(0, 0xFFFFFFFF), help="Only this namespace.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def cache_ls(obj, ns, as_json):
    """List cached chunks."""
    c = Cache(obj.maps())
    entries = c.entries(ns)
    if as_json:
        click.echo(json.dumps({"entries": [e.as_dict() for e in entries],
                               "admitted": [{"ns": n, "key": k.hex()} for n, k in c.admitted()]}))
        return
    for e in entries:
        click.echo(f"ns={e.ns} key={e.key.hex()} chunk={e.chunk}/{e.nchunks} len={e.len} "
                   f"hits={e.hits} {'filled' if e.filled else 'put'}")
    click.echo(f"{len(entries)} chunk(s)")


@cache.command("evict")
@ns_opt
@key_opt
@click.option("--chunk", type=click.IntRange(0), help="Only this chunk (default: whole block).")
@pass_ctx
def cache_evict(obj, ns, key, chunk):
    """Remove a block's chunks (and its admission) from the switch."""
    c = Cache(obj.maps())
    n = c.evict(ns, parse_key(key), chunk)
    if chunk is None:
        c.unadmit(ns, parse_key(key))
    click.echo(f"evicted {n} chunk(s)")


@cache.command("flush")
@click.option("--ns", type=click.IntRange(0, 0xFFFFFFFF), help="Only this namespace.")
@pass_ctx
def cache_flush(obj, ns):
    """Remove every cached chunk and admission (of one namespace)."""
    _flush(obj, ns)


@main.command("flush")
@click.option("--namespace", "ns", type=click.IntRange(0, 0xFFFFFFFF), required=True,
              help="Namespace id.")
@pass_ctx
def flush_namespace(obj, ns):
    """Remove one namespace's cached chunks and admissions."""
    _flush(obj, ns)


def _flush(obj: Context, ns: int | None) -> None:
    c = Cache(obj.maps())
    chunks = c.flush(ns)
    blocks = [b for b in c.admitted() if ns is None or b[0] == ns]
    for block in blocks:
        c.unadmit(*block)
    click.echo(f"flushed {chunks} chunk(s) and {len(blocks)} admission(s)")


@cache.command("admit")
@ns_opt
@key_opt
@click.option("--ttl", type=click.FloatRange(min=0, min_open=True),
              help="Seconds (default: until evicted).")
@pass_ctx
def cache_admit(obj, ns, key, ttl):
    """Admit and pin a block: the switch keeps its chunks as pool replies pass, and the policy
    never evicts it (until --ttl has passed: then it is an ordinary entry)."""
    Cache(obj.maps()).admit(ns, parse_key(key), ttl, pinned=True)
    click.echo(f"admitted ns={ns} key={key}" + (f" for {ttl:g}s" if ttl else ""))
