"""Option values and option groups shared by the `testbed` commands (testbed.cli): number lists,
CPU sets, capacities, policy names, the cluster model's options and its error handling, and
`testbed up --racks` (a fabric of switches in place of the single switch: testbed.lab.fabric)."""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import click

from kvproto import CHUNK_ALIGN, MAX_CHUNK
from kvproto.cli import FINITE, FloatRange
from switchd.policy import POLICIES

from .sim.config import DEMOTES, MODELS, ROUTINGS


def numbers(value: str, kind=int, lo: float = 0, hi: float | None = None) -> list:
    try:
        items = sorted({kind(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None
    if not items or items[0] < lo or (hi is not None and items[-1] > hi):
        raise click.BadParameter(f"give numbers in [{lo}, {hi if hi is not None else 'inf'}]")
    return items


def int_list(ctx, param, value: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, distinct, positive)."""
    return numbers(value, int, 1)


def chunk_list(ctx, param, value: str) -> list[int]:
    """'1024,3072' -> chunk sizes (kvproto's one rule: check_chunk_size)."""
    sizes = numbers(value, int, CHUNK_ALIGN, MAX_CHUNK)
    if any(s % CHUNK_ALIGN for s in sizes):
        raise click.BadParameter(f"give multiples of {CHUNK_ALIGN} (the switch's chunk sizes), "
                                 f"got {value}")
    return sizes


def float_list(hi=None):
    return lambda ctx, param, value: numbers(value, float, 0, hi)


def percent_list(ctx, param, value: str) -> list[int]:
    return numbers(value, int, 0, 100) if value.strip() else []


def cpu_list(ctx, param, value: str) -> tuple[int, ...]:
    cores = numbers(value, int, 0)
    if not set(cores) <= os.sched_getaffinity(0):
        raise click.BadParameter(f"give CPUs among {sorted(os.sched_getaffinity(0))}")
    return tuple(cores)


def capacity_value(ctx, param, value):
    if value is not None and not value > 0:
        raise click.BadParameter(f"must be > 0 (a fraction of distinct blocks if < 1, else a "
                                 f"block count), got {value}")
    return value


def name_list(ctx, param, value: str | None) -> list[str] | None:
    """A comma list of names, blanks dropped, at least one (which names are valid is the
    command's check): an empty list ran nothing and said all was well."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise click.BadParameter("give at least one name")
    return names


def policy_list(ctx, param, value):
    from .sim.evaluate import policy_name
    if value is None:
        return None
    names = name_list(ctx, param, value)
    try:
        return [policy_name(n) for n in names]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def option_group(*opts):
    def apply(f):
        for opt in reversed(opts):
            f = opt(f)
        return f
    return apply


def trace_opt(f=None, help="Mooncake-format JSONL trace (default: the Mooncake FAST'25 trace that "
              "ships in testbed/traces/)."):
    """``--trace``, defaulting to the trace that ships with the project."""
    from .sim.trace import DEFAULT_TRACE
    opt = click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
                       default=DEFAULT_TRACE, show_default=False, help=help)
    return opt(f) if f is not None else opt


def writable_result(ctx, param, value):
    """A result path the run can write when it ends, tried before it starts (a file there must
    be writable; else its folders are made and a file created and removed there): a run of
    minutes is not lost to a directory's name or a place it cannot write. '' writes nothing."""
    if not value:
        return value
    path = Path(value)
    if path.is_dir():
        raise click.BadParameter(f"{value} is a directory")
    if path.exists():                   # a file to replace, or a device such as /dev/null
        if not os.access(path, os.W_OK):
            raise click.BadParameter(f"cannot write {value}")
        return value
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir():
        raise click.BadParameter(f"cannot write {value}: {folder} is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write {value}: {exc.strerror or exc}") from None
    return value


def json_opt(default=None, help="Write the result here ('' writes nothing)."):
    return click.option("--json", "json_path", default=default, show_default=bool(default),
                        callback=writable_result, help=help)


def plot_opt(default=None, help="PNG path (default: the JSON path with .png)."):
    return click.option("--plot", "plot_path", default=default, show_default=bool(default),
                        callback=writable_result, help=help)


def plot_path_for(json_path: str | None, plot_path: str | None) -> str | None:
    """--plot, else the JSON path with .png; no plot without either."""
    return plot_path or (str(Path(json_path).with_suffix(".png")) if json_path else None)


def say_wrote(*paths: str | None) -> None:
    """'wrote A and B' for the result files a run wrote (none: nothing said)."""
    if any(paths):
        click.echo(f"wrote {' and '.join(p for p in paths if p)}")


def fail_unless(ok: bool) -> None:
    if not ok:
        sys.exit(1)


def cluster_options(f):
    """SimConfig fields ``sim run`` and ``sim sweep`` share, with SimConfig's defaults (the same
    flags give the same point)."""
    from .sim.config import THROUGHPUT_JSON, SimConfig
    d, pos = SimConfig(), FloatRange(0, min_open=True)
    return option_group(
        click.option("--pools", type=click.IntRange(1), default=d.pools, show_default=True,
                     help="Pool nodes (the storage tier), fixed while inference nodes grow."),
        click.option("--model", type=click.Choice(sorted(MODELS)), default=d.model,
                     show_default=True),
        click.option("--kv-bytes-per-token", type=click.IntRange(1)),
        click.option("--block-tokens", type=click.IntRange(1, 512), default=d.block_tokens,
                     show_default=True),
        click.option("--hbm-gib", type=FloatRange(0), default=d.hbm_gib, show_default=True),
        click.option("--dram-gib", type=FloatRange(0), default=d.dram_gib,
                     show_default=True),
        click.option("--pool-gib", type=pos, help="Per pool node (default unlimited)."),
        click.option("--node-gbps", type=pos, default=d.node_gbps, show_default=True),
        click.option("--pool-gbps", type=pos, default=d.pool_gbps, show_default=True),
        click.option("--routing", type=click.Choice(ROUTINGS), default=d.routing,
                     show_default=True),
        click.option("--demote", type=click.Choice(DEMOTES), default=d.demote, show_default=True),
        click.option("--policy", "switch_policy", default=d.switch_policy, show_default=True,
                     type=click.Choice(list(POLICIES))),
        click.option("--load", type=pos, default=d.load, show_default=True,
                     help="Per-node prefill utilisation without caching."),
        click.option("--switch-budget", type=click.IntRange(1), default=d.switch_budget,
                     show_default=True, help="Switch-bound fetches simulated; more: sampled."),
        click.option("--xdp-ns-per-frame", type=pos,
                     help="Data-plane CPU per frame (default: from --throughput-json)."),
        click.option("--throughput-json", default=THROUGHPUT_JSON, show_default=True,
                     help="`testbed bench throughput` result pricing the data plane's CPU."),
        click.option("--seed", type=int, default=d.seed, show_default=True))(f)


def sim_errors(fn):
    """Run a model command: its errors are usage errors. numpy's temporaries of a large run
    (hundreds of MB each) would be mapped and unmapped on every allocation, a third of the run
    time in page faults at 1,024 nodes, so freed memory stays in this process's heap."""
    from .sim.config import SimError
    from .sim.trace import TraceError
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)                 # M_MMAP_MAX: no mmap for large blocks
        libc.mallopt(-1, 2**31 - 1)         # M_TRIM_THRESHOLD: keep freed memory
    except (OSError, AttributeError):
        pass
    try:
        return fn()
    except (TraceError, SimError) as exc:
        raise click.UsageError(str(exc)) from None


def _rate(ctx, param, value):
    if value is not None and not value > 0:
        raise click.BadParameter(f"must be > 0 Gbit/s, got {value:g}")
    return value


link_options = option_group(
    click.option("--link-gbit", type=FINITE, callback=_rate,
                 help="Rate of every inference node's link, both directions (default: an "
                      "unshaped veth). Every frame queues at it, XDP-sent ones too."),
    click.option("--pool-link-gbit", type=FINITE, callback=_rate,
                 help="Rate of every pool node's link (default: --link-gbit's)."),
    click.option("--link-delay-us", type=FloatRange(min=0), default=0.0,
                 show_default=True, help="One-way delay of shaped links (needs netem)."))


def link_spec(link_gbit, pool_link_gbit, link_delay_us):
    """A testbed.lab.links.LinkSpec from the link options (None: no shaped link). The pool
    links follow --link-gbit unless given."""
    from .lab.links import LinkSpec
    pool = pool_link_gbit if pool_link_gbit is not None else link_gbit
    if link_gbit is None and pool is None:
        if link_delay_us:
            raise click.BadParameter("needs --link-gbit or --pool-link-gbit",
                                     param_hint="--link-delay-us")
        return None
    return LinkSpec(link_gbit, pool, link_delay_us)


def fabric_up_options(command):
    @click.option("--racks", type=int, default=None,
                  help="A fabric: this many rack switches r1.. of --hosts-per-rack nodes, each "
                       "with an uplink to a pool-side switch agg in front of the pool nodes.")
    @click.option("--hosts-per-rack", type=int, default=2, show_default=True)
    @click.option("--oversub", type=FINITE, default=2.0, show_default=True,
                  help="With --racks: a rack's host links in total : its uplink.")
    @functools.wraps(command)
    def wrapper(*args, racks, hosts_per_rack, oversub, **kw):
        if racks is None:
            return command(*args, **kw)
        from .lab.fabric import Fabric
        from .lab.topology import TestbedError
        if kw["store"] != "memory":
            raise TestbedError("a fabric runs with --store memory for now")
        links = link_spec(kw["link_gbit"], kw["pool_link_gbit"], kw["link_delay_us"])
        t = Fabric(kw["name"], 0, kw["pools"], kw["mtu"], links=links, racks=racks,
                   hosts_per_rack=hosts_per_rack, oversub=oversub).up()
        rate = t.uplink_gbit()
        for b in t.boxes:
            click.echo(f"switch {b.name:3} netns {b.netns:10} ports {', '.join(b.ports)}, "
                       f"pin dir {b.pin_dir}" +
                       (f", uplink {rate:g} Gbit/s" if b.uplinks and rate else ""))
        for n in t.nodes:
            gbit = links.rate(n.role) if links else None
            box = t.rack_of(n.name).name if n.role == "host" else "agg"
            click.echo(f"  {n.name:4} {n.role:5} on {box:3} netns {n.netns:10} {n.ip}" +
                       (f"  link {gbit:g} Gbit/s" if gbit else ""))
    return wrapper
