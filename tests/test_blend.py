"""CacheBlend (hostagent/inference/blend.py, hostagent/inference/blend_store.py): RoPE re-rotation,
token selection, the fused prefill, passage keys, passages missing from every tier. Fast cases on a
tiny random-weight Llama; the re-rotation also on the real model (SmolLM2-135M, which must be
installed: the failure says how)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hostagent.inference import blend
from hostagent.inference.blend_store import LocalClient, PassageStore
from hostagent.common.hashing import block_hashes, passage_keys
from hostagent.inference.connectors.hf import BlockLayout, KVConnector


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=4096, rope_theta=10000.0,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (n,), generator=g).tolist()


def _layer0_keys_moved(model, tokens, p):
    at0 = blend.passage_kv(model, tokens, 0)
    atp = blend.passage_kv(model, tokens, p)
    return blend.rerotate(model, at0[0][0], p), atp[0][0]


@pytest.mark.parametrize("p", [1, 37, 500, 1900])
def test_rerotated_keys_equal_keys_computed_there(tiny, p):
    moved, there = _layer0_keys_moved(tiny, _toks(40, 1), p)
    assert torch.allclose(moved, there, atol=1e-4, rtol=1e-4)
    if p > 1:          # not a no-op: the keys at 0 differ from the keys at p
        assert not torch.allclose(blend.passage_kv(tiny, _toks(40, 1))[0][0], there, atol=1e-2)


def test_rerotation_on_the_real_model():
    from testbed.demos.realmodel import ModelMissing, load, texts
    try:
        model, tok, _ = load()
    except ModelMissing as exc:
        pytest.fail(str(exc))
    tokens = tok(texts()["GPL-3"]).input_ids[100:164]
    for p in (64, 1000):
        moved, there = _layer0_keys_moved(model, tokens, p)
        err = (moved - there).abs().max() / there.abs().max()
        assert err < 1e-4, (p, float(err))


@pytest.mark.parametrize("dev,cand,count,want", [
    ([0, 5, 1, 9, 3], [1, 1, 1, 1, 1], 2, [1, 3]),
    ([0, 5, 1, 9, 3], [1, 1, 1, 0, 1], 2, [1, 4]),       # non-candidates never picked
    ([2, 2, 2, 2], [1, 1, 1, 1], 2, [0, 1]),             # ties: earlier position
    ([1, 2, 3], [1, 1, 1], 0, []),
    ([1, 2, 3], [1, 0, 1], 5, [0, 2]),                   # at most the candidates
    ([7, 0, 0, 0, 8, 0], [0, 1, 1, 1, 1, 1], 1, [4]),
])
def test_select_picks_largest_deviation(dev, cand, count, want):
    got = blend.select(torch.tensor(dev, dtype=torch.float), torch.tensor(cand, dtype=torch.bool),
                       count)
    assert got.tolist() == want


def test_deviation_is_per_token():
    k, v = torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3)
    k2, v2 = k.clone(), v.clone()
    k2[0, 1, 2, 0], v2[0, 0, 3, 1] = 2.0, 1.0
    assert blend.deviation(k2, v2, k, v).tolist() == [0.0, 0.0, 4.0, 1.0]


def _prompt():
    return _toks(12, 2), [_toks(30, 3), _toks(25, 4)], _toks(6, 5)


def test_full_recompute_equals_prefill_and_exact_reuse_is_kept(tiny):
    sys_, passages, q = _prompt()
    tokens = sys_ + sum(passages, []) + q
    with torch.inference_mode():
        full = tiny(input_ids=torch.tensor([tokens])).logits[0, -1]
    exact = blend.passage_kv(tiny, tokens)          # the prompt's own KV, as if reused
    R = len(tokens) - len(q)
    reused = [(k[:, :, :R], v[:, :, :R]) for k, v in exact]
    cand = torch.ones(R, dtype=torch.bool)
    for ratio in (1.0, 0.0, 0.3):
        b = blend.blend_prefill(tiny, tokens, reused, cand, ratio)
        assert torch.allclose(b.logits, full, atol=1e-4), ratio
        assert len(b.selected) == round(ratio * R) and b.recomputed == len(b.selected) + len(q)
        assert b.cache.get_seq_length() == len(tokens)
    logits, cache = blend.reuse_prefill(tiny, tokens, reused)
    assert torch.allclose(logits, full, atol=1e-4)


def test_blend_recovers_what_plain_reuse_loses(tiny):
    sys_, passages, q = _prompt()
    tokens = sys_ + sum(passages, []) + q
    with torch.inference_mode():
        full = tiny(input_ids=torch.tensor([tokens])).logits[0, -1]
    R = len(tokens) - len(q)
    parts, off = [], 0
    for seg in [sys_] + passages:
        parts.append(blend.move(tiny, blend.passage_kv(tiny, seg), off))
        off += len(seg)
    reused = [tuple(torch.cat([p[i][j] for p in parts], 2) for j in (0, 1))
              for i in range(len(parts[0]))]
    cand = torch.ones(R, dtype=torch.bool)
    err = [float((blend.blend_prefill(tiny, tokens, reused, cand, r).logits - full).abs().max())
           for r in (0.0, 0.5, 1.0)]
    plain = float((blend.reuse_prefill(tiny, tokens, reused)[0] - full).abs().max())
    assert plain > 1e-3 and err[2] < 1e-4 and err[1] < err[0]


def test_passage_keys_never_collide_with_prefix_keys():
    tokens, extra = _toks(64, 6), b"model|layout"
    pk = passage_keys(tokens, 16, extra)
    assert len(pk) == 4 and len(set(pk)) == 4 and all(len(k) == 16 for k in pk)
    assert not set(pk) & set(block_hashes(tokens, 16, extra))
    assert not set(pk) & set(block_hashes(tokens[:16], 16, extra))
    assert passage_keys(tokens[:63], 16, extra)[0] != pk[0]          # the length is covered
    assert passage_keys(tokens, 16, b"other")[0] != pk[0]
    assert passage_keys(tokens, 16, extra) == pk                       # deterministic
    assert len(passage_keys(tokens[:17], 16, extra)) == 2             # partial tail block
    with pytest.raises(ValueError):
        passage_keys([], 16, extra)


def test_missing_passage_is_prefilled_and_stored(tiny):
    layout = BlockLayout.of(tiny.config, torch.float32, 16)
    client = LocalClient()
    store = PassageStore(KVConnector(client, 3, layout, "tiny", tiny.config), tiny)
    p1, p2 = _toks(40, 7), _toks(20, 8)

    async def run():
        first = await store.fused_kv([p1, p2])
        second = await store.fused_kv([p2, p1])
        return first, second
    first, second = asyncio.run(run())
    assert (first.misses, first.hits) == (2, 0) and (second.misses, second.hits) == (0, 2)
    assert len(client.blocks) == 3 + 2
    assert second.stats.bytes == 5 * layout.block_bytes
    # p1 moved to offset 20 in the second prompt equals p1's KV computed there
    there = blend.passage_kv(tiny, p1, 20)
    assert torch.allclose(second.kv[0][0][:, :, 20:], there[0][0], atol=1e-4)
    assert torch.equal(second.kv[2][1][:, :, 20:], first.kv[2][1][:, :, :40])


def test_continuation_nll_matches_a_full_forward_and_keeps_the_cache(tiny):
    tokens, cont = _toks(20, 9), _toks(5, 10)
    with torch.inference_mode():
        ls = torch.log_softmax(tiny(input_ids=torch.tensor([tokens + cont])).logits[0], -1)
    want = -float(sum(ls[len(tokens) - 1 + i, t] for i, t in enumerate(cont))) / len(cont)
    logits, cache = blend.reuse_prefill(tiny, tokens, [(k[:, :, :19], v[:, :, :19]) for k, v
                                                       in blend.passage_kv(tiny, tokens)])
    got = blend.continuation_nll(tiny, logits, cache, cont)
    assert abs(got - want) < 1e-4 and cache.get_seq_length() == len(tokens)


@pytest.mark.parametrize("of,want", [("kv", [0.0, 0.0, 4.0, 1.0]), ("k", [0.0, 0.0, 4.0, 0.0]),
                                     ("v", [0.0, 0.0, 0.0, 1.0])])
def test_deviation_of_keys_values_or_both(of, want):
    k, v = torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3)
    k2, v2 = k.clone(), v.clone()
    k2[0, 1, 2, 0], v2[0, 0, 3, 1] = 2.0, 1.0
    assert blend.deviation(k2, v2, k, v, of).tolist() == want
    with pytest.raises(ValueError):
        blend.deviation(k2, v2, k, v, "q")


@pytest.mark.parametrize("ratio,n,widen,want", [
    (0.2, 1, 3.0, [0.2]), (0.1, 3, 4.0, [0.4, 0.2, 0.1]), (0.5, 2, 4.0, [1.0, 0.5])])
def test_gradual_filtering_narrows_to_the_ratio(ratio, n, widen, want):
    assert [round(s, 6) for s in blend._shares(ratio, n, widen)] == want


def _blended_reuse(model, segs, lead=()):
    parts, off = [], 0
    for i, seg in enumerate(segs):
        ld = lead if i else ()
        parts.append(blend.move(model, blend.passage_kv(model, seg, 0, ld), off - len(ld)))
        off += len(seg)
    return [tuple(torch.cat([p[i][j] for p in parts], 2) for j in (0, 1))
            for i in range(len(parts[0]))]


def test_forced_tokens_and_gradual_filtering(tiny):
    sys_, passages, q = _prompt()
    tokens = sys_ + sum(passages, []) + q
    R = len(tokens) - len(q)
    reused = _blended_reuse(tiny, [sys_] + passages)
    cand = torch.zeros(R, dtype=torch.bool)
    cand[len(sys_):] = True
    forced = torch.zeros(R, dtype=torch.bool)
    forced[[12, 42]] = True                              # each passage's first token
    b = blend.blend_prefill(tiny, tokens, reused, cand, 0.0, forced=forced)
    assert b.selected.tolist() == [12, 42] and b.recomputed == 2 + len(q)
    b = blend.blend_prefill(tiny, tokens, reused, cand, 0.2, forced=forced)
    assert len(b.selected) == round(0.2 * 55) and {12, 42} <= set(b.selected.tolist())
    first = blend.blend_prefill(tiny, tokens, reused, cand, 0.4, check_layers=(1,))
    grad = blend.blend_prefill(tiny, tokens, reused, cand, 0.2, check_layers=(1, 2), widen=2.0)
    assert len(grad.selected) == 11 and set(grad.selected.tolist()) <= set(first.selected.tolist())
    with torch.inference_mode():
        full = tiny(input_ids=torch.tensor([tokens])).logits[0, -1]
    b = blend.blend_prefill(tiny, tokens, reused, cand, 1.0, check_layers=(1, 2), widen=2.0)
    assert torch.allclose(b.logits, full, atol=1e-4)
    with pytest.raises(ValueError):
        blend.blend_prefill(tiny, tokens, reused, cand, 0.2, check_layers=(0,))


def test_passage_after_the_lead_is_exact_right_after_it(tiny):
    """A passage computed after the lead and placed right after the lead is the prompt's own KV;
    placed elsewhere its layer-0 keys are those computed there."""
    lead, p = _toks(10, 11), _toks(30, 12)
    exact = blend.passage_kv(tiny, lead + p)
    fused = _blended_reuse(tiny, [lead, p], lead)
    for (k, v), (ek, ev) in zip(fused, exact):
        assert torch.allclose(k, ek, atol=1e-4) and torch.allclose(v, ev, atol=1e-4)
    moved = blend.move(tiny, blend.passage_kv(tiny, p, 0, lead), 57 - len(lead))
    assert torch.allclose(moved[0][0], blend.passage_kv(tiny, p, 57)[0][0], atol=1e-4)


def test_lead_passages_have_their_own_keys_and_fuse(tiny):
    layout = BlockLayout.of(tiny.config, torch.float32, 16)
    client = LocalClient()
    conn = KVConnector(client, 3, layout, "tiny", tiny.config)
    lead, p1, p2 = _toks(10, 13), _toks(40, 14), _toks(20, 15)
    plain, led = PassageStore(conn, tiny), PassageStore(conn, tiny, lead)
    assert plain.keys(p1) == led.keys(p1) and not set(led.keys(p1, True)) & set(plain.keys(p1))
    got = asyncio.run(led.fused_kv([lead, p1, p2]))
    assert (got.misses, got.hits) == (3, 0)
    want = _blended_reuse(tiny, [lead, p1, p2], lead)
    assert all(torch.allclose(a, b, atol=1e-5) for x, y in zip(got.kv, want) for a, b in zip(x, y))
    assert asyncio.run(led.fused_kv([lead, p2])).hits == 2


@pytest.mark.timeout(900)            # a few seconds on an idle core; the box is often shared
def test_full_recompute_equals_prefill_on_the_real_model():
    """SmolLM2: blending every passage token gives full prefill's greedy tokens (and logits);
    with the passages computed after the system prompt as the lead, too."""
    from hostagent.inference.connectors.hf import greedy
    from testbed.bench.quality.blend import SYSTEM
    from testbed.demos.realmodel import ModelMissing, load, texts
    try:
        model, tok, _ = load()
    except ModelMissing as exc:
        pytest.fail(str(exc))
    ids = tok(texts()["GPL-3"]).input_ids
    sys_, segs = tok(SYSTEM).input_ids, [ids[300:340], ids[900:932]]
    q = tok("\nQuestion: what is this about?<|im_end|>\n<|im_start|>assistant\n").input_ids
    tokens = sys_ + sum(segs, []) + q
    R = len(tokens) - len(q)
    with torch.inference_mode():
        cache = blend.DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
        want = greedy(model, out.logits[0, -1], cache, 8)
    cand = torch.zeros(R, dtype=torch.bool)
    cand[len(sys_):] = True
    for lead in ((), sys_):
        b = blend.blend_prefill(model, tokens, _blended_reuse(model, [sys_] + segs, lead), cand,
                                1.0)
        err = float((b.logits - out.logits[0, -1]).abs().max() / out.logits.abs().max())
        assert err < 1e-4 and greedy(model, b.logits, b.cache, 8) == want
