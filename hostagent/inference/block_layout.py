"""The KV block layout both connectors put in the pool, defined once: ``BlockLayout`` (the
Hugging Face connector's, ``hostagent.inference.connectors.hf``) and the vLLM connector's
``PoolLayout`` (``hostagent.inference.connectors.vllm_blocks``: the same layout plus vLLM's
paged block size and the pool's codec), so their blocks and keys agree by construction.

Block layout (version ``LAYOUT_VERSION``), no header: one C-contiguous array of the model's
dtype (native byte order, little-endian on x86 and ARM) of shape

    [layers, 2, kv_heads, block_tokens, head_dim]      (index 1: 0 = K, 1 = V)

that is, for each layer K then V, each [kv_heads, block_tokens, head_dim] as the model keeps
them (keys after RoPE). Its size is fixed by the layout (``BlockLayout.block_bytes``), so a
reader knows every block's chunk count without asking; a block of any other size is refused.
The layout tag (``BlockLayout.tag``) joins the block keys' ``extra``, so the layout is
recoverable from the key alone, which is why the block needs no header.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


LAYOUT_VERSION = 1
DEFAULT_BLOCK_TOKENS = 256


@dataclass(frozen=True)
class BlockLayout:
    """A model's KV block layout (the module docstring has the bytes) and its tag."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int

    @classmethod
    def of(cls, config, dtype: torch.dtype, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        """The layout of a transformers decoder config (Llama, Mistral, Qwen2, ...)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads,
                   head_dim, dtype, block_tokens)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """KV bytes per token: every layer's K and V."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_tokens

    def tag(self) -> bytes:
        return (f"kvlayout/v{LAYOUT_VERSION} L{self.layers} H{self.kv_heads} D{self.head_dim} "
                f"{str(self.dtype).removeprefix('torch.')} B{self.block_tokens}").encode()
