"""The `testbed` command line: build and remove topologies, run the demo, evaluate policies."""
from __future__ import annotations

import sys

import click

from .topology import TestbedError, Topology, down, namespaces_of


class TestbedGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TestbedError as exc:
            click.echo(f"testbed: error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=TestbedGroup)
def main():
    """veth/namespace testbeds for the in-network KV-cache switch."""


@main.command()
@click.option("--name", default="kv", show_default=True, help="Prefix of every object made.")
@click.option("--hosts", type=click.IntRange(1, 99), default=2, show_default=True)
@click.option("--pools", type=click.IntRange(1, 99), default=1, show_default=True)
@click.option("--mtu", type=click.IntRange(1280, 3520), default=1500, show_default=True)
def up(name, hosts, pools, mtu):
    """Build a switch namespace with a bridge, inference nodes h1.. and pool nodes p1.."""
    t = Topology(name, hosts, pools, mtu).up()
    click.echo(f"testbed {name}: switch netns {t.switch_ns} (bridge ports "
               f"{', '.join(t.ports)}), pin dir {t.pin_dir}")
    for n in t.nodes:
        click.echo(f"  {n.name:4} {n.role:5} netns {n.netns:10} {n.ip}")


@main.command("down")
@click.option("--name", default="kv", show_default=True)
@click.option("--all", "everything", is_flag=True, help="Every testbed this tool made.")
def down_cmd(name, everything):
    """Remove a testbed and anything left running in it (idempotent)."""
    prefixes = {n.rsplit("-", 1)[0] for n in namespaces_of("") if n.endswith("-sw")} \
        if everything else {name}
    removed = [ns for p in sorted(prefixes) for ns in down(p)]
    click.echo(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed else ""))


@main.command()
@click.option("--chunks", type=click.IntRange(64, 65536), default=256, show_default=True)
def demo(chunks):
    """Fetch a KV block through the switch from two inference nodes (see `make demo`)."""
    from .demo import run_demo
    if not run_demo(chunks):
        sys.exit(1)


def _register_optional():
    try:
        from .policy_eval import policy_eval
    except ImportError:
        return
    main.add_command(policy_eval, "policy-eval")


_register_optional()
