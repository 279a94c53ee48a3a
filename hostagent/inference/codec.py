"""KV block codecs: how a block's KV is coded on the wire and in the pool (which carry the coded
bytes as opaque payload). It owns the codec names, their byte formats, the tag each codec adds
to a block's layout tag (so the chained block keys of two codecs never meet: a reader with
another codec misses, it never decodes another codec's bytes), and fast encode/decode.

A block is ``[layers, 2 (K, V), kv_heads, block_tokens, head_dim]``
(``hostagent.inference.connectors.hf``); call ``rows = layers * 2 * kv_heads`` its rows, each
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
- ``int4h``: 4-bit codes of the head dimension rotated by an orthonormal Hadamard transform
  (``H8 ⊗ I8`` over 64 channels: channel d mixed with the 7 others of d mod 8; it spreads the
  keys' outlier channels; the decoder rotates back with three butterfly stages). K: asymmetric
  per rotated channel over ``g`` tokens (fp16 scale and minimum); V: asymmetric per token (an
  8-bit scale and an 8-bit minimum on a per-row fp16 grid). Payload: codes (a token's 32 bytes:
  rotated channel c low, c + 32 high), K scales, K minima (fp16 ``[layers, heads, groups,
  64]``), V scale codes, V minimum codes (uint8 ``[layers, heads, tokens]``), V row grids
  (fp16 ``[layers, heads, 3]``: top scale, lowest minimum, minimum step).
- ``pca``: transform coding with a calibration computed once per model (a decorrelating
  transform per layer, Lloyd-Max quantisers, bits allocated by the model's sensitivity), at a
  fixed ratio (``pca/xN``, default 8); its own module, ``hostagent.inference.codec_pca``, whose
  tag names the calibration's SHA-256.

Every coded size is fixed by the layout and the codec (a reader knows the chunk count). Encoding
uses torch; decoding is one pass of a numba-compiled loop (LLVM vectorises it) from the coded
bytes (e.g. the fetch engine's zero-copy block) straight into the rows of the destination cache
tensor: multi-pass numpy/torch decoding ran at half the speed (docs/compression.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CODECS = ("none", "int8", "fp8", "int4", "int4h", "pca")
DEFAULT_GROUP = {"int8": 16, "fp8": 16, "int4": 256, "int4h": 256}
SCALE_MIN = 2.0 ** -20                     # a representable fp16 (subnormal) scale floor
# the longest group NAME/gTOKENS may ask for, checked where options are (``parse``): a group
# longer than the block is cut to the block (``make``), and blocks are hundreds of tokens (vLLM's
# block size or a multiple; the longest default group is 256), so a group past 65,536 tokens is a
# typo, not a codec, and must fail the option check rather than pass as the block's length
MAX_GROUP = 1 << 16


class UnknownCodec(ValueError):
    """A codec name this build does not know; the message is one line naming the known ones."""


def parse(spec: str) -> tuple[str, int | None]:
    """``name`` or ``name/g<tokens>`` → (name, group or None); the group 2..MAX_GROUP. The
    transform codec's ``pca[/xN][@CALIBRATION]`` → ("pca", None) (``codec_pca.parse_spec``)."""
    if str(spec).strip().lower().partition("@")[0].partition("/")[0] == "pca":
        from .codec_pca import parse_spec
        parse_spec(spec)
        return "pca", None
    name, _, rest = str(spec).strip().lower().partition("/")
    if name not in CODECS:
        raise UnknownCodec(f"unknown KV codec {spec!r}: choose one of {', '.join(CODECS)}")
    if not rest:
        return name, None
    if name == "none" or not rest.startswith("g") or not rest[1:].isascii() \
            or not rest[1:].isdigit():
        raise UnknownCodec(f"bad KV codec {spec!r}: write NAME or NAME/gTOKENS (e.g. int8/g16)")
    if not 2 <= int(rest[1:]) <= MAX_GROUP:
        raise UnknownCodec(f"bad KV codec {spec!r}: its group of {int(rest[1:])} tokens is not "
                           f"in 2..{MAX_GROUP}")
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
        return self.values // 2 if self.name.startswith("int4") else self.values

    @property
    def _h(self) -> tuple[int, int, int]:
        """int4h: bytes of K's scales (and of its minima), of V's scale codes (and minimum
        codes), of V's row grids."""
        half = self.layers * self.kv_heads
        return 2 * half * self.groups * self.head_dim, half * self.block_tokens, 6 * half

    @property
    def nbytes(self) -> int:
        """Coded bytes of one block."""
        if self.name == "none":
            return self.values * self.itemsize
        if self.name == "int4":
            return self.code_bytes + 2 * 2 * self.rows * self.groups * self.head_dim
        if self.name == "int4h":
            k, v, g = self._h
            return self.code_bytes + 2 * k + 2 * v + g
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
    def encode(self, kv: torch.Tensor, pos0: int = 0) -> bytes:
        """A block tensor ``[L, 2, H, T, D]`` (any float dtype) as coded bytes (``pos0``, the
        block's first position, matters to the ``pca`` codec only)."""
        shape = (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)
        if tuple(kv.shape) != shape:
            raise ValueError(f"block of shape {tuple(kv.shape)}, the codec's is {shape}")
        if self.name == "none":
            return kv.contiguous().view(torch.uint8).numpy().tobytes()
        if self.name == "int4h":
            return _encode4h(self, kv.detach().to(torch.float32))
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
        if self.name == "int4h":
            ks, km, vs, vm = _params4h(self, src)
            k.dec4h(src[:self.code_bytes], ks, km, vs, vm, o, self.kv_heads, self.group,
                    self.rows, self.block_tokens, N * D, token0 * D)
            return
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
    if name == "pca":                     # calibrated: hostagent.inference.codec_pca
        from .codec_pca import make_pca
        return make_pca(spec, layers, kv_heads, block_tokens, head_dim, dtype)
    group = min(group or DEFAULT_GROUP[name], block_tokens)
    if name == "int4h" and head_dim != 64:
        raise UnknownCodec(f"KV codec {spec!r} needs a head dimension of 64, not {head_dim}")
    if block_tokens % group or (name == "int4" and group % 2):
        raise UnknownCodec(f"KV codec {spec!r}: its group of {group} tokens must divide the "
                           f"{block_tokens}-token block" + (" and be even" if name == "int4"
                                                            else ""))
    return Codec(name, layers, kv_heads, block_tokens, head_dim, dtype, group)


# ---- int4h: rotate, quantise; dequantise, rotate back ----------------------------------------
def rotation(dim: int = 64) -> torch.Tensor:
    """int4h's orthonormal rotation of the head dimension, ``H8 ⊗ I8 / sqrt(8)``: symmetric and
    its own inverse (``R @ R == I``), channel d mixed with the channels d ± 8k."""
    h = torch.ones(1, 1)
    while h.shape[0] < 8:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.kron(h, torch.eye(dim // 8)) / 8 ** 0.5


_R = rotation()
_R_SCALE = float(_R[0, 0])                  # 1/sqrt(8): the decoder's butterflies are unscaled


def _down(x: torch.Tensor) -> torch.Tensor:
    """fp16 at or below ``x`` (a grid's floor must not rise above the value it covers)."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.tensor(-65504.0).half()), h)


def _up(x: torch.Tensor) -> torch.Tensor:
    """fp16 at or above ``x`` (positive)."""
    h = x.clamp_min(SCALE_MIN).half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.tensor(65504.0).half()), h)


def _encode4h(c: Codec, kv: torch.Tensor) -> bytes:
    L, H, T, D, g = c.layers, c.kv_heads, c.block_tokens, c.head_dim, c.group
    y = kv @ _R                                                   # [L, 2, H, T, D]
    # K: per rotated channel over g tokens, fp16 scale and minimum
    k = y[:, 0].reshape(L, H, T // g, g, D)
    klo, khi = k.amin(3), k.amax(3)                               # [L, H, G, D]
    ks = ((khi - klo) / 15).clamp_min(SCALE_MIN).half()
    klo = klo.half()
    qk = ((k - klo.float()[:, :, :, None]) / ks.float()[:, :, :, None]).round().clamp(0, 15)
    # V: per token, 8-bit scale and minimum on the row's fp16 grid
    v = y[:, 1]                                                   # [L, H, T, D]
    lo, hi = v.amin(-1), v.amax(-1)                               # [L, H, T]
    mlo = _down(lo.amin(-1))                                      # [L, H]
    mstep = _up((lo.amax(-1) - mlo.float()) / 255)
    m8 = ((lo - mlo.float()[..., None]) / mstep.float()[..., None]).floor().clamp(0, 255)
    vmin = mlo.float()[..., None] + m8 * mstep.float()[..., None]     # <= lo
    s = ((hi - vmin) / 15).clamp_min(SCALE_MIN)
    smax = _up(s.amax(-1))
    s8 = (s / smax.float()[..., None] * 255).ceil().clamp(1, 255)
    vs = s8 * smax.float()[..., None] / 255
    qv = ((v - vmin[..., None]) / vs[..., None]).round().clamp(0, 15)
    q = torch.stack([qk.reshape(L, H, T, D), qv], 1).to(torch.uint8)   # [L, 2, H, T, D]
    packed = q[..., :D // 2] | (q[..., D // 2:] << 4)
    grid = torch.stack([smax, mlo, mstep], -1)                    # [L, H, 3]
    return b"".join(a.contiguous().numpy().tobytes() for a in (
        packed, ks, klo, s8.to(torch.uint8), m8.to(torch.uint8), grid))


def _params4h(c: Codec, src: np.ndarray):
    """The decoder's float32 scales: K's per channel, V's per token, times the rotation's
    1/sqrt(8) (the kernel's butterflies are unscaled)."""
    k, v, g = c._h
    o = c.code_bytes
    ks = src[o:o + k].view(np.float16).astype(np.float32) * _R_SCALE
    km = src[o + k:o + 2 * k].view(np.float16).astype(np.float32) * _R_SCALE
    o += 2 * k
    grid = src[o + 2 * v:o + 2 * v + g].view(np.float16).astype(np.float32).reshape(-1, 3)
    vs = (src[o:o + v].reshape(grid.shape[0], -1) * (grid[:, :1] * (_R_SCALE / 255))).ravel()
    vm = (src[o + v:o + 2 * v].reshape(grid.shape[0], -1) * (grid[:, 2:] * _R_SCALE)
          + grid[:, 1:2] * _R_SCALE).ravel()
    return ks, km, vs.astype(np.float32), vm.astype(np.float32)


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
    if name == "pca":
        from .codec_pca import warm_up as warm_pca
        warm_pca()
        _WARM.add(name)
        return
    c = make(name, 1, 1, 2, 64, torch.float32)
    c.decode_into(c.encode(torch.zeros(1, 2, 1, 2, 64)), torch.empty(1, 2, 1, 2, 64))
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
    if name == "int4h":
        # half a step of the widest rotated group (plus a minimum-grid step), spread back over
        # the 8 channels a rotated one mixes: sqrt(8) times it at most
        y = kv.float() @ _R
        rng = (y.amax() - y.amin()).item()
        ay = y.abs().amax().item()
        return 8 ** 0.5 * (rng / 15 * 0.5 * 1.02 + rng / 255 + 4 * ay * 2 ** -11) + 1e-5
    rng = (kv.amax() - kv.amin()).item()
    return rng / 15 * 0.5 * 1.01 + 2 * a * 2 ** -11 + 1e-6


__all__ = ["CODECS", "MAX_GROUP", "Codec", "UnknownCodec", "make", "parse", "ratio",
           "rotation", "warm_up"]
