"""The `hostagent` command line: serve a pool node, put and get whole blocks, hash token ids,
calibrate the pca KV codec for a model.

Results print as one JSON object per command so scripts (and the testbed) can read them.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import click

from .inference import client as kvclient
from .common.transfer import BlockNotFound, Refused, TransferTimeout, parse_addr
from .common.hashing import DEFAULT_BLOCK_TOKENS, block_hashes
from kvproto import MAX_CHUNK, PORT, Status, check_chunk_size
from kvproto.cli import FINITE, FloatRange, SizeType, chunk_option, one_line_errors, with_config
from .pool.server import serve as serve_forever
from .pool.store import MemoryStore, PutBudgets


def _key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not hex") from None
    if len(key) != 16:
        raise click.BadParameter("a block key is 16 bytes: 32 hex digits")
    return key


def _pools(ctx, param, values) -> list[tuple[str, int]]:
    try:
        return [parse_addr(v) for v in values]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _placement(pools, replicas: int):
    """The pools with ``replicas`` nodes holding each block; one line if there are fewer."""
    from .common.pools import Placement
    if replicas > len(pools):
        raise click.BadParameter(f"{replicas} replicas, but {len(pools)} --pool node(s)",
                                 param_hint="--replicas")
    return Placement(pools, replicas)


pool_opt = click.option("--pool", "pools", multiple=True, required=True, metavar="IP[:PORT]",
                        callback=_pools,
                        help="Pool node address (repeatable; blocks are spread by key).")
ns_opt = click.option("--ns", type=click.IntRange(0, 0xFFFFFFFF), default=1, show_default=True,
                      help="Namespace id.")
key_opt = click.option("--key", required=True, help="Block key, 32 hex digits.")


chunk_opt = chunk_option()
window_opt = click.option("--window", type=click.IntRange(1, 4096), default=64,
                          show_default=True, help="Chunk requests in flight per block.")
replicas_opt = click.option("--replicas", type=click.IntRange(1, 64), default=1,
                            show_default=True,
                            help="Pool nodes that hold each block (the first N of its "
                                 "rendezvous order): a PUT goes to each, a GET asks the next "
                                 "when one stays silent.")
deadline_opt = click.option("--deadline", type=FloatRange(0, 86400, min_open=True),
                            default=30.0, show_default=True, help="Seconds before giving up.")


auth_opt = click.option("--auth-key-file", type=click.Path(dir_okay=False),
                        envvar="KVSWITCH_AUTH_KEY_FILE", help="Keyed block authentication "
                        "(docs/auth.md): blocks of a namespace this file has a key for are "
                        "sealed on put and checked on get [env KVSWITCH_AUTH_KEY_FILE].")


def _keyring(path, ns: int):
    """The key file's keyring, None without one; refused (one line) where it cannot be used or
    has no key for ``ns``: the one rule of every connector (``auth.keyring_for``)."""
    from .common import auth
    try:
        return auth.keyring_for(ns, path) if path else None
    except auth.KeyFileError as exc:
        raise click.BadParameter(str(exc), param_hint="--auth-key-file") from None


def _writable(ctx, param, value):
    """A file to write, checked before the transfer (click opens it only at the first write)."""
    name = getattr(value, "name", "-")
    if value is not None and name != "-":
        where = os.path.dirname(os.path.abspath(name))
        if not os.path.isdir(where) or not os.access(where, os.W_OK):
            raise click.BadParameter(f"cannot write into {where}")
    return value


def _run(coro, pools=()):
    try:
        return asyncio.run(coro)
    except (BlockNotFound, TransferTimeout, Refused) as exc:
        click.echo(f"hostagent: error: {exc.args[0] if exc.args else exc}", err=True)
        sys.exit(1)
    except OSError as exc:                 # no route, no interface, a refused socket call
        where = ", ".join(f"{h}:{p}" for h, p in pools) or "the pool"
        click.echo(f"hostagent: error: cannot reach {where}: {exc.strerror or exc}", err=True)
        sys.exit(1)


@click.group(cls=one_line_errors("hostagent", BlockNotFound, TransferTimeout, Refused))
@click.option("-v", "--verbose", is_flag=True)
def main(verbose):
    """KV block protocol endpoints: pool node server and inference node client."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(name)s: %(message)s")


def _given(ctx: click.Context, values: dict, name: str) -> bool:
    return (ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE or
            name in values.get("_from_config", ()))


def _make_store(ctx: click.Context, v: dict):
    """The store ``hostagent serve`` was asked for; one-line errors for what cannot work."""
    if v["capacity"] <= 0:
        raise click.BadParameter("capacity must be positive", param_hint="--capacity")
    for name in ("assembly", "assembly_per_ns", "assembly_per_source"):
        if v[name] <= 0:
            raise click.BadParameter("must be positive", param_hint=f"--{name.replace('_', '-')}")
    if v["pool_chunk_size"]:
        try:
            check_chunk_size(v["pool_chunk_size"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--chunk-size") from None
    budgets = PutBudgets(v["assembly"], min(v["assembly_per_ns"], v["assembly"]),
                         min(v["assembly_per_source"], v["assembly"]), v["incomplete_blocks"],
                         v["incomplete_per_ns"], v["incomplete_per_source"],
                         v["assembly_timeout"], v["pool_chunk_size"] or 0)
    common = {"budgets": budgets, "xdp_slots_per_ns": v["xdp_slots_per_ns"],
              "disk": _disk_tier(ctx, v)}
    if v["store_kind"] == "memory":
        for name in ("mooncake_master", "mooncake_metadata", "replicas", "segment"):
            if _given(ctx, v, name):
                raise click.UsageError(f"--{name.replace('_', '-')} needs --store mooncake")
        return _allocated(MemoryStore, v["capacity"], **common)
    from .pool.mooncake_store import MooncakeMissing, MooncakeStore, load_mooncake, parse_master
    if not v["mooncake_master"]:
        raise click.UsageError("--store mooncake needs --mooncake-master HOST[:PORT]")
    try:
        parse_master(v["mooncake_master"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mooncake-master") from None
    if v["segment"] < 1 << 20:
        raise click.BadParameter("a segment is at least 1MiB", param_hint="--segment")
    try:
        load_mooncake()
    except MooncakeMissing as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return _allocated(MooncakeStore, v["capacity"], v["mooncake_master"], v["replicas"],
                          v["segment"], v["mooncake_metadata"], **common)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _disk_tier(ctx: click.Context, v: dict):
    """The pool disk tier ``--disk-dir``/``--disk-bytes`` ask for, or None."""
    if not v["disk_dir"]:
        if _given(ctx, v, "disk_bytes"):
            raise click.UsageError("--disk-bytes needs --disk-dir DIR")
        return None
    if v["disk_bytes"] <= 0:
        raise click.BadParameter("must be positive", param_hint="--disk-bytes")
    where = Path(v["disk_dir"])
    if where.exists() and not where.is_dir():
        raise click.BadParameter(f"{where} is not a directory", param_hint="--disk-dir")
    from .pool.disk_tier import DiskTier
    return DiskTier(where, v["disk_bytes"])     # an unwritable one: one log line, DRAM only


def _allocated(make, capacity: int, *args, **kw):
    """``make(capacity, ...)``; memory the machine cannot give is one line, not a traceback."""
    try:
        return make(capacity, *args, **kw)
    except (MemoryError, OSError) as exc:
        why = getattr(exc, "strerror", None) or exc.__class__.__name__
        raise click.BadParameter(f"cannot allocate {capacity} bytes of staging memory: {why}",
                                 param_hint="--capacity") from None


@main.command("check")
@chunk_option(help="The chunk size to compile the fetch engine for.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def check_cmd(chunk_size, as_json):
    """What this kernel grants a node's programs (the fetch engine, the pool's XDP server),
    feature by feature; run it first. Exits non-zero when one of them cannot load."""
    from xdp.features import emit
    from xdp.loader import preflight
    from .check import node_check
    preflight()
    sys.exit(emit("hostagent", node_check(chunk_size), as_json))


@main.command()
@click.option("--config", type=click.Path(dir_okay=False),
              help="TOML file with the same keys (store, mooncake_master, capacity, ...); "
                   "the command line wins.")
@click.option("--bind", default="0.0.0.0", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=PORT, show_default=True)
@click.option("--store", "store_kind", type=click.Choice(["memory", "mooncake"]),
              default="memory", show_default=True,
              help="Where blocks live: this process's memory, or a Mooncake Store cluster.")
@click.option("--capacity", type=SizeType(), default="1GiB", show_default=True,
              help="Bytes of blocks held in this process: all of them (memory), the ones "
                   "staged to serve (mooncake).")
@click.option("--mooncake-master", metavar="HOST[:PORT]",
              help="The Mooncake master's RPC address (port 50051 if not given).")
@click.option("--mooncake-metadata", metavar="URL",
              help="Metadata server [default: the master's own, http://HOST:8080/metadata].")
@click.option("--replicas", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Copies of every block, on distinct pool nodes (mooncake).")
@click.option("--segment", type=SizeType(), default="512MiB", show_default=True,
              help="Memory this node lends the Mooncake cluster (mooncake).")
@click.option("--assembly", type=SizeType(), default="256MiB", show_default=True,
              help="Bytes of incomplete PUT blocks held at most (payload and per-chunk "
                   "overhead, as they take memory).")
@click.option("--assembly-per-ns", type=SizeType(), default="128MiB", show_default=True,
              help="... of them one namespace may hold.")
@click.option("--assembly-per-source", type=SizeType(), default="128MiB", show_default=True,
              help="... of them one source address may hold.")
@click.option("--incomplete-blocks", type=click.IntRange(1, 1 << 20), default=4096,
              show_default=True, help="Incomplete PUT blocks held at most.")
@click.option("--incomplete-per-ns", type=click.IntRange(1, 1 << 20), default=256,
              show_default=True, help="... of them one namespace may hold.")
@click.option("--incomplete-per-source", type=click.IntRange(1, 1 << 20), default=256,
              show_default=True, help="... of them one source address may hold.")
@click.option("--assembly-timeout", type=FloatRange(0, 86400, min_open=True),
              default=10.0, show_default=True,
              help="Seconds an incomplete block waits for a new chunk (a re-sent one does not "
                   "count).")
@click.option("--chunk-size", "pool_chunk_size", type=click.IntRange(0, MAX_CHUNK), default=0,
              show_default=True, help="Bytes every chunk but a block's last must have "
                                      "(0: the block's first full chunk sets it).")
@click.option("--xdp-slots-per-ns", type=click.IntRange(0), default=None,
              help="Chunk slots for blocks of chunks under 1 KiB one namespace may take in "
                   "XDP serving [default: a quarter of them].")
@click.option("--disk-dir", type=click.Path(file_okay=False), default=None,
              help="Pool disk tier: keep blocks that leave this node's DRAM in this directory "
                   "and stage them back on a GET (docs/pool-nodes.md#tiers).")
@click.option("--disk-bytes", type=SizeType(), default="16GiB", show_default=True,
              help="Bytes of blocks the disk tier keeps at most (least recently used go).")
@click.option("--stats-file", type=click.Path(dir_okay=False),
              help="Write the request counters here as JSON on SIGUSR1 and on exit.")
def serve(config, **_):
    """Run a pool (storage) node until interrupted."""
    ctx = click.get_current_context()
    v = with_config(ctx, config, {"store": "store_kind", "chunk_size": "pool_chunk_size"})
    bind, port, stats_file = v["bind"], v["port"], v["stats_file"]
    if stats_file:
        where = os.path.dirname(os.path.abspath(stats_file))
        if not os.path.isdir(where) or not os.access(where, os.W_OK):
            raise click.BadParameter(f"cannot write into {where}", param_hint="--stats-file")
    store = _make_store(ctx, v)

    async def go():
        ready, stop = asyncio.Event(), asyncio.Event()
        server = {}
        task = asyncio.create_task(serve_forever(bind, port, v["capacity"], ready, stop, server,
                                                 store=store))
        await asyncio.wait([task, asyncio.create_task(ready.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()                  # start-up failed: raise why
        loop = asyncio.get_running_loop()

        def dump():
            if stats_file:       # whole or not at all: a reader never sees half a file
                with open(stats_file + ".tmp", "w") as f:
                    json.dump(server["protocol"].stats(), f)
                os.replace(stats_file + ".tmp", stats_file)

        def finish():            # the last counters, read while the XDP maps are still open
            dump()
            stop.set()

        loop.add_signal_handler(signal.SIGUSR1, dump)
        loop.add_signal_handler(signal.SIGTERM, finish)
        loop.add_signal_handler(signal.SIGINT, finish)
        click.echo(f"hostagent: pool node ready on {bind}:{port} ({store.describe()})",
                   err=True)
        await task

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        click.echo(f"hostagent: error: cannot serve on {bind}:{port}: {exc.strerror}", err=True)
        sys.exit(1)
    if getattr(store, "abandoned", False):  # a Mooncake client the absent master cannot release
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@main.command()
@pool_opt
@ns_opt
@key_opt
@click.option("--file", "path", type=click.File("rb"), required=True,
              help="The block's bytes ('-' for stdin).")
@chunk_opt
@window_opt
@replicas_opt
@deadline_opt
@auth_opt
def put(pools, ns, key, path, chunk_size, window, replicas, deadline, auth_key_file):
    """Store a whole block on its pool node (on each of its --replicas nodes)."""
    data = path.read()
    if not data:
        raise click.BadParameter("the block is empty", param_hint="--file")
    ring = _keyring(auth_key_file, ns)
    place = _placement(pools, replicas)

    async def go():
        async with kvclient.KVClient(place, chunk_size, window, deadline, auth=ring) as c:
            return await c.put_block(ns, _key(key), data)

    stats = _run(go(), pools)
    click.echo(json.dumps({"op": "put", "ns": ns, "key": key, **stats.as_dict()}))


@main.command()
@pool_opt
@ns_opt
@key_opt
@click.option("--out", type=click.File("wb"), callback=_writable, help="Write the block here.")
@click.option("--no-cache", is_flag=True, help="Bypass the switch cache.")
@click.option("--start-at", type=FINITE, metavar="UNIXTIME",
              help="Wait until this wall-clock time before asking (to start many readers at once).")
@chunk_opt
@window_opt
@replicas_opt
@deadline_opt
@auth_opt
def get(pools, ns, key, out, no_cache, start_at, chunk_size, window, replicas, deadline,
        auth_key_file):
    """Fetch a whole block, byte-exact; prints where its chunks came from. Uses the XDP fetch
    engine where it can run (root, the node's interface free), else the asyncio client; a log
    line says which."""
    from .common.auth import AuthError
    from .inference.fetch import open_client
    key_bytes = _key(key)
    ring = _keyring(auth_key_file, ns)
    place = _placement(pools, replicas)

    async def go():
        # the engine's arena starts small and grows to the block once its size is known
        async with open_client(place, chunk_size, window, deadline, arena_bytes=4 << 20,
                               auth=ring) as c:
            if start_at:
                await asyncio.sleep(max(0.0, start_at - time.time()))
            return await _until_available(lambda: c.get_block(ns, key_bytes, no_cache=no_cache),
                                          deadline)

    try:
        data, stats = _run(go(), pools)
    except AuthError as exc:           # nothing of the block is written
        raise click.ClickException(str(exc)) from None
    if out:
        out.write(data)
    click.echo(json.dumps({"op": "get", "ns": ns, "key": key,
                           "sha256": hashlib.sha256(data).hexdigest(), **stats.as_dict()}))


async def _until_available(fetch, deadline: float, pause_s: float = 0.5):
    """``await fetch()``, asked again while the pool node refuses with UNAVAILABLE (it cannot
    reach its store right now: a Mooncake replica on a node that died stays listed until the
    master's client TTL ends) and the deadline leaves time; one line says so the first time.
    An ask after the first gets what is left of the deadline, so the whole takes at most about
    one deadline (the first ask is bounded by the client's own)."""
    give_up = time.monotonic() + deadline
    said = False
    while True:
        try:
            if not said:
                return await fetch()
            return await asyncio.wait_for(fetch(), max(0.0, give_up - time.monotonic()))
        except TransferTimeout:
            raise
        except TimeoutError:         # wait_for's: what was left of the deadline ran out
            raise TransferTimeout(f"the block was still unavailable when the {deadline:g} s "
                                  "deadline passed") from None
        except Refused as exc:
            if exc.status != Status.UNAVAILABLE or time.monotonic() + pause_s > give_up:
                raise
            if not said:
                click.echo(f"hostagent: {exc}; asking again until the deadline", err=True)
                said = True
            await asyncio.sleep(pause_s)


@main.command("hash")
@click.argument("tokens", nargs=-1, type=click.IntRange(0, 0xFFFFFFFF), required=True)
@click.option("--block-tokens", type=click.IntRange(1), default=DEFAULT_BLOCK_TOKENS,
              show_default=True)
@click.option("--extra", default="", help="Cache-separating salt (model id, adapter...).")
def hash_cmd(tokens, block_tokens, extra):
    """Chained prefix keys of a token sequence (one per full block)."""
    if len(tokens) < block_tokens:
        raise click.BadParameter(f"{len(tokens)} token(s) make no full block of {block_tokens}"
                                 " (--block-tokens)", param_hint="TOKENS")
    for key in block_hashes(tokens, block_tokens, extra.encode()):
        click.echo(key.hex())


@main.group("codec")
def codec_group():
    """KV codecs: calibrate the pca transform codec for a model (the inference extra)."""


@codec_group.command("calibrate")
@click.option("--model", "model_dir", required=True,
              type=click.Path(file_okay=False, exists=True),
              help="A transformers checkpoint directory (config, weights, tokenizer).")
@click.option("--text", "text_files", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="Calibration text (repeat); default: Debian's license texts Apache-2.0, "
                   "Artistic, BSD, CC0-1.0, MPL-1.1, MPL-2.0.")
@click.option("--max-tokens", type=click.IntRange(256, 1 << 16), default=8192, show_default=True,
              help="Tokens of each text used.")
@click.option("--out-dir", type=click.Path(file_okay=False),
              help="Where to store it (default $KVSWITCH_CALIBRATION_DIR or "
                   "~/.cache/kvswitch/calibrations).")
def codec_calibrate(model_dir, text_files, max_tokens, out_dir):
    """Compute the pca codec's calibration of a model (deterministic: the same model and text
    give the same file); prints its path, SHA-256 and the kv_codec that names it."""
    from .inference.codec_calibrate import calibrate_dir
    click.echo(json.dumps(calibrate_dir(model_dir, text_files, max_tokens, out_dir,
                                        log=lambda m: click.echo(m, err=True))))
