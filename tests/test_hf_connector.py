"""The KV connector with a real (tiny, seeded-random) transformer: the block layout byte for byte,
cutting and rebuilding a DynamicCache, generation from a prefix fetched from a loopback pool node
token-for-token identical to a full recompute, and the longest-available-prefix search."""
import asyncio
import random

import pytest

try:
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError as exc:  # the pure-Python tier needs the inference extra
    pytest.fail(f"{exc}: install the inference extra (pip install -e '.[inference]', "
                "or run 'make setup')", pytrace=False)

from conftest import local_pool
from hostagent.inference.client import KVClient
from hostagent.inference.connectors.hf import (BlockLayout, KVConnector, blocks_to_cache,
                                               cache_to_blocks, greedy, prefill)

BT = 16                              # tokens per block
NS = 5
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
DTYPES = [torch.float32, torch.bfloat16]


def _tokens(n: int, seed: str) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


SHARED = _tokens(5 * BT, "shared")                  # five full blocks every prompt starts with
PROMPT_A = SHARED + _tokens(9, "a")
PROMPT_B = SHARED + _tokens(11, "b")


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def model(request):
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    return LlamaForCausalLM(config).to(request.param).eval()


def _layout(model) -> BlockLayout:
    return BlockLayout.of(model.config, model.dtype, BT)


def _recompute(model, tokens):
    cache = DynamicCache(config=model.config)
    return prefill(model, tokens, cache, BT), cache


async def _with_pool(body):
    """Run ``body(addr)`` against a pool node served in-process on 127.0.0.1."""
    async with local_pool() as proto:
        return await body(proto.sock.getsockname())


def test_blocks_have_the_documented_layout_and_round_trip_byte_exact(model):
    layout = _layout(model)
    _, cache = _recompute(model, PROMPT_A)
    blocks = cache_to_blocks(cache, layout)
    assert len(blocks) == len(PROMPT_A) // BT == 5
    assert all(len(b) == layout.block_bytes == 2 * 2 * 2 * BT * 16 * model.dtype.itemsize
               for b in blocks)
    for j, block in enumerate(blocks):    # [layers, K/V, kv_heads, block_tokens, head_dim]
        arr = torch.frombuffer(bytearray(block), dtype=model.dtype).view(layout.shape)
        for i, layer in enumerate(cache.layers):
            assert torch.equal(arr[i, 0], layer.keys[0, :, j * BT:(j + 1) * BT])
            assert torch.equal(arr[i, 1], layer.values[0, :, j * BT:(j + 1) * BT])
    rebuilt = blocks_to_cache(blocks, layout, model.config)
    assert rebuilt.get_seq_length() == 5 * BT
    for a, b in zip(rebuilt.layers, cache.layers):
        assert torch.equal(a.keys, b.keys[:, :, :5 * BT]) and a.keys.dtype == model.dtype
        assert torch.equal(a.values, b.values[:, :, :5 * BT])
    assert cache_to_blocks(rebuilt, layout) == blocks
    assert cache_to_blocks(cache, layout, 1, 3) == blocks[1:3]
    assert blocks_to_cache([], layout, model.config).get_seq_length() == 0
    with pytest.raises(ValueError):
        blocks_to_cache([blocks[0][:-1]], layout)


def test_rebuilt_prefix_continues_exactly_and_a_wrong_layout_shows(model):
    layout = _layout(model)
    logits, cache = _recompute(model, PROMPT_B)
    want = greedy(model, logits, cache, 12)
    _, cache_a = _recompute(model, PROMPT_A)
    blocks = cache_to_blocks(cache_a, layout)          # the shared blocks, computed for A
    resumed = blocks_to_cache(blocks, layout, model.config)
    got = prefill(model, PROMPT_B, resumed, BT)
    assert torch.equal(got, logits)
    assert greedy(model, got, resumed, 12) == want
    v_then_k = [torch.frombuffer(bytearray(b), dtype=model.dtype).view(layout.shape)[:, [1, 0]]
                .contiguous().view(torch.uint8).numpy().tobytes() for b in blocks]
    wrong = blocks_to_cache(v_then_k, layout, model.config)   # a layout mistake shows
    assert not torch.equal(prefill(model, PROMPT_B, wrong, BT), logits)


def test_generation_from_the_pool_is_identical_to_recompute(model):
    layout = _layout(model)

    async def body(addr):
        async with KVClient([addr], chunk_size=512, window=16, deadline=20) as client:
            conn = KVConnector(client, NS, layout, "tiny/seed0", model.config, concurrency=3)
            _, cache_a = _recompute(model, PROMPT_A)
            put = await conn.save(PROMPT_A, cache_a)
            loaded = await conn.load(PROMPT_B)
            again = await conn.load(PROMPT_B)
            return put, loaded, again

    put, loaded, again = asyncio.run(_with_pool(body))
    assert put.bytes == 5 * layout.block_bytes and put.chunks == 5 * -(-layout.block_bytes // 512)
    assert (loaded.tokens, loaded.blocks, loaded.probed, loaded.missing_at) == (5 * BT, 5, 5, None)
    assert loaded.stats.from_pool == loaded.stats.chunks == put.chunks
    assert loaded.stats.bytes == put.bytes

    logits, cache = _recompute(model, PROMPT_B)
    want = greedy(model, logits, cache, 16)
    got = prefill(model, PROMPT_B, loaded.cache, BT)        # only the 11 question tokens
    assert loaded.cache.get_seq_length() == len(PROMPT_B)
    assert torch.equal(got, logits)
    assert greedy(model, got, loaded.cache, 16) == want
    out = model.generate(torch.tensor([PROMPT_B]), past_key_values=again.cache,
                         max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out[0, len(PROMPT_B):].tolist() == want          # transformers' own generate, too


@pytest.mark.parametrize("concurrency", [1, 3])
def test_longest_available_prefix_stops_at_the_first_missing_block(model, concurrency):
    layout = _layout(model)
    _, cache = _recompute(model, PROMPT_A)
    blocks = cache_to_blocks(cache, layout)

    async def body(addr):
        async with KVClient([addr], chunk_size=1024, deadline=10) as client:
            conn = KVConnector(client, NS, layout, "tiny/seed0", model.config, concurrency)
            empty = await conn.load(PROMPT_B)
            keys = conn.keys(PROMPT_A)
            for i in (0, 1, 3, 4):                          # block 2 is missing
                await client.put_block(NS, keys[i], blocks[i])
            partial = await conn.load(PROMPT_B)
            other = KVConnector(client, NS, layout, "another-model", model.config)
            foreign = await other.load(PROMPT_B)
            await client.put_block(NS, keys[2], blocks[2])
            aligned = await conn.load(SHARED)               # never covers the last token
            return empty, partial, foreign, aligned

    empty, partial, foreign, aligned = asyncio.run(_with_pool(body))
    assert (empty.tokens, empty.missing_at, empty.stats.chunks) == (0, 0, 0)
    assert empty.cache.get_seq_length() == 0
    assert (partial.blocks, partial.tokens, partial.missing_at) == (2, 2 * BT, 2)
    moved = 2 * layout.block_bytes                  # in flight past the gap: moved, not kept
    assert partial.stats.bytes == moved if concurrency == 1 else partial.stats.bytes >= moved
    assert cache_to_blocks(partial.cache, layout) == blocks[:2]
    assert (foreign.blocks, foreign.missing_at) == (0, 0)
    assert (aligned.blocks, aligned.probed, aligned.missing_at) == (4, 4, None)

    logits, cache = _recompute(model, PROMPT_B)
    want = greedy(model, logits, cache, 8)
    for loaded in (empty, partial):
        got = prefill(model, PROMPT_B, loaded.cache, BT)
        assert torch.equal(got, logits)
        assert greedy(model, got, loaded.cache, 8) == want


def test_layout_tag_and_keys_separate_models_and_layouts(model):
    layout = _layout(model)
    other = BlockLayout(layout.layers, layout.kv_heads, layout.head_dim, torch.float16, BT)
    assert layout.tag() != other.tag()
    assert layout.token_bytes == 2 * 2 * 2 * 16 * model.dtype.itemsize
    with pytest.raises(ValueError):          # a cache in another dtype is not this layout's
        cache_to_blocks(_recompute(model, PROMPT_A)[1], other)


@pytest.mark.e2e
def test_demo_inference_through_the_switch(capsys):
    """The demo's whole path on the testbed with the tiny model: h2 from the pool node, h3 from
    the switch, both identical to their own recompute (speed is the demo's business)."""
    from testbed.demos.inference import run_inference_demo
    from testbed.lab.topology import namespaces_of
    assert run_inference_demo(sizes=(512,), chunk_size=1024, new_tokens=4, model="tiny",
                              block_tokens=256, prefix="infe", must_win_from=1 << 30)
    assert "demo-inference: OK" in capsys.readouterr().out
    assert not namespaces_of("infe")


def test_demo_switch_holds_every_chunk_and_real_prompts_of_two_sizes_share_no_block():
    """`make demo-inference` checks h3 is served by the switch alone: its cache is sized to every
    chunk put (per codec, a quarter more); real-text prompts of different sizes are disjoint
    text, so h2's larger prompt finds none of its blocks learned by the switch already."""
    from testbed.demos import inference
    blocks, per_block = (1024 + 4096 + 16384) // 512, -(-512 * 8192 // 3072)   # llama3-mini
    assert inference.switch_entries("llama3-mini", "float32", 512, [1024, 4096, 16384],
                                    ["none"], 3072) == blocks * per_block * 5 // 4
    assert inference.switch_entries("tiny", "float32", 256, [512], ["none"], 1024) == 65536

    class Chars:                                     # a tokenizer: one token a character
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}
    sizes = [512, 2048]
    small, large = (inference.real_prompt(Chars(), n, "h2", sum(s for s in sizes if s < n))
                    for n in sizes)
    from testbed.demos.realmodel import texts
    ids = [ord(c) for t in texts().values() for c in t]
    assert small[:512] == ids[:512] and large[:2048] == ids[512:2560]
    assert len(small) == 512 + inference.QUESTION_TOKENS
    with pytest.raises(ValueError, match="too few"):
        inference.real_prompt(Chars(), len(ids), "h2")
