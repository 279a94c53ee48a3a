"""Block keys carry what makes KV differ (``connectors.block_keys``): built from vLLM's
own ``Request`` objects, keys differ for another ``cache_salt``, LoRA adapter or multimodal
input and agree for equal ones, from the very block where vLLM's own prefix-cache hashes part;
requests without extras keep the keys they always had; the Hugging Face connector takes the
same extras; and a pool written under one salt answers another salt with a miss and the same
salt, from another process's backend, with a hit."""
import pytest

try:
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
except ImportError as exc:
    pytest.fail(f"{exc}: install the vllm extra (run 'make setup')", pytrace=False)

from hostagent.common.hashing import block_hashes
from hostagent.inference.connectors.block_keys import (KeyExtras, MMInput, block_keys,
                                                       vllm_request_extras)
from hostagent.inference.connectors.vllm_blocks import Planner, PoolLayout
from test_vllm import pool  # noqa: F401  (a pool node on 127.0.0.1, a fixture)

BT = 16                                     # pool block tokens (and vLLM's here)
PROMPT = list(range(7, 7 + 6 * BT + 5))     # 6 full blocks and a tail
LAYOUT = PoolLayout(2, 2, 8, torch.float32, BT, BT)


def _image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _request(rid="r", prompt=PROMPT, salt=None, lora=None, mm=None, embeds=None) -> Request:
    init_none_hash(sha256)
    return Request(rid, list(prompt), SamplingParams(max_tokens=1), None, cache_salt=salt,
                   lora_request=lora, mm_features=mm, prompt_embeds=embeds,
                   block_hasher=get_request_block_hasher(BT, sha256))


def _keys(req: Request) -> list[bytes]:
    """The connector's keys of a request, as its scheduler side makes them."""
    p = Planner(LAYOUT, "m@1")
    p.register(req.request_id, vllm_request_extras(req))
    return p.request_keys(req.request_id, req.prompt_token_ids)


def _parts(a: list, b: list) -> int | None:
    """Index of the first block where two key lists differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


LORA_A = LoRARequest("adapter-a", 1, "/adapters/a")
CASES = {   # name -> (request a, request b, equal?)
    "no extras": (dict(), dict(), True),
    "same salt": (dict(salt="tenant-A"), dict(salt="tenant-A"), True),
    "other salt": (dict(salt="tenant-A"), dict(salt="tenant-B"), False),
    "salt or none": (dict(salt="tenant-A"), dict(), False),
    "same adapter": (dict(lora=LORA_A), dict(lora=LoRARequest("adapter-a", 7, "/adapters/a")),
                     True),
    "other adapter": (dict(lora=LORA_A), dict(lora=LoRARequest("adapter-b", 2, "/adapters/b")),
                      False),
    "adapter re-pointed": (dict(lora=LORA_A), dict(lora=LoRARequest("adapter-a", 1, "/new/a")),
                           False),
    "adapter or none": (dict(lora=LORA_A), dict(), False),
    "same image": (dict(mm=[_image("img-1", 40, 20)]), dict(mm=[_image("img-1", 40, 20)]), True),
    "other image": (dict(mm=[_image("img-1", 40, 20)]), dict(mm=[_image("img-2", 40, 20)]),
                    False),
    "image moved": (dict(mm=[_image("img-1", 40, 20)]), dict(mm=[_image("img-1", 41, 19)]),
                    False),
    "second image differs": (dict(mm=[_image("img-1", 8, 4), _image("img-2", 70, 10)]),
                             dict(mm=[_image("img-1", 8, 4), _image("img-3", 70, 10)]), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keys_part_where_vllms_own_prefix_hashes_part(case):
    """Built from vLLM's Request objects: equal extras give equal keys; other ones give other
    keys from exactly the block where vLLM's own block hashes (its prefix cache) part."""
    a_kw, b_kw, equal = CASES[case]
    a, b = _request("a", **a_kw), _request("b", **b_kw)
    ka, kb = _keys(a), _keys(b)
    assert len(ka) == len(kb) == 6
    assert (ka == kb) is equal
    assert _parts(ka, kb) == _parts(a.block_hashes, b.block_hashes)


def test_where_each_extra_applies():
    plain = _keys(_request())
    assert _parts(plain, _keys(_request(salt="s"))) == 0            # the first block; chained
    assert all(x != y for x, y in zip(plain, _keys(_request(salt="s"))))
    assert all(x != y for x, y in zip(plain, _keys(_request(lora=LORA_A))))   # every block
    # an image on tokens 40..59 (blocks 2 and 3): blocks 0 and 1 are still shared
    assert _parts(plain, _keys(_request(mm=[_image("img-1", 40, 20)]))) == 2
    ex = KeyExtras("s", ("a", "/a"), (MMInput("img", 40, 20),))
    assert ex.items(0, 16) == [["lora", "a", "/a"], ["salt", "s"]]
    assert ex.items(32, 48) == [["lora", "a", "/a"], ["mm", "img", 8]]
    assert ex.items(48, 64) == [["lora", "a", "/a"], ["mm", "img", -8]]
    assert ex.items(64, 80) == [["lora", "a", "/a"]]


def test_requests_without_extras_keep_their_keys():
    """Blocks saved before keys carried extras are found again: no extras, the same keys."""
    extra = LAYOUT.extra("m@1")
    assert _keys(_request()) == block_hashes(PROMPT, BT, extra=extra)
    assert block_keys(PROMPT, BT, extra, KeyExtras()) == block_hashes(PROMPT, BT, extra=extra)
    assert not KeyExtras() and KeyExtras(cache_salt="x")


def test_prompt_embeddings_are_in_the_keys():
    torch.manual_seed(0)
    e = torch.randn(len(PROMPT), 8)
    f = e.clone()
    f[50] += 1                                         # block 3 differs
    ka, kb = _keys(_request(embeds=e)), _keys(_request(embeds=f))
    assert ka == _keys(_request(embeds=e.clone())) and _parts(ka, kb) == 3
    assert _parts(ka, _keys(_request())) == 0


def test_an_unregistered_request_is_never_saved():
    """Saves need the request's extras: without them (never seen by get_num_new_matched_tokens
    or on_new_request) the planner saves nothing rather than keys without a salt."""
    p = Planner(LAYOUT, "m@1")
    assert not p.build([("x", PROMPT, list(range(7)), 0, len(PROMPT))], []).saves
    p.register("y", vllm_request_extras(_request("y", salt="t")))
    [sv] = p.build([("y", PROMPT, list(range(7)), 0, len(PROMPT))], []).saves
    assert sv.keys == _keys(_request("y", salt="t"))
    assert p.forget("y") and not p.forget("x")         # "y" had a save planned


def test_the_hugging_face_connector_takes_the_same_extras():
    from hostagent.inference.connectors.hf import BlockLayout, KVConnector

    class NoClient:
        chunk_size = 1024

    layout = BlockLayout(2, 2, 8, torch.float32, BT)
    conn = KVConnector(NoClient(), 1, layout, "m@1")
    salted = KeyExtras(cache_salt="tenant-A")
    assert conn.keys(PROMPT) == block_hashes(PROMPT, BT, extra=conn.extra)
    assert conn.keys(PROMPT, salted) == block_keys(PROMPT, BT, conn.extra, salted)
    assert conn.keys(PROMPT, salted) == conn.keys(PROMPT, KeyExtras(cache_salt="tenant-A"))
    assert _parts(conn.keys(PROMPT), conn.keys(PROMPT, salted)) == 0
    img = KeyExtras(mm=(MMInput("img-1", 40, 20),))
    assert _parts(conn.keys(PROMPT), conn.keys(PROMPT, img)) == 2
    # the vLLM connector's keys for the same layout, model and extras are these
    assert _keys(_request(salt="tenant-A")) == conn.keys(PROMPT, salted)


def test_a_pool_answers_only_the_same_salt(pool):
    """Tenant A's blocks in the pool: tenant B (another salt) finds none, a request without a
    salt finds none, tenant A from another backend (another server) finds them all."""
    from hostagent.inference.connectors.vllm_blocks import Settings
    from hostagent.inference.connectors.vllm_pool import PoolBackend
    s = Settings.from_extra({"pools": [pool], "chunk_size": 256, "fetch_engine": "off"})
    a_keys = _keys(_request(salt="tenant-A"))
    writer = PoolBackend(s)
    writer.save(1, a_keys, [bytes([i + 1]) * 64 for i in range(len(a_keys))])
    assert writer.flush(20)
    reader = PoolBackend(s)
    assert reader.probe(1, _keys(_request(salt="tenant-B")))[0] == 0
    assert reader.probe(1, _keys(_request()))[0] == 0
    assert reader.probe(1, _keys(_request(salt="tenant-A")))[0] == len(a_keys)
