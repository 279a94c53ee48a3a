"""KV block codecs: how a block's KV is coded on the wire and in the pool (which carry the coded
bytes as opaque payload). It owns the codec names, their byte formats, the tag each codec adds
to a block's layout tag (so the chained block keys of two codecs never meet: a reader with
another codec misses, it never decodes another codec's bytes), and fast encode/decode.

A block is ``[layers, 2 (K, V), kv_heads, block_tokens, head_dim]``
(``hostagent.inference.hf_connector``); call ``rows = layers * 2 * kv_heads`` its rows, each
``block_tokens * head_dim`` values. Codecs:

- ``none``: the model dtype's bytes as they are (the block layout's own format; no tag).
- ``int8``: symmetric INT8, one fp16 scale (absmax / 127) per row and group of ``g`` tokens
  (``g * head_dim`` values): per head, per token group. Payload: int8 codes, then the scales.
- ``fp8``: FP8 e4m3 with the same scales (absmax / 448); kept for the measurement (``testbed
  bench compress``), which keeps INT8 as the 8-bit codec (docs/compression.md).
- ``int4``: asymmetric 4-bit per channel over a group of ``g`` tokens (KIVI's key grouping,
  used for K and V alike): per row, group and channel an fp16 scale and minimum. Codes are
  packed two tokens a byte (token 2j in the low nibble, 2j+1 in the high one, same channel), so
  the decoder's inner loop runs over contiguous channels. Payload: codes, scales, minima.

Every coded size is fixed by the layout and the codec (a reader knows the chunk count). Encoding
uses torch; decoding is one pass of a numba-compiled loop (LLVM vectorises it) from the coded
bytes (e.g. the fetch engine's zero-copy block) straight into the rows of the destination cache
tensor: multi-pass numpy/torch decoding ran at half the speed (docs/compression.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CODECS = ("none", "int8", "fp8", "int4")
DEFAULT_GROUP = {"int8": 16, "fp8": 16, "int4": 256}
SCALE_MIN = 2.0 ** -20                     # a representable fp16 (subnormal) scale floor


class UnknownCodec(ValueError):
    """A codec name this build does not know; the message is one line naming the known ones."""


def parse(spec: str) -> tuple[str, int | None]:
    """``name`` or ``name/g<tokens>`` → (name, group or None)."""
    name, _, rest = str(spec).strip().lower().partition("/")
    if name not in CODECS:
        raise UnknownCodec(f"unknown KV codec {spec!r}: choose one of {', '.join(CODECS)}")
    if not rest:
        return name, None
    if name == "none" or not rest.startswith("g") or not rest[1:].isdigit() or int(rest[1:]) < 2:
        raise UnknownCodec(f"bad KV codec {spec!r}: write NAME or NAME/gTOKENS (e.g. int8/g16)")
    return name, int(rest[1:])


@dataclass(frozen=True)
class Codec:
    """A codec bound to a block shape (layers, kv_heads, block_tokens, head_dim)."""
    name: str
    layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: torch.dtype                     # the model's KV dtype (``none``'s coded bytes)
    group: int = 0                         # tokens per scale group (0 for none)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def rows(self) -> int:
        return self.layers * 2 * self.kv_heads

    @property
    def values(self) -> int:
        return self.rows * self.block_tokens * self.head_dim

    @property
    def groups(self) -> int:
        return self.block_tokens // self.group if self.group else 0

    @property
    def code_bytes(self) -> int:
        return self.values // 2 if self.name == "int4" else self.values

    @property
    def nbytes(self) -> int:
        """Coded bytes of one block."""
        if self.name == "none":
            return self.values * self.itemsize
        if self.name == "int4":
            return self.code_bytes + 2 * 2 * self.rows * self.groups * self.head_dim
        return self.code_bytes + 2 * self.rows * self.groups

    @property
    def ratio(self) -> float:
        """Against 16-bit KV."""
        return 2 * self.values / self.nbytes

    def tag(self) -> bytes:
        """What the codec adds to the layout tag (nothing for ``none``: its keys are those of
        a build without codecs)."""
        return b"" if self.name == "none" else f" codec={self.name}/g{self.group}".encode()

    # ---- encode ---------------------------------------------------------------------------
    def encode(self, kv: torch.Tensor) -> bytes:
        """A block tensor ``[L, 2, H, T, D]`` (any float dtype) as coded bytes."""
        shape = (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)
        if tuple(kv.shape) != shape:
            raise ValueError(f"block of shape {tuple(kv.shape)}, the codec's is {shape}")
        if self.name == "none":
            return kv.contiguous().view(torch.uint8).numpy().tobytes()
        x = kv.detach().to(torch.float32).reshape(self.rows, self.groups, self.group,
                                                  self.head_dim)
        if self.name in ("int8", "fp8"):
            top = 127.0 if self.name == "int8" else 448.0
            scale = (x.abs().amax(dim=(2, 3)) / top).clamp_min(SCALE_MIN).half()
            y = x / scale.float()[:, :, None, None]
            codes = (y.round().clamp(-127, 127).to(torch.int8) if self.name == "int8"
                     else y.clamp(-448, 448).to(torch.float8_e4m3fn)).view(torch.uint8)
            return codes.numpy().tobytes() + scale.numpy().tobytes()
        lo, hi = x.amin(dim=2), x.amax(dim=2)                    # [rows, groups, D]
        scale = ((hi - lo) / 15).clamp_min(SCALE_MIN).half()
        lo = lo.half()
        q = ((x - lo.float()[:, :, None]) / scale.float()[:, :, None]).round().clamp(0, 15)
        q = q.to(torch.uint8).view(self.rows, self.groups, self.group // 2, 2, self.head_dim)
        packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
        return packed.numpy().tobytes() + scale.numpy().tobytes() + lo.numpy().tobytes()

    # ---- decode ---------------------------------------------------------------------------
    def decode_into(self, buf, out: torch.Tensor, token0: int = 0) -> None:
        """Decode one coded block (bytes-like or numpy, read in place) into tokens
        ``token0``..``token0 + block_tokens`` of ``out``, a contiguous ``[L, 2, H, N, D]``
        float32 tensor (other dtypes go through a float32 copy)."""
        src = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else \
            buf.reshape(-1).view(np.uint8)
        if src.nbytes != self.nbytes:
            raise ValueError(f"a coded block has {src.nbytes} bytes, codec {self.name} of "
                             f"this layout {self.nbytes}")
        L, _, H, N, D = out.shape
        if (L, H, D) != (self.layers, self.kv_heads, self.head_dim) or \
                not 0 <= token0 <= N - self.block_tokens or not out.is_contiguous():
            raise ValueError("decode target does not match the codec's layout")
        if self.name == "none" or out.dtype != torch.float32:
            tmp = torch.empty(L, 2, H, self.block_tokens, D, dtype=torch.float32)
            if self.name == "none":
                tmp = _as_tensor(src, self.dtype).view(tmp.shape)
            else:
                self.decode_into(src, tmp, 0)
            out[:, :, :, token0:token0 + self.block_tokens].copy_(tmp)
            return
        o = out.view(-1).numpy()
        args = (self.rows, self.block_tokens * D, N * D, token0 * D)
        k = _kernels()
        if self.name == "int4":
            n = self.rows * self.groups * D
            s = src[self.code_bytes:self.code_bytes + 2 * n].view(np.float16).astype(np.float32)
            z = src[self.code_bytes + 2 * n:].view(np.float16).astype(np.float32)
            k.dec4(src[:self.code_bytes], s, z, o, self.group, D, *args)
        else:
            s = src[self.code_bytes:].view(np.float16).astype(np.float32)
            codes = src[:self.code_bytes]
            if self.name == "int8":
                k.dec8(codes.view(np.int8), s, o, self.group * D, *args)
            else:
                k.decf8(codes, _FP8, s, o, self.group * D, *args)

    def decode(self, buf, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A coded block as a new ``[L, 2, H, T, D]`` tensor."""
        out = torch.empty(self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim,
                          dtype=dtype if self.name == "none" else torch.float32)
        self.decode_into(buf, out)
        return out if out.dtype == dtype else out.to(dtype)


def make(spec: str, layers: int, kv_heads: int, block_tokens: int, head_dim: int,
         dtype: torch.dtype) -> Codec:
    """The codec ``spec`` (``name`` or ``name/gTOKENS``) for a block layout. The group is the
    codec's default, at most the block; it must divide the block (and be even for int4)."""
    name, group = parse(spec)
    if name == "none":
        return Codec(name, layers, kv_heads, block_tokens, head_dim, dtype)
    group = min(group or DEFAULT_GROUP[name], block_tokens)
    if block_tokens % group or (name == "int4" and group % 2):
        raise UnknownCodec(f"KV codec {spec!r}: its group of {group} tokens must divide the "
                           f"{block_tokens}-token block" + (" and be even" if name == "int4"
                                                            else ""))
    return Codec(name, layers, kv_heads, block_tokens, head_dim, dtype, group)


def _as_tensor(src: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    import warnings
    with warnings.catch_warnings():            # a read-only buffer: only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(src, dtype=dtype)


def _fp8_table() -> np.ndarray:
    t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return t.to(torch.float32).numpy().copy()


_FP8 = _fp8_table()
_KERNELS = None


def _kernels():
    """The decode loops, compiled at first use (cached on disk by numba)."""
    global _KERNELS
    if _KERNELS is None:
        from . import codec_kernels
        _KERNELS = codec_kernels
    return _KERNELS


_WARM: set[str] = set()


def warm_up(spec: str) -> None:
    """Compile (or load from numba's disk cache) the decode loop of ``spec`` now, so the
    first block loaded does not pay for it; once a process."""
    name, _ = parse(spec)
    if name == "none" or name in _WARM:
        return
    c = make(name, 1, 1, 2, 2, torch.float32)
    c.decode_into(c.encode(torch.zeros(1, 2, 1, 2, 2)), torch.empty(1, 2, 1, 2, 2))
    _WARM.add(name)


def ratio(spec: str, layers: int, kv_heads: int, block_tokens: int, head_dim: int) -> float:
    return make(spec, layers, kv_heads, block_tokens, head_dim, torch.bfloat16).ratio


def max_abs_error_bound(spec: str, kv: torch.Tensor, block_tokens: int) -> float:
    """A bound on |decoded - original| for ``kv`` [L, 2, H, T, D]: half a quantisation step of
    the largest group (int), or 1/16 relative plus a subnormal step (fp8); 0 for none."""
    name, group = parse(spec)
    if name == "none":
        return 0.0
    a = kv.abs().amax().item()
    if name == "int8":
        return a / 127 * 0.5 * 1.002 + 1e-6
    if name == "fp8":
        return a / 16 * 1.002 + 1e-6
    rng = (kv.amax() - kv.amin()).item()
    return rng / 15 * 0.5 * 1.01 + 2 * a * 2 ** -11 + 1e-6


__all__ = ["CODECS", "Codec", "UnknownCodec", "make", "parse", "ratio", "warm_up"]
