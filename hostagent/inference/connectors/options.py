"""The option checks every connector shares: the vLLM connector's ``kv_connector_extra_config``
(``vllm_blocks.Settings``) and the options of the LMCache plugin and the SGLang backend
(``store.StoreSettings``). One function per kind of value, each raising ``BadOption`` (the
option and one line saying why), which each connector words as its own error; so a value one
connector takes, another does not refuse, and a value that cannot work or that would weaken
authentication fails the engine's start instead of failing, or switching something off, later.

  pools        IPv4 addresses or names, ``:PORT`` optional; never one no pool node can have
               (``hostagent.common.transfer.parse_addr``: unspecified, 0.0.0.0/8, broadcast,
               multicast)
  namespace    0..2^32-1 (``namespace``: why 0 is one)
  replicas     1..the number of pools: the nodes that hold each block (``hostagent.common.pools``)
  shared_store true or false (pool nodes on one Mooncake Store: any node reads any block)
  deadlines    MIN_DEADLINE..3600 seconds
  kv_codec     a codec name, its group 2..MAX_GROUP tokens, or pca[/xN][@CALIBRATION]
               (``hostagent.inference.codec.parse``)
  key file     the connector's ``auth_key_file``, else $KVSWITCH_AUTH_KEY_FILE: it must load and
               have a key for the namespace (``hostagent.common.auth.keyring_for``)
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hostagent.common import auth
from hostagent.common.transfer import parse_addr
from kvproto import check_chunk_size

DEFAULT_NS = 1                  # the namespace of a connector not told one
NS_MAX = 0xFFFFFFFF
# a deadline must leave time for an answer: a pool node's reply to one GET over loopback takes
# ~0.1 ms through the asyncio client, a block over a link far more; under 1 ms every probe and
# block would be a miss (or a lost write), logged as a silent pool node, never as the setting
MIN_DEADLINE = 0.001
MAX_SECONDS = 3600
DEADLINES = ("deadline", "probe_deadline")


class BadOption(ValueError):
    """``key`` (None: the options as a whole) cannot be used; the message says why."""

    def __init__(self, key: str | None, why: str):
        super().__init__(why)
        self.key, self.why = key, why


def mapping(options: Any, what: str) -> dict:
    """``options`` as a dict; BadOption(None) when it is not a mapping (a JSON list, say)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise BadOption(None, f"{what} must be a mapping of option names to values (a JSON "
                              f"object), not a {type(options).__name__}")
    return dict(options)


def known(options: Mapping, names: Iterable[str], noun: str = "option") -> None:
    names = list(names)
    for key in options:
        if key not in names:
            raise BadOption(key, f"unknown {noun}; known: {', '.join(names)}")


def pools(value: Any, example: str) -> tuple[str, ...]:
    """The pool nodes: a list, or one string of comma-separated addresses."""
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    if not value or not isinstance(value, (list, tuple)):
        raise BadOption("pools", f"required: {example} (the pool nodes)")
    for addr in value:
        try:
            parse_addr(str(addr))
        except ValueError as exc:
            raise BadOption("pools", str(exc)) from None
    return tuple(str(p) for p in value)


def integer(key: str, value: Any, lo: int, hi: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not lo <= value <= hi):
        raise BadOption(key, f"{value!r} is not an integer in {lo}..{hi}")


def boolean(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise BadOption(key, f"{value!r} is not true or false")


def replicas(value: Any, npools: int) -> None:
    """The nodes that hold each block: 1..the pools configured (a PUT goes to each)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= npools):
        raise BadOption("replicas", f"{value!r} is not an integer in 1..{npools} (the pool "
                                    f"nodes configured: each block is held by that many)")


def namespace(value: Any) -> None:
    """The one namespace rule: 0..2^32-1, the wire's u32. 0 is a namespace like any other: the
    switch counts namespaces below KV_NS_LOW in an array indexed by the namespace itself and
    limits ports to any u32 (xdp/kvswitch.h), the pool node keys blocks by (ns, key), key files
    and ``hostagent --ns`` / ``switchd --ns`` take 0..2^32-1; nothing reserves 0."""
    integer("namespace", value, 0, NS_MAX)


def chunk_size(value: Any) -> None:
    """kvproto's one rule for a chunk size (check_chunk_size)."""
    if value is None:
        return
    try:
        check_chunk_size(value)
    except ValueError as exc:
        raise BadOption("chunk_size", str(exc)) from None


def seconds(key: str, value: Any) -> None:
    """A number of seconds: a deadline (``DEADLINES``) MIN_DEADLINE..3600, else (0, 3600]."""
    if value is None:
        return
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if key in DEADLINES:
        if not number or not MIN_DEADLINE <= value <= MAX_SECONDS:
            raise BadOption(key, f"{value!r} is not a number of seconds in "
                                 f"{MIN_DEADLINE:g}..{MAX_SECONDS} (a deadline under "
                                 f"{MIN_DEADLINE * 1000:g} ms is too short for any answer)")
    elif not number or not 0 < value <= MAX_SECONDS:
        raise BadOption(key, f"{value!r} is not a number of seconds in (0, {MAX_SECONDS}]")


def choice(key: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value is not None and value not in choices:
        raise BadOption(key, f"{value!r} is not one of {', '.join(choices)}")


def string(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise BadOption(key, f"{value!r} is not a string")


def kv_codec(value: Any) -> None:
    from ..codec import UnknownCodec, parse
    try:
        parse(value)
    except (UnknownCodec, TypeError, AttributeError) as exc:
        raise BadOption("kv_codec", str(exc)) from None


def key_file(ns: int, path: Any) -> None:
    """The connector's key file (``auth_key_file``; None: $KVSWITCH_AUTH_KEY_FILE's, if set)
    must load and have a key for ``ns`` (``auth.keyring_for``)."""
    string("auth_key_file", path)
    try:
        auth.keyring_for(ns, path)
    except auth.KeyFileError as exc:
        raise BadOption("auth_key_file", str(exc)) from None


def common(options: Mapping, ints: Mapping[str, tuple[int, int]], example: str,
           choices: Mapping[str, Iterable[str]]) -> tuple[str, ...]:
    """Check what both connectors' options share, in this order: pools (returned), replicas
    and shared_store, namespace, chunk size, the other integers (``ints``: name -> range),
    seconds, ``choices``, model id, and the key file for the namespace."""
    found = pools(options.get("pools"), example)
    replicas(options.get("replicas"), len(found))
    boolean("shared_store", options.get("shared_store"))
    namespace(options.get("namespace"))
    chunk_size(options.get("chunk_size"))
    for key, (lo, hi) in ints.items():
        integer(key, options.get(key), lo, hi)
    for key in (*DEADLINES, "retry_s", "silence_s"):
        seconds(key, options.get(key))
    for key, allowed in choices.items():
        choice(key, options.get(key), allowed)
    string("model_id", options.get("model_id"))
    key_file(options.get("namespace", DEFAULT_NS), options.get("auth_key_file"))
    return found


__all__ = ["BadOption", "DEFAULT_NS", "MIN_DEADLINE", "NS_MAX", "boolean", "chunk_size",
           "common", "choice", "integer", "key_file", "known", "kv_codec", "mapping",
           "namespace", "pools", "replicas", "seconds", "string"]
