"""The ``pca`` transform codec (hostagent.inference.codec_pca) on a tiny seeded-random Llama
calibrated in a temporary directory: a calibration computed twice is the same file; round-trip
error within each component's quantiser cell; the decode kernels against a float64 decoder of the
documented format; fixed sizes and ratios; the calibration in the block key, a block of one
calibration refused by another; one-line refusals; and the Hugging Face and vLLM connectors'
paths giving the KV, and so the tokens, of the codec's own round trip."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from conftest import local_pool, pool_in_thread
from hostagent.inference import codec, codec_calibrate, codec_pca
from hostagent.inference.connectors.hf import (BlockLayout, KVConnector, blocks_to_cache,
                                               cache_block_tensor, codec_for, greedy, prefill)

BT = 64
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _tokens(n: int, seed: str) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG["vocab_size"]) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def _calibrate(model, seed="cal") -> bytes:
    seqs = {f"t{i}": _tokens(700, f"{seed}{i}") for i in range(3)}
    return codec_calibrate.calibrate(model, seqs, "tiny", prefixes=(128, 256), cont=64,
                                     log=lambda *_: None)


@pytest.fixture(scope="module")
def calibrations(model, tmp_path_factory):
    """Two calibrations of the model (other text), each alone in a directory, and both."""
    a, b = _calibrate(model), _calibrate(model, "other")
    dirs = {}
    for name, datas in (("a", [a]), ("b", [b]), ("both", [a, b])):
        d = tmp_path_factory.mktemp(f"cal-{name}")
        for data in datas:
            codec_calibrate.write(data, "tiny", d)
        dirs[name] = d
    return a, b, dirs


@pytest.fixture
def cal_dir(calibrations, monkeypatch):
    monkeypatch.setenv("KVSWITCH_CALIBRATION_DIR", str(calibrations[2]["a"]))
    return calibrations[2]["a"]


def _layout(model, bt=BT):
    return BlockLayout.of(model.config, torch.float32, bt)


def _kv(model, n_blocks=3, seed="p"):
    tokens = _tokens(n_blocks * BT + 9, seed)
    cache = DynamicCache(config=model.config)
    prefill(model, tokens, cache, BT)
    return tokens, cache, cache_block_tensor(cache, _layout(model))


def test_a_calibration_computed_twice_is_the_same_file(model, calibrations):
    a, b, dirs = calibrations
    assert _calibrate(model) == a                     # byte for byte
    assert a != b                                     # other text, another calibration
    path = next(dirs["a"].glob("*.safetensors"))
    ca = codec_pca.load_calibration(path)
    assert ca.id in path.name and path.read_bytes() == a
    assert (ca.layers, ca.kv_heads, ca.head_dim, ca.groups, ca.width) == (2, 2, 16, 2, 64)
    # the transform and its inverse are inverses
    for g in range(ca.groups):
        assert np.allclose(ca.enc[g] @ ca.dec[g], np.eye(64), atol=1e-4)


def _components(c, block: torch.Tensor, pos0: int) -> torch.Tensor:
    """A block's components as the encoder sees them: [G, P, T]."""
    L, _, H, T, D = block.shape
    cos, sin = c._rope(pos0, T)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    k = block[:, 0]
    k = (k * cos - torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin) / \
        c.cal.rope_scale ** 2
    y = torch.stack([k, block[:, 1]], 1).permute(0, 3, 1, 2, 4).reshape(L, T, 2 * H * D)
    return torch.bmm(y - c.mean_t[:, None], torch.from_numpy(c.cal.enc)).transpose(1, 2)


@pytest.mark.parametrize("spec", ["pca", "pca/x4", "pca/x12"])
def test_round_trip_error_is_within_each_components_cell(model, cal_dir, monkeypatch, spec):
    """Decoded in float32, each component of a block away from position 0 comes back within
    its quantiser's cell: at most half the widest gap between its levels (or, past the outer
    levels, exactly the outer level); components given 0 bits come back as 0."""
    monkeypatch.setattr(codec_pca, "BF16", False)
    c = codec_for(_layout(model), spec)
    assert not c.bf16
    _, _, kv = _kv(model)
    block, pos0 = kv[1], BT
    back = c.decode(c.encode(block, pos0))
    got, want = _components(c, back, pos0), _components(c, block, pos0)
    bits = c.plan.bits
    for g in range(c.cal.groups):
        for j in range(c.cal.width):
            b = int(bits[g, j])
            if b == 0:
                assert got[g, j].abs().max() < 1e-3
                continue
            lev = torch.from_numpy(c.cal.levels_for(g, j, b).astype(np.float32))
            inside = want[g, j].clamp(lev[0], lev[-1])
            err = (got[g, j] - inside).abs()
            bound = float((lev[1:] - lev[:-1]).max()) / 2
            assert float(err.max()) <= bound * 1.001 + 1e-3, (g, j, b)
    assert (back - block).norm() / block.norm() < 0.6
    better = codec_for(_layout(model), "pca/x4")
    assert (better.decode(better.encode(block, pos0)) - block).norm() <= \
        (codec_for(_layout(model), "pca/x12").decode(
            codec_for(_layout(model), "pca/x12").encode(block, pos0)) - block).norm()


def _reference_decode(c, coded: bytes) -> torch.Tensor:
    """The documented format decoded in float64, without the numba loops."""
    L, H, T, D = c.layers, c.kv_heads, c.block_tokens, c.head_dim
    b = np.frombuffer(coded, np.uint8)
    assert bytes(b[:4]) == b"KVPC" and bytes(b[8:16]).hex() == c.cal.sha256[:16]
    pos0 = int.from_bytes(bytes(b[4:8]), "little")
    plan = c.plan0 if pos0 == 0 else c.plan
    off = codec_pca.HEADER + (c.sink_bytes if pos0 == 0 else 0)
    bits = np.unpackbits(b[off:], bitorder="little")
    coef = np.zeros((L, 2 * H * D, T))
    p = 0
    for g in range(L):
        for j in range(2 * H * D):
            nb = int(plan.bits[g, j])
            if nb:
                codes = bits[p:p + T * nb].reshape(T, nb) @ (1 << np.arange(nb))
                coef[g, j] = c.cal.levels_for(g, j, nb).astype(np.float64)[codes]
                p += T * nb
    x = np.einsum("gjt,gjp->gtp", coef, c.cal.dec.astype(np.float64)) + \
        c.cal.mean.astype(np.float64)[:, None]
    x = torch.from_numpy(x).view(L, T, 2, H, D).permute(0, 2, 3, 1, 4)
    f = torch.arange(pos0, pos0 + T, dtype=torch.float32)[:, None] * c.inv_freq[None]
    cos = torch.cat([f.cos(), f.cos()], -1).double() * c.cal.rope_scale
    sin = torch.cat([f.sin(), f.sin()], -1).double() * c.cal.rope_scale
    k = x[:, 0]
    x[:, 0] = k * cos + torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin
    if pos0 == 0:
        n = c.rows * codec_pca.SINK * D
        q = torch.from_numpy(b[off - c.sink_bytes:][:n].view(np.int8).astype(np.float64))
        s = torch.from_numpy(b[off - c.sink_bytes + n:off].view(np.float16).astype(np.float64))
        x[:, :, :, :codec_pca.SINK] = (q.view(L, 2, H, codec_pca.SINK, D) *
                                       s.view(L, 2, H, codec_pca.SINK, 1))
    return x


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_decode_loops_are_the_documented_format(model, cal_dir, monkeypatch, bf16):
    """What the kernels write equals the payload decoded in float64 from its documented
    layout (float32 rounding; the bf16 product within bf16's precision), the first block's
    attention sinks from their INT8 copy, every block into its own rows of a longer cache."""
    monkeypatch.setattr(codec_pca, "BF16", bf16)
    c = codec_for(_layout(model), "pca")
    _, _, kv = _kv(model)
    coded = [c.encode(kv[i], i * BT) for i in range(3)]
    assert all(len(x) == c.nbytes for x in coded) and c.ratio >= 8
    cache = blocks_to_cache(coded, _layout(model), codec=c)
    got = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
    for i in range(3):
        ref = _reference_decode(c, coded[i])
        mine = got[:, :, :, i * BT:(i + 1) * BT].double()
        tol = (2e-2 if bf16 else 1e-5) * ref.abs().max().item()
        assert (mine - ref).abs().max().item() <= tol, i
        assert torch.equal(c.decode(coded[i]), got[:, :, :, i * BT:(i + 1) * BT])
    sink = kv[0][:, :, :, :codec_pca.SINK]
    step = sink.abs().amax(-1, keepdim=True) / 127
    assert ((got[:, :, :, :codec_pca.SINK] - sink).abs() <= step * 0.51 + 1e-6).all()


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_streamed_rows_equal_stored_ones_and_an_unaligned_cache_is_stored(
        model, cal_dir, monkeypatch, bf16):
    """The decode writes an aligned cache with streaming stores (finish(..., True)): the same
    bits as the plain stores; a cache whose rows are not 64-byte aligned gets the plain ones
    (a streamed store there would fault), the same bits again."""
    from hostagent.inference import codec_pca_kernels as kern
    monkeypatch.setattr(codec_pca, "BF16", bf16)
    c = codec_for(_layout(model), "pca")
    _, _, kv = _kv(model)
    coded = [c.encode(kv[i], i * BT) for i in range(3)]
    L, _, H, _, D = kv[0].shape
    used = []
    real = kern.finish
    monkeypatch.setattr(kern, "finish", lambda bf16, stream: (used.append(stream),
                                                              real(bf16, stream))[1])

    def decoded(stream: bool, shift: int) -> torch.Tensor:
        monkeypatch.setattr(codec_pca, "STREAM", stream)
        flat = torch.empty(L * 2 * H * 3 * BT * D + shift)
        out = flat[shift:].view(L, 2, H, 3 * BT, D)
        for i in range(3):
            c.decode_into(coded[i], out, i * BT)
        return out
    plain = decoded(False, 0)
    assert set(used) == {False}
    used.clear()
    assert torch.equal(decoded(True, 0), plain) and set(used) == {True}
    used.clear()
    assert torch.equal(decoded(True, 1), plain) and set(used) == {False}


def test_sizes_are_fixed_by_layout_and_ratio(model, cal_dir):
    layout = _layout(model)
    for n in (2, 4, 8, 16, 32):
        c = codec_for(layout, f"pca/x{n}")
        assert c.nbytes == 2 * c.values // n and c.ratio >= n
        assert c.tag() == f" codec=pca/x{n}@{c.cal.id}".encode()
    assert codec_for(layout, "pca").tag() == codec_for(layout, "pca/x8").tag()
    zeros = torch.zeros(layout.shape)
    c = codec_for(layout, "pca")
    assert len(c.encode(zeros, 0)) == len(c.encode(zeros, BT)) == c.nbytes
    with pytest.raises(codec.UnknownCodec, match="multiple of 8"):
        codec_for(_layout(model, 60), "pca")


def test_the_calibration_is_in_the_key_and_another_ones_blocks_are_refused(
        model, calibrations, monkeypatch):
    """Two calibrations give two tags, so two sets of block keys: a reader with the other
    calibration misses; and decoding a block under another calibration is refused."""
    a, b, dirs = calibrations
    monkeypatch.setenv("KVSWITCH_CALIBRATION_DIR", str(dirs["both"]))
    layout = _layout(model)
    ca, cb = (codec_pca.Calibration(x) for x in (a, b))
    specs = [f"pca@{ca.id}", f"pca@{cb.id}", f"pca/x4@{ca.id}"]

    class _C:
        chunk_size = 1024
    tokens = list(range(4 * BT))
    keys = {s: tuple(KVConnector(_C(), 1, layout, "m", kv_codec=s).keys(tokens)) for s in specs}
    assert len(set(keys.values())) == 3
    none = tuple(KVConnector(_C(), 1, layout, "m").keys(tokens))
    assert none not in keys.values()
    c1, c2 = (codec_for(layout, s) for s in specs[:2])
    assert c1.tag() != c2.tag() and c1.nbytes == c2.nbytes
    coded = c1.encode(torch.randn(layout.shape), BT)
    with pytest.raises(ValueError, match="calibration"):
        c2.decode(coded)
    path = next(dirs["a"].glob("*.safetensors"))
    assert codec_for(layout, f"pca@{path}").tag() == c1.tag()     # by path: the same identity


def test_which_calibration_one_line_each(model, calibrations, monkeypatch, tmp_path):
    layout = _layout(model)
    cases = [(tmp_path, "pca", "no pca calibration"),
             (calibrations[2]["both"], "pca", "several pca calibrations"),
             (calibrations[2]["a"], "pca@0123456789abcdef", "no pca calibration"),
             (calibrations[2]["a"], "pca@xyz", "hex digits"),
             (calibrations[2]["a"], f"pca@{tmp_path}/none.safetensors", "pca calibration")]
    for d, spec, msg in cases:
        monkeypatch.setenv("KVSWITCH_CALIBRATION_DIR", str(d))
        with pytest.raises(codec.UnknownCodec, match=msg) as e:
            codec_for(layout, spec)
        assert "\n" not in str(e.value)
    monkeypatch.setenv("KVSWITCH_CALIBRATION_DIR", str(calibrations[2]["a"]))
    with pytest.raises(codec.UnknownCodec, match="16 KV heads|layers"):
        codec.make("pca", 3, 2, BT, 16, torch.float32)               # another layout
    for spec in ("pca/x1", "pca/x33", "pca/g16", "pca@", "pcb"):
        with pytest.raises(codec.UnknownCodec) as e:
            codec.parse(spec)
        assert "\n" not in str(e.value)
    assert codec.parse("PCA/X6@/Some/Path") == ("pca", None)
    assert codec_pca.parse_spec("pca/x6@/Some/Path") == (6, "/Some/Path")


def _round_trip_cache(c, kv, config) -> DynamicCache:
    coded = [c.encode(kv[i], i * BT) for i in range(kv.shape[0])]
    return blocks_to_cache(coded, BlockLayout(2, 2, 16, torch.float32, BT), config, c)


def _generate(model, cache, tokens, n=12):
    logits = prefill(model, tokens, cache, BT)
    return greedy(model, logits, cache, n)


def test_the_hf_connector_gives_the_tokens_of_the_round_trip(model, cal_dir):
    """Saved and loaded through a loopback pool node with kv_codec="pca", the prefix's KV is
    bit for bit the codec's own round trip, and so are the greedy tokens after it."""
    from hostagent.inference.client import KVClient
    layout = _layout(model)
    tokens, _, kv = _kv(model)
    c = codec_for(layout, "pca")

    async def body():
        async with local_pool() as proto, KVClient([proto.sock.getsockname()], chunk_size=512,
                                                   window=16, deadline=10) as client:
            conn = KVConnector(client, 3, layout, "m", model.config, kv_codec="pca")
            cache = DynamicCache(config=model.config)
            prefill(model, tokens, cache, BT)
            put = await conn.save(tokens, cache)
            return put, await conn.load(tokens)
    put, loaded = asyncio.run(body())
    assert put.bytes == 3 * c.nbytes and loaded.blocks == 3
    own = _round_trip_cache(c, kv, model.config)
    for a, b in zip(loaded.cache.layers, own.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert _generate(model, loaded.cache, tokens) == _generate(model, own, tokens)


def test_the_vllm_connector_gives_the_tokens_of_the_round_trip(model, cal_dir):
    """vLLM's path without vLLM: pool blocks read from a CPU paged cache with their positions
    (PagedKV.read encodes), put and fetched by the connector's I/O backend through a loopback
    pool node, written into another paged cache (drain_load, PagedKV.write decodes): that cache
    holds the codec's own round trip, bit for bit, and generates the same tokens."""
    from hostagent.inference.connectors.paged_kv import PagedKV
    from hostagent.inference.connectors.vllm_blocks import LoadSpec, PoolLayout, Settings
    from hostagent.inference.connectors.vllm_pool import PoolBackend, drain_load
    tokens, _, kv = _kv(model)
    L, H, D, vb = 2, 2, 16, 16
    raw, coded = (PoolLayout(L, H, D, torch.float32, BT, vb, s) for s in ("none", "pca"))
    r = BT // vb
    ids = [list(range(j * r, (j + 1) * r))[::-1] for j in range(3)]  # any vLLM block ids

    def paged():
        return [torch.zeros(3 * r + 2, H, vb, 2 * D) for _ in range(L)]
    src = paged()
    for j in range(3):
        PagedKV(src, raw).write(kv[j].numpy().tobytes(), list(enumerate(ids[j])))
    blocks = [PagedKV(src, coded).read(ids[j], j * BT) for j in range(3)]
    assert all(len(b) == coded.coded_bytes for b in blocks)

    with pool_in_thread() as addr:
        b = PoolBackend(Settings.from_extra({"pools": [addr], "chunk_size": 512,
                                             "namespace": 4, "kv_codec": "pca"}))
        keys = coded.keys(tokens, "m")[:3]
        b.save(4, keys, blocks)
        assert b.flush(20)
        dst = paged()
        ld = LoadSpec("r", keys, 0, [list(enumerate(ids[j])) for j in range(3)], 3 * BT)
        loaded, _, error = drain_load(ld, b.fetch(4, keys, coded.nchunks(512)),
                                      PagedKV(dst, coded), 20)
        assert (loaded, error) == (3, None)
    got = torch.stack([torch.frombuffer(bytearray(PagedKV(dst, raw).read(ids[j])),
                                        dtype=torch.float32).view(raw.shape)
                       for j in range(3)])
    c = codec_for(_layout(model), "pca")
    own = torch.stack([c.decode(c.encode(kv[j], j * BT)) for j in range(3)])
    assert torch.equal(got, own)
    cache = DynamicCache([(torch.cat(list(got[:, i, 0]), 1)[None],
                           torch.cat(list(got[:, i, 1]), 1)[None]) for i in range(L)],
                         config=model.config)
    assert _generate(model, cache, tokens) == _generate(model, _round_trip_cache(
        c, kv, model.config), tokens)


def test_the_loaded_run_rotates_codecs_and_summarises_per_codec():
    """bench compress --parts loaded, its pure parts: every codec once a round, the order
    rotating; TTFT p50/p99 per codec over every reader and round, and against raw's p50."""
    from testbed.bench.quality.compress_loaded import schedule, summarize
    lines = schedule(["none", "pca"], 3)
    assert lines == ["none", "pca", "pca", "none", "none", "pca"]
    records = [[{"ttft_s": (4.0 if c == "none" else 1.0) + r, "load_s": 0.5, "bytes": 10 if
                 c == "none" else 2} for c in lines] for r in range(8)]
    out = summarize(["none", "pca"], lines, records)
    assert out["none"]["samples"] == out["pca"]["samples"] == 24
    assert out["none"]["ttft_p50_s"] == 7.5 and out["pca"]["ttft_p50_s"] == 4.5
    assert out["pca"]["ttft_p50_vs_raw"] == 0.6 and out["none"]["ttft_p50_vs_raw"] == 1.0
    assert out["pca"]["ttft_p99_s"] == 8.0 and out["pca"]["reader_bytes"] == 2


def test_quality_windows_never_use_calibration_text():
    """Every codec's quality is measured on license texts the pca calibration does not use."""
    from testbed.bench.quality.compress import windows
    from testbed.demos.realmodel import texts

    class Tok:                                   # a word a token is enough to cut windows
        def __call__(self, text):
            return {"input_ids": text.split()}
    got = windows(Tok(), 300, 20)
    names = {n.partition("@")[0] for n, _ in got}
    assert len(got) == 20 and names and not names & set(codec_pca.CALIBRATION_TEXTS)
    assert set(codec_pca.CALIBRATION_TEXTS) <= set(texts())       # and they exist here
