"""The KV codec as the cluster model prices it (``--kv-codec``): the codec's ratio and its
decode and encode rates as `testbed bench compress` measured them (``cfg.compress_json``,
default bench/results/compress.json; which file and row are in every result), and the load of
a prefix whose coded blocks are decoded on the inference node's CPU while later blocks are still
arriving. The codecs themselves (names, formats, keys) are ``hostagent.inference.codec``'s; this
module only reads what was measured of them, so the model never imports torch for a run.

``none`` (the default) is the model without a codec: 16-bit blocks, no decode, nothing read.
With a codec a block's bytes on the wire and in the switch and pool nodes are its 16-bit bytes
/ ``ratio`` (so are its frames, rounded up to whole chunks); node HBM and DRAM hold decoded 16-bit
KV; every block fetched from the switch or a pool node is decoded at ``decode_gbytes_per_s`` of
16-bit KV on one core (the connector's worker thread); every computed block written through is
encoded at ``encode_gbytes_per_s`` (reported as CPU, off the critical path as the write is)."""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from .config import SimError, result_file

NONE = {"name": "none", "ratio": 1.0, "decode_gbytes_per_s": None, "encode_gbytes_per_s": None,
        "source": "no codec: 16-bit blocks, nothing to decode"}


def kv_codec(cfg) -> dict:
    """The codec ``cfg.kv_codec`` as the model uses it: ``name``, ``ratio`` (16-bit bytes /
    coded bytes), ``decode_gbytes_per_s`` and ``encode_gbytes_per_s`` (of 16-bit KV, one core),
    and where they were read (``file``, ``entry``, ``spec``, ``source``). SimError (one line)
    for a name no codec has, or one the file did not measure."""
    name = str(cfg.kv_codec).strip().lower()
    if name == "none":
        return dict(NONE)
    path, shown, stamp = result_file(cfg.compress_json)
    m = dict(_measured(str(path), shown, name, stamp))
    return {**m, "file": shown,
            "source": f"{shown} {m['entry']} ({m['spec']}): ratio {m['ratio']}, decode "
                      f"{m['decode_gbytes_per_s']} GB/s, encode {m['encode_gbytes_per_s']} GB/s "
                      f"of 16-bit KV on one core"}


def _row_names(row: dict) -> set[str]:
    """What a compress.json row answers to: its codec (``int4/g64``) and its spec's tag
    (``codec=int4/g256`` -> ``int4/g256``)."""
    names = {str(row.get("codec", "")).lower()}
    spec = str(row.get("spec", ""))
    names.add(spec.removeprefix("codec=").lower())
    return names - {""}


def _unknown(name: str) -> str | None:
    """The codec module's own one-line message for a name no codec has (imported only here: it
    needs torch), else None."""
    try:
        from hostagent.inference.codec import UnknownCodec, parse
    except ImportError:
        return None
    try:
        parse(name)
    except UnknownCodec as exc:
        return str(exc)
    return None


@lru_cache(maxsize=8)
def _measured(path: str, shown: str, name: str, stamp=None) -> tuple:
    try:
        rows = json.loads(open(path).read())["results"]
        if not isinstance(rows, list):
            raise TypeError("results is not a list")
    except FileNotFoundError:
        raise SimError(f"no compression result at {shown}: run `testbed bench compress "
                       f"--codecs {name} --parts speed` (--compress-json names another)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SimError(f"{shown} is not a `testbed bench compress` result ({exc})") from None
    hit = [(i, r) for i, r in enumerate(rows) if isinstance(r, dict) and name in _row_names(r)]
    if not hit:
        have = ", ".join(str(r.get("codec")) for r in rows if isinstance(r, dict))
        raise SimError(_unknown(name) or f"KV codec {name!r} was not measured in {shown} "
                       f"(it has {have}): run `testbed bench compress --codecs {name}`")
    i, r = hit[0]
    need = ("ratio", "decode_gbytes_per_s", "encode_gbytes_per_s")
    if not all(isinstance(r.get(k), (int, float)) and r[k] > 0 for k in need):
        raise SimError(f"{shown} results[{i}] ({name}) lacks {', '.join(need)}: run `testbed "
                       f"bench compress --codecs {name} --parts speed --update`")
    return (("name", name), ("spec", r.get("spec", name)), ("entry", f"results[{i}]"),
            *((k, float(r[k])) for k in need))


def pipelined_load(offsets: np.ndarray, fetch_t: np.ndarray, decode_t: np.ndarray) -> np.ndarray:
    """Per request, when its last block is decoded: block i (in chain order) arrives after
    ``fetch_t[i]`` more seconds of fetching, and one worker decodes the arrived blocks in order,
    ``decode_t[i]`` each, while later ones arrive (a two-stage pipeline: the max over k of the
    fetches up to k plus the decodes from k on). Without decoding it is the sum of the fetches."""
    lens = np.diff(offsets)
    starts = offsets[:-1]
    cf = np.cumsum(fetch_t)
    cf -= np.repeat(cf[starts] - fetch_t[starts], lens)      # fetches up to k, this request's
    cd = np.cumsum(decode_t)
    d_end = cd[np.maximum(offsets[1:] - 1, 0)] if len(cd) else np.zeros(0)
    val = cf + np.repeat(d_end, lens) - cd + decode_t         # + decodes from k to the end
    out = np.zeros(len(lens))
    has = lens > 0
    if has.any():
        out[has] = np.maximum.reduceat(val, starts[has])
    return out
