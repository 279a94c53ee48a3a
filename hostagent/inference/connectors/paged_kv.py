"""vLLM's paged KV cache, in every layout vLLM 0.32 allocates, copied to and from pool blocks.

vLLM 0.32 gives each attention layer one tensor of logical shape ``[blocks, kv_heads, tokens,
content]`` (``create_kv_cache_views`` in ``vllm/v1/kv_cache_interface.py``), ``content`` being
the K and V of one (token, head) cell, ``2 * head_dim`` elements. What differs between machines
is where those axes lie in memory and how the attention backend reads the content:

- **Strides**: the physical order of the axes is the resolved ``KVCacheLayout`` (``LBNHC``,
  "NHD": the default on GPUs for FlashAttention and FlashInfer; ``LBHNC``, "HND": the CPU's
  and FlashInfer's on Blackwell; ``BLNHC``/``BLHNC``: block-outermost, all layers of a block
  together; ``LHBNC``, ``BHLNC``). Views with strides carry that; nothing here depends on it.
- **Kernel blocks**: a backend may split each of the scheduler's blocks into ``k`` kernel
  blocks of ``tokens / k`` (the tensor's first axis is then ``blocks * k``).
- **Content**: GPU backends (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``,
  ``FLEX_ATTENTION``) split the content axis (``split(head_dim, -1)``: K is the first
  ``head_dim`` elements of a cell, V the rest); the CPU backend (``CPU_ATTN``) reads each
  (block, head) page as ``[2 * tokens, head_dim]``, K rows then V rows.

``PagedKV`` views every layer as ``[blocks, 2 (K, V), kv_heads, k, tokens / k, head_dim]``
without a copy, whichever of the above holds, so a pool block (``[layers, 2, kv_heads,
block_tokens, head_dim]``, ``hostagent.inference.block_layout``) is written into vLLM blocks and
read out of them by strided ``copy_``s. On a GPU a block crosses to and from the host once,
whole; the per-layer copies run on the device.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import torch

# how each attention backend reads a cell's content (module docstring)
CONTENT_SPLIT, PAGE_SPLIT = "content", "page"
BACKENDS = {"CPU_ATTN": PAGE_SPLIT, "FLASH_ATTN": CONTENT_SPLIT, "FLASHINFER": CONTENT_SPLIT,
            "TRITON_ATTN": CONTENT_SPLIT, "FLEX_ATTENTION": CONTENT_SPLIT}


def block_view(cache: torch.Tensor, heads: int, tokens: int, head_dim: int, backend: str,
               num_blocks: int | None = None) -> torch.Tensor:
    """One layer's paged cache as ``[blocks, 2, heads, k, tokens / k, head_dim]`` (a view).
    ``num_blocks``: the scheduler's blocks (default: the tensor's first axis, ``k`` = 1)."""
    split = BACKENDS.get(backend)
    if split is None:
        raise ValueError(f"attention backend {backend} is not supported; supported: "
                         f"{', '.join(sorted(BACKENDS))}")
    n = cache.shape[0] if num_blocks is None else num_blocks
    if cache.dim() != 4 or n < 1 or cache.shape[0] % n:
        raise ValueError(f"shape {tuple(cache.shape)} is not [blocks (x kernel blocks), "
                         f"kv_heads, tokens, 2 * head_dim] for {n} blocks")
    k = cache.shape[0] // n
    kbs = tokens // k
    want = (heads, kbs, 2 * head_dim)
    if tuple(cache.shape[1:]) != want or kbs * k != tokens:
        raise ValueError(f"shape {tuple(cache.shape)} is not [{n} x {k}, {want[0]}, "
                         f"{want[1]}, {want[2]}]")
    if cache.stride(-1) != 1:
        raise ValueError(f"strides {cache.stride()}: the content axis is not contiguous")
    c = cache.unflatten(0, (n, k))                              # [n, k, H, kbs, 2D]
    if split == CONTENT_SPLIT:
        return c.unflatten(-1, (2, head_dim)).permute(0, 4, 2, 1, 3, 5)
    if c.stride(-2) != 2 * head_dim:
        raise ValueError(f"strides {cache.stride()}: a (block, head) page is not contiguous, "
                         f"as {backend} reads it")
    page = c.as_strided((n, k, heads, 2, kbs, head_dim),        # [2 * kbs, D] rows: K then V
                        (*c.stride()[:3], kbs * head_dim, head_dim, 1), c.storage_offset())
    return page.permute(0, 3, 2, 1, 4, 5)


class PagedKV:
    """Every layer's paged cache (in layer order) viewed as pool blocks see it."""

    def __init__(self, caches: Sequence[torch.Tensor], layout, backend: str = "CPU_ATTN",
                 num_blocks: int | None = None):
        self.layout, self.backend = layout, backend
        dtype = layout.dtype
        self.views = []
        for i, cache in enumerate(caches):
            if cache.dtype != dtype:
                raise ValueError(f"KV cache of layer {i} is {cache.dtype}, the model's is "
                                 f"{dtype}")
            self.views.append(block_view(cache, layout.kv_heads, layout.vllm_block,
                                         layout.head_dim, backend, num_blocks))
        if not self.views:
            raise ValueError("no KV cache layers")
        self.device = self.views[0].device
        self.kernel_blocks = self.views[0].shape[3]

    def _shape(self) -> tuple[int, ...]:
        L, _, H, _, D = self.layout.shape
        k = self.kernel_blocks
        return (L, 2, H, self.layout.ratio, k, self.layout.vllm_block // k, D)

    def write(self, buf, targets: Sequence[tuple[int, int]]) -> None:
        """Copy one pool block's bytes into vLLM blocks: ``targets`` = (sub-block, vLLM
        block id)."""
        src = as_block(buf, self.layout).view(self._shape())
        if self.device.type != "cpu":
            src = src.to(self.device)
        for li, view in enumerate(self.views):
            for s, vid in targets:
                view[vid].copy_(src[li, :, :, s])

    def read(self, ids: Sequence[int], pos0: int = 0) -> bytes:
        """One pool block gathered from vLLM blocks ``ids`` (``ratio`` of them), as bytes
        (coded with the layout's codec; ``pos0``: the block's first token's position)."""
        out = torch.empty(self._shape(), dtype=self.layout.dtype, device=self.device)
        for li, view in enumerate(self.views):
            for s, vid in enumerate(ids):
                out[li, :, :, s].copy_(view[vid])
        out = out.cpu().view(self.layout.shape)
        if self.layout.codec.name != "none":
            return self.layout.codec.encode(out, pos0)
        return out.view(torch.uint8).numpy().tobytes()


_SCRATCH = threading.local()


def as_block(buf, layout) -> torch.Tensor:
    """A pool block's bytes (bytes, bytearray, memoryview, numpy) as a ``layout.shape`` tensor
    sharing their memory (no codec), or decoded (a codec) into this thread's float32 block,
    reused from block to block (a new one would fault its pages in for every block): valid
    until the thread's next call."""
    size = len(memoryview(buf).cast("B"))
    if layout.codec.name != "none":
        if size != layout.coded_bytes:
            raise ValueError(f"pool block of {size} bytes, codec {layout.codec.name} of the "
                             f"layout has {layout.coded_bytes}")
        out = getattr(_SCRATCH, "block", None)
        if out is None or tuple(out.shape) != tuple(layout.shape):
            out = _SCRATCH.block = torch.empty(layout.shape)
        layout.codec.decode_into(buf, out)
        return out
    if size != layout.block_bytes:
        raise ValueError(f"pool block of {size} bytes, the layout has {layout.block_bytes}")
    with warnings.catch_warnings():      # read-only buffers: only ever read from
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=layout.dtype)
    return t.view(layout.shape)
