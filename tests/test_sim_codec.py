"""The cluster model with a KV codec (#28, testbed.sim.codec): the codec's ratio and decode rate
read from `testbed bench compress`'s result (file and row named), blocks shrinking on the wire
and in the switch by exactly the ratio, decoding on the node overlapping later fetches and
showing in TTFT, ``none`` giving the model's numbers from before codecs, and bad names failing
in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from testbed.cli import main
from testbed.sim.codec import kv_codec, pipelined_load
from testbed.sim.config import GIB, SimConfig, SimError
from testbed.sim.model import point, simulate
from testbed.sim.trace import load_trace
from testbed.sim.workload import Workload

TRACE_HEAD = Path(__file__).parent / "data" / "mooncake-head300.jsonl"
BLOCK = 8192                        # 16 bytes a token x 512: 8 chunks of 1,024 B
DECODE_S = 0.01                     # the test codec decodes a block in 10 ms
ROWS = [{"codec": "none", "spec": "none", "ratio": 1.0, "encode_gbytes_per_s": 1.0,
         "decode_gbytes_per_s": 2.0},
        {"codec": "int4", "spec": "codec=int4/g256", "ratio": 4.0,
         "encode_gbytes_per_s": BLOCK / 0.5 / 1e9, "decode_gbytes_per_s": BLOCK / DECODE_S / 1e9},
        {"codec": "int8", "spec": "codec=int8/g16", "ratio": 1.9961,
         "encode_gbytes_per_s": 0.071}]     # measured without its decode rate


def _wl(chains, times, tokens=512):
    offsets = np.zeros(len(chains) + 1, np.int64)
    np.cumsum([len(c) for c in chains], out=offsets[1:])
    return Workload(np.asarray(times, float), np.array([len(c) * tokens for c in chains]),
                    offsets, np.array([h for c in chains for h in c], np.int64))


def _cfg(tmp_path, **kw):
    f = tmp_path / "compress.json"
    f.write_text(json.dumps({"results": ROWS}))
    base = dict(nodes=2, pools=1, kv_bytes_per_token=16, hbm_gib=0, dram_gib=0, switch_gib=0,
                chunk_bytes=1024, demote="none", switch_budget=10**9, xdp_ns_per_frame=1000.0,
                compress_json=str(f))
    base.update(kw)
    return SimConfig(**base)


def test_codec_is_read_from_the_compress_result_and_named(tmp_path):
    c = kv_codec(_cfg(tmp_path, kv_codec="int4"))
    assert (c["ratio"], c["entry"], c["spec"]) == (4.0, "results[1]", "codec=int4/g256")
    assert c["file"].endswith("compress.json") and "results[1]" in c["source"]
    assert kv_codec(_cfg(tmp_path, kv_codec="INT4/g256"))["entry"] == "results[1]"  # its spec
    assert kv_codec(_cfg(tmp_path, kv_codec="none", compress_json="/missing.json"))["ratio"] == 1
    with pytest.raises(SimError, match="decode_gbytes_per_s"):
        kv_codec(_cfg(tmp_path, kv_codec="int8"))
    with pytest.raises(SimError, match="not measured in .*compress.json .*it has none, int4"):
        kv_codec(_cfg(tmp_path, kv_codec="fp8"))
    with pytest.raises(SimError, match="testbed bench compress"):
        kv_codec(_cfg(tmp_path, kv_codec="int4", compress_json=str(tmp_path / "no.json")))


def test_ratio_shrinks_bytes_frames_and_switch_capacity_exactly(tmp_path):
    # blocks 1 and 2 are fetched again and again (from the switch with it on); the switch has
    # room for every block with or without the codec, so the same fetches hit
    wl = _wl([[1, 2, 3], [1, 2, 9]] * 3, [0.0, 10.0, 20.0, 30.0, 40.0, 50.0])
    kw = dict(switch_gib=16 * BLOCK / GIB, switch_policy="lru", routing="least-loaded")
    raw, coded = simulate(wl, _cfg(tmp_path, **kw)), simulate(wl, _cfg(tmp_path, kv_codec="int4",
                                                                       **kw))
    for mode in ("pool_off", "pool_on"):
        r, c = raw[mode], coded[mode]
        assert c["remote_bytes"] * 4 == r["remote_bytes"] > 0
        for link, v in r["bytes"].items():
            if link != "dram_to_hbm":                    # 8 frames of 1,024 B become 2
                assert c["bytes"][link] * 4 == v, link
    assert coded["pool_on"]["switch"]["frames_per_s"] * 4 == pytest.approx(   # 0.1 rounding
        raw["pool_on"]["switch"]["frames_per_s"], abs=0.2)
    assert coded["pool_on"]["hit_ratio"] == raw["pool_on"]["hit_ratio"]
    assert raw["pool_on"]["hit_ratio"]["switch"] > 0
    assert coded["pool_on"]["switch"]["capacity_blocks"] == 4 * raw["pool_on"]["switch"][
        "capacity_blocks"] == 64                        # the same bytes hold 4x the blocks
    assert coded["switch_benefit"]["xdp_cores"] * 4 == pytest.approx(
        raw["switch_benefit"]["xdp_cores"], rel=1e-3)
    assert coded["kv_codec"]["entry"] == "results[1]"


def test_decode_time_is_in_ttft_and_overlaps_later_fetches(tmp_path):
    # request 2 loads blocks 1, 2 from the pool node over slow links (a coded block's fetch
    # takes about as long as its 10 ms decode) and decodes each as it arrives, before its
    # prefill; request 1 recomputes everything
    wl = _wl([[1, 2, 3], [1, 2, 9]], [0.0, 10.0])
    bps = (BLOCK / 4 + 2 * 90) / 0.01                # bytes/s: a coded block in 10 ms
    kw = dict(node_gbps=bps * 8 / 1e9, pool_gbps=bps * 8 / 1e9)
    raw = simulate(wl, _cfg(tmp_path, **kw))
    coded = simulate(wl, _cfg(tmp_path, kv_codec="int4", **kw))

    def fetch(wire):                                 # both blocks load the link that second
        return wire / (bps * (1 - 2 * wire / bps))
    f_raw, f_coded = fetch(BLOCK + 8 * 90), fetch(BLOCK / 4 + 2 * 90)
    # the second block arrives while the first is decoded, then waits for the decoder
    load_coded = max(f_coded + DECODE_S, 2 * f_coded) + DECODE_S
    assert load_coded < 2 * (f_coded + DECODE_S) - 0.009            # overlapped, not serial
    for mode in ("pool_off", "pool_on"):
        assert coded[mode]["ttft_s"]["mean"] - raw[mode]["ttft_s"]["mean"] == pytest.approx(
            (load_coded - 2 * f_raw) / 2, abs=2e-4)                 # the mean of 2 requests
        assert coded[mode]["kv_codec_cpu_s"]["decode"] == pytest.approx(2 * DECODE_S)
        assert coded[mode]["kv_codec_cpu_s"]["encode"] == pytest.approx(4 * 0.5)  # 4 computed
    assert "kv_codec_cpu_s" not in raw["pool_off"]


def test_pipelined_load_is_a_two_stage_flow_shop():
    rng = np.random.default_rng(3)
    lens = np.array([3, 0, 1, 5, 2])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    f, d = rng.random(lens.sum()), rng.random(lens.sum()) * (rng.random(lens.sum()) < 0.7)
    want = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        fetched = decoded = 0.0
        for i in range(a, b):                   # block i arrives, then waits for the decoder
            fetched += f[i]
            decoded = max(decoded, fetched) + d[i]
        want.append(decoded)
    assert pipelined_load(offsets, f, d) == pytest.approx(want, abs=1e-12)
    assert pipelined_load(offsets, f, np.zeros_like(f)) == pytest.approx(
        np.bincount(np.repeat(np.arange(5), lens), weights=f, minlength=5))


def test_none_gives_the_model_without_codecs():
    # these figures were computed by the model before codecs existed (9435c85), same point
    r = point(load_trace(str(TRACE_HEAD)), SimConfig(nodes=4, xdp_ns_per_frame=1000.0), None, 0.5)
    off, on = r["pool_off"], r["pool_on"]
    assert off["bytes"]["switch_to_nodes"] == 342454931368
    assert on["bytes"]["pool_to_switch"] == 319176655020
    assert (off["remote_bytes"], off["gpu_s_total"], on["gpu_s_total"]) == (300446384128,
                                                                            1354.49, 1354.08)
    assert (off["ttft_s"], on["ttft_s"]["p50"]) == ({"p50": 0.2384, "p99": 12.2821,
                                                     "mean": 1.6931}, 0.2353)
    assert on["hit_ratio"]["switch"] == 0.015293
    assert (r["switch_benefit"]["net_usd_per_hour"], on["switch"]["frames_per_s"]) == \
        (-0.3934, 2491150.5)
    assert r["kv_codec"]["name"] == "none" and "kv_codec_cores" not in r["switch_benefit"]


def test_cli_codec_option_and_bad_names(tmp_path):
    cfg = _cfg(tmp_path)
    flags = ["sim", "run", "--trace", str(TRACE_HEAD), "--requests", "300",
             "--compress-json", cfg.compress_json, "--xdp-ns-per-frame", "1000"]
    outs = []
    for extra in ([], ["--kv-codec", "none"], ["--kv-codec", "int4"]):
        out = tmp_path / f"r{len(outs)}.json"
        r = CliRunner().invoke(main, [*flags, *extra, "--json", str(out)])
        assert r.exit_code == 0, r.output
        res = json.loads(out.read_text())
        res.pop("wall_seconds"), res["point"].pop("wall_seconds")
        outs.append(res)
    assert outs[0] == outs[1]
    assert outs[2]["pool_off"]["remote_bytes"] * 4 == outs[0]["pool_off"]["remote_bytes"]
    assert outs[2]["point"]["kv_codec"] == "int4"
    for bad, says in (("zstd", "unknown KV codec 'zstd': choose one of none, int8, fp8, int4"),
                      ("fp8", "KV codec 'fp8' was not measured in")):
        for cmd in (flags, ["sim", "sweep", "--trace", str(TRACE_HEAD), "--nodes", "4",
                            "--compress-json", cfg.compress_json, "--json", "", "--plot", ""]):
            r = CliRunner().invoke(main, [*cmd, "--kv-codec", bad])
            assert r.exit_code == 2
            (line,) = r.output.strip().splitlines()      # `testbed: error: ...`
            assert says in line
