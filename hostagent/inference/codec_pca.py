"""The ``pca`` KV codec: transform coding with a calibrated decorrelating transform (after KVTC,
ICLR'26, and CacheGen, SIGCOMM'24), at a fixed rate so every coded block of a layout has the same
size (a reader derives the chunk count, as with every codec here).

Calibration (``hostagent.inference.codec_calibrate``, ``hostagent codec calibrate``), once per
model, on text the measurements never see; deterministic (the same model and text give the same
bytes), stored as a safetensors file named by its SHA-256, whose first 16 hex digits join the
codec's tag and so the block keys (a block coded under one calibration is never looked up, let
alone decoded, under another). Per group (a layer: its K heads, then its V heads, each token a
vector of ``P = 2 * kv_heads * head_dim`` values, keys with RoPE taken off at their positions;
K and V are both linear in the layer's input, so coding them together takes their correlation
out too):

- a mean and a transform: the principal axes of the KV in the metric of the model's own
  sensitivity (the Fisher information of its next-token distribution with respect to the cached
  KV, measured with gradients on the calibration text). ``enc`` [P, P] maps ``x - mean`` to
  components, ``dec`` [P, P] back; squared error in components approximates the model's
  expected loss;
- per component a Lloyd-Max quantiser (levels fitted to the component's calibration samples)
  for 1..8 bits, and its error at 0..8 bits;
- bit allocation (for a block's bit budget): greedily, the next bit to the component whose error
  it lowers most (the error tables are convex, so this is the optimum an exhaustive dynamic
  programme over components would find); components with 0 bits are not sent at all.

Spec: ``pca`` (ratio 8 against 16-bit KV), ``pca/xN`` (ratio N, 2..32); ``@REF`` names the
calibration: a file path, or a prefix (8+ hex digits) of its SHA-256 in the calibration directory
(``$KVSWITCH_CALIBRATION_DIR``, default ``~/.cache/kvswitch/calibrations``); without it, the one
calibration there whose layout matches.

A coded block (``nbytes`` = 16-bit bytes / N, rounded down):

- header, 16 bytes: ``KVPC``, the first token's position (uint32 LE), the calibration's first 8
  SHA-256 bytes;
- in the block at position 0 only: its first ``SINK`` tokens (attention sinks, far from every
  calibrated distribution) as INT8 per (token, layer, K/V, head) with an fp16 scale, keys with
  RoPE, int8 ``[L, 2, H, SINK, D]`` then fp16 ``[L, 2, H, SINK]``; they replace what the code
  streams say for them, and the block's streams get the bits left (a second allocation);
- the code streams of every token (``codec_pca_kernels``: per layer, per component with bits,
  its tokens' codes), then zero padding to ``nbytes`` (at least 8 bytes).

Decoding (one block, as it arrives): the codes unpacked and dequantised into a matrix of
components in one numba pass; the inverse transform as one batched matrix product (bfloat16 on a
CPU with AMX or AVX-512 BF16, where it runs at several times float32's speed; float32 elsewhere);
one more numba pass adds the mean, puts RoPE back on the keys and writes float32 straight into
the destination cache tensor's rows.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import threading
from pathlib import Path

import numpy as np
import torch

from .codec import UnknownCodec

NAME = "pca"
DEFAULT_RATIO = 8
MAX_BITS = 8
SINK = 2
MAGIC = b"KVPC"
HEADER = 16
PAD = 8
FORMAT = "kvswitch-pca/1"
# the calibration's default text: Debian's license texts the quality measurements never use
CALIBRATION_TEXTS = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "MPL-1.1", "MPL-2.0")


def calibration_dir() -> Path:
    return Path(os.environ.get("KVSWITCH_CALIBRATION_DIR")
                or Path.home() / ".cache" / "kvswitch" / "calibrations")


def parse_spec(spec: str) -> tuple[int, str | None]:
    """``pca[/xN][@REF]`` -> (ratio N, REF or None); REF keeps its case (a path)."""
    text = str(spec).strip()
    body, at, ref = text.partition("@")
    name, _, rest = body.lower().partition("/")
    if name != NAME or (at and not ref.strip()):
        raise UnknownCodec(f"bad KV codec {spec!r}: write pca, pca/xN or pca[/xN]@CALIBRATION")
    ratio = DEFAULT_RATIO
    if rest:
        if not (rest.startswith("x") and rest[1:].isascii() and rest[1:].isdigit()):
            raise UnknownCodec(f"bad KV codec {spec!r}: write pca/xN (N: the ratio, 2..32)")
        ratio = int(rest[1:])
        if not 2 <= ratio <= 32:
            raise UnknownCodec(f"bad KV codec {spec!r}: its ratio {ratio} is not in 2..32")
    return ratio, (ref.strip() if at else None)


class Calibration:
    """A calibration file, loaded (read-only arrays) and identified by its SHA-256."""

    ARRAYS = ("mean", "enc", "dec", "levels", "dist", "inv_freq")

    def __init__(self, data: bytes, path: str = "<bytes>"):
        from safetensors.numpy import load
        self.path, self.sha256 = path, hashlib.sha256(data).hexdigest()
        header_len = int.from_bytes(data[:8], "little")
        try:
            meta = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["kvswitch-pca"])
            ok = meta.get("format") == FORMAT
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise UnknownCodec(f"{path} is not a pca calibration ({FORMAT})")
        self.meta = meta
        arrays = load(data)
        for name in self.ARRAYS:
            setattr(self, name, arrays[name])
        self.layers, self.kv_heads, self.head_dim = (int(meta[k]) for k in
                                                     ("layers", "kv_heads", "head_dim"))
        self.rope_scale = float(meta.get("rope_scale", 1.0))
        self._alloc: dict[int, np.ndarray] = {}

    @property
    def id(self) -> str:
        return self.sha256[:16]

    @property
    def groups(self) -> int:
        return self.layers

    @property
    def width(self) -> int:
        return 2 * self.kv_heads * self.head_dim

    def levels_for(self, g: int, j: int, b: int) -> np.ndarray:
        return self.levels[g, j, (1 << b) - 2:(1 << (b + 1)) - 2]

    def allocation(self, budget: int) -> np.ndarray:
        """Bits per component [groups, width] summing to at most ``budget`` (bits a token):
        greedy on the error tables, ties to the lower index (the same on every machine)."""
        if budget not in self._alloc:
            dist = self.dist.reshape(-1, MAX_BITS + 1)
            bits = [0] * dist.shape[0]
            heap = [(-(float(d[0]) - float(d[1])), i) for i, d in enumerate(dist)]
            heapq.heapify(heap)
            for _ in range(min(budget, MAX_BITS * len(bits))):
                _, i = heapq.heappop(heap)
                bits[i] += 1
                if bits[i] < MAX_BITS:
                    heapq.heappush(heap, (-(float(dist[i, bits[i]]) -
                                            float(dist[i, bits[i] + 1])), i))
            self._alloc[budget] = np.array(bits, np.uint8).reshape(self.groups, self.width)
        return self._alloc[budget]


_CACHE: dict[tuple, Calibration] = {}
_LOCK = threading.Lock()


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file, read once a process (again if it changed on disk)."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as exc:
        raise UnknownCodec(f"pca calibration {str(path)!r}: {exc.strerror or exc}") from None
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = Calibration(p.read_bytes(), str(p))
        return _CACHE[key]


def find_calibration(ref: str | None, layers: int, kv_heads: int, head_dim: int) -> Calibration:
    """The calibration ``ref`` names (a path, or a SHA-256 prefix in ``calibration_dir()``), or
    the one in the directory whose layout matches; one line if none or several fit."""
    d = calibration_dir()
    if ref and (os.sep in ref or ref.endswith(".safetensors")):
        cal = load_calibration(ref)
    else:
        if ref and not (len(ref) >= 8 and all(c in "0123456789abcdef" for c in ref.lower())):
            raise UnknownCodec(f"pca calibration {ref!r}: name a file or 8+ hex digits of its "
                               f"SHA-256")
        files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
        cals = [load_calibration(f) for f in files]
        if ref:
            cals = [c for c in cals if c.sha256.startswith(ref.lower())]
        fit = [c for c in cals if (c.layers, c.kv_heads, c.head_dim) ==
               (layers, kv_heads, head_dim)]
        if len(fit) != 1:
            what = f"@{ref}" if ref else f"for {layers} layers, {kv_heads} KV heads of {head_dim}"
            if not fit:
                raise UnknownCodec(f"no pca calibration {what} in {d}: make one with "
                                   f"`hostagent codec calibrate --model DIR`")
            raise UnknownCodec(f"several pca calibrations {what} in {d}: name one, pca@"
                               + " or pca@".join(c.id for c in fit))
        cal = fit[0]
    if (cal.layers, cal.kv_heads, cal.head_dim) != (layers, kv_heads, head_dim):
        raise UnknownCodec(f"pca calibration {cal.path} is for {cal.layers} layers, "
                           f"{cal.kv_heads} KV heads of {cal.head_dim}, not this layout")
    return cal


def _bf16_ok() -> bool:
    """bfloat16 matrix products are fast here (AMX or AVX-512 BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


BF16 = _bf16_ok() and os.environ.get("KVSWITCH_PCA_FLOAT32") != "1"
# decodes write an aligned cache with streaming stores (codec_pca_kernels, STREAM_ALIGN)
STREAM = os.environ.get("KVSWITCH_PCA_STREAM") != "0"


def _buckets(k: np.ndarray, n: int = 3) -> list[np.ndarray]:
    """Groups split into at most ``n`` batches of similar component counts ``k`` (each batch's
    matrix as tall as its largest count, rounded up to 32: the bf16 product runs at half speed
    on other sizes) with the fewest rows in all: a small dynamic programme over the sorted
    counts."""
    order = np.argsort(k, kind="stable")
    ks = -(-np.maximum(k[order], 1) // 32) * 32
    G = len(k)
    best = {(0, 0): (0, ())}                      # (groups taken, batches) -> (rows, cuts)
    for m in range(1, n + 1):
        for i in range(1, G + 1):
            opts = [(best[(j, m - 1)][0] + (i - j) * int(ks[i - 1]), best[(j, m - 1)][1] + (i,))
                    for j in range(i) if (j, m - 1) in best]
            if opts:
                best[(i, m)] = min(opts)
    cuts = min(best[(G, m)] for m in range(1, n + 1) if (G, m) in best)[1]
    return [np.sort(order[lo:hi]).astype(np.int64) for lo, hi in zip((0,) + cuts, cuts)]


class _Plan:
    """One allocation's tables: bits and matrix row per component, the groups in batches of
    similar component counts, each batch's inverse transform rows, the decoder's levels and
    the encoder's decision edges."""

    def __init__(self, cal: Calibration, bits: np.ndarray, tokens: int, bf16: bool):
        G, P = bits.shape
        self.bits, self.tokens = bits, tokens
        coded = bits > 0
        self.slot = np.zeros((G, P), np.int32)
        levels = np.zeros((G, P, 1 << MAX_BITS), np.float32)
        edges = np.full((G, P, (1 << MAX_BITS) - 1), np.inf, np.float32)
        for g in range(G):
            cols = np.flatnonzero(coded[g])
            self.slot[g, cols] = np.arange(len(cols), dtype=np.int32)
            for j in cols:
                lev = cal.levels_for(g, j, int(bits[g, j]))
                levels[g, j, :len(lev)] = lev
                edges[g, j, :len(lev) - 1] = (lev[1:] + lev[:-1]) / 2
        self.batches = []                 # (groups, rows K, inverse transform [n, K, P])
        for gids in _buckets(coded.sum(1)):
            K = -(-max(1, int(coded[gids].sum(1).max())) // 32) * 32
            dec = np.zeros((len(gids), K, P), np.float32)
            for i, g in enumerate(gids):
                cols = np.flatnonzero(coded[g])
                dec[i, :len(cols)] = cal.dec[g, cols]
            d = torch.from_numpy(dec)
            self.batches.append((gids, K, d.bfloat16() if bf16 else d))
        self.edges = edges
        self.code_bytes = tokens * int(bits.sum()) // 8
        per = tokens * bits.sum(1, dtype=np.int64) // 8           # each group's stream bytes
        self.goff = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
        self.levels = (torch.from_numpy(levels).bfloat16().view(torch.int16).numpy()
                       .view(np.uint16) if bf16 else levels)


class PcaCodec:
    """The ``pca`` codec bound to a block shape and a calibration (the module docstring)."""

    def __init__(self, ratio: int, cal: Calibration, layers: int, kv_heads: int,
                 block_tokens: int, head_dim: int, dtype: torch.dtype):
        if block_tokens % 8:
            raise UnknownCodec(f"KV codec pca needs blocks of a multiple of 8 tokens, not "
                               f"{block_tokens}")
        self.name, self.group, self.cal, self.target = NAME, 0, cal, ratio
        self.layers, self.kv_heads, self.block_tokens = layers, kv_heads, block_tokens
        self.head_dim, self.dtype = head_dim, dtype
        self.nbytes = 2 * self.values // ratio
        self.sink_bytes = self.rows * SINK * (head_dim + 2)
        avail = (self.nbytes - HEADER - PAD) * 8
        budget, budget0 = avail // block_tokens, (avail - 8 * self.sink_bytes) // block_tokens
        if budget0 < 1:
            raise UnknownCodec(f"KV codec pca/x{ratio}: no bits left for {block_tokens}-token "
                               f"blocks")
        self.bf16 = BF16
        self.plan = _Plan(cal, cal.allocation(budget), block_tokens, self.bf16)
        self.plan0 = _Plan(cal, cal.allocation(budget0), block_tokens, self.bf16)
        self.mean = cal.mean
        self.mean_t, self.enc_t = torch.from_numpy(cal.mean), torch.from_numpy(cal.enc).mT
        self.inv_freq = torch.from_numpy(cal.inv_freq.copy())
        self._tls = threading.local()

    itemsize = property(lambda self: self.dtype.itemsize)
    rows = property(lambda self: self.layers * 2 * self.kv_heads)
    values = property(lambda self: self.rows * self.block_tokens * self.head_dim)
    ratio = property(lambda self: 2 * self.values / self.nbytes)
    bits_per_token = property(lambda self: int(self.plan.bits.sum()))

    def tag(self) -> bytes:
        return f" codec={NAME}/x{self.target}@{self.cal.id}".encode()

    def _rope(self, pos0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, head_dim / 2] of positions pos0.. as the model computes them
        (float32 angles), times the RoPE scale."""
        f = torch.arange(pos0, pos0 + n, dtype=torch.float32)[:, None] * self.inv_freq[None]
        return f.cos() * self.cal.rope_scale, f.sin() * self.cal.rope_scale

    def _header(self, pos0: int) -> bytes:
        return MAGIC + int(pos0).to_bytes(4, "little") + bytes.fromhex(self.cal.sha256[:16])

    # ---- encode ---------------------------------------------------------------------------
    def encode(self, kv: torch.Tensor, pos0: int = 0) -> bytes:
        """A block tensor ``[L, 2, H, T, D]`` whose first token is at position ``pos0``."""
        from . import codec_pca_kernels as kern
        L, H, T, D = self.layers, self.kv_heads, self.block_tokens, self.head_dim
        if tuple(kv.shape) != (L, 2, H, T, D):
            raise ValueError(f"block of shape {tuple(kv.shape)}, the codec's is "
                             f"{(L, 2, H, T, D)}")
        if not 0 <= pos0 < 1 << 32:
            raise ValueError(f"position {pos0} out of range")
        x = kv.detach().to(torch.float32)
        out = np.zeros(self.nbytes, np.uint8)
        out[:HEADER] = np.frombuffer(self._header(pos0), np.uint8)
        off, plan = HEADER, self.plan
        if pos0 == 0:                     # attention sinks: as they are, besides their codes
            plan = self.plan0
            sink = x[:, :, :, :SINK]
            scale = (sink.abs().amax(-1) / 127).clamp_min(2.0 ** -20).half()
            q = (sink / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
            raw = q.numpy().tobytes() + scale.numpy().tobytes()
            out[off:off + len(raw)] = np.frombuffer(raw, np.uint8)
            off += len(raw)
        cos, sin = self._rope(pos0, T)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        k = x[:, 0]
        k = (k * cos - torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin) / \
            self.cal.rope_scale ** 2
        y = torch.stack([k, x[:, 1]], 1).permute(0, 3, 1, 2, 4).reshape(L, T, 2 * H * D)
        c = torch.bmm(self.enc_t, (y - self.mean_t[:, None]).transpose(1, 2))  # [L, P, T]
        kern.quantise(c.numpy(), plan.edges, plan.bits, out, off)
        return out.tobytes()

    # ---- decode ---------------------------------------------------------------------------
    def _buffers(self, plan: _Plan) -> list:
        """This thread's work space for ``plan``, per batch: components [n, K, T] (rows a group
        does not fill hold finite leftovers that meet zero rows of the inverse transform), the
        same as a tensor, and the inverse transform's output [n, T, P]."""
        bufs = self._tls.__dict__.setdefault("bufs", {})
        if id(plan) not in bufs:
            dt = np.uint16 if self.bf16 else np.float32
            bufs[id(plan)] = out = []
            for gids, K, dec in plan.batches:
                coef = np.zeros((len(gids), K, plan.tokens), dt)
                c = torch.from_numpy(coef)
                y = torch.empty(len(gids), plan.tokens, self.cal.width, dtype=dec.dtype)
                out.append((coef, (c.view(torch.bfloat16) if self.bf16 else c).transpose(1, 2),
                            y, y.view(torch.int16).numpy().view(np.uint16) if self.bf16 else
                            y.numpy()))
        return bufs[id(plan)]

    def decode_into(self, buf, out: torch.Tensor, token0: int = 0) -> None:
        """Decode one coded block (read in place) into tokens ``token0``.. of ``out``, a
        contiguous ``[L, 2, H, N, D]`` float32 tensor (other dtypes through a float32 copy)."""
        from . import codec_pca_kernels as kern
        src = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else \
            buf.reshape(-1).view(np.uint8)
        if src.nbytes != self.nbytes:
            raise ValueError(f"a coded block has {src.nbytes} bytes, codec {NAME} of this "
                             f"layout {self.nbytes}")
        if bytes(src[:4]) != MAGIC or bytes(src[8:16]).hex() != self.cal.sha256[:16]:
            raise ValueError(f"not a block of calibration {self.cal.id}")
        L, _, H, N, D = out.shape
        T = self.block_tokens
        if (L, H, D) != (self.layers, self.kv_heads, self.head_dim) or \
                not 0 <= token0 <= N - T or not out.is_contiguous():
            raise ValueError("decode target does not match the codec's layout")
        if out.dtype != torch.float32:
            tmp = torch.empty(L, 2, H, T, D, dtype=torch.float32)
            self.decode_into(src, tmp, 0)
            out[:, :, :, token0:token0 + T].copy_(tmp)
            return
        pos0 = int.from_bytes(bytes(src[4:8]), "little")
        off, plan = HEADER, (self.plan0 if pos0 == 0 else self.plan)
        if pos0 == 0:
            off += self.sink_bytes
        goff = plan.goff + off
        cos, sin = (a.numpy() for a in self._rope(pos0, T))
        o = out.view(-1).numpy()
        fin = kern.finish(self.bf16, STREAM and D % 16 == 0 and
                          o.ctypes.data % kern.STREAM_ALIGN == 0)
        for (gids, _, dec), (coef, ct, y, yn) in zip(plan.batches, self._buffers(plan)):
            kern.unpack(src, goff, gids, plan.bits, plan.slot, plan.levels, coef)
            torch.bmm(ct, dec, out=y)
            fin(yn, gids, self.mean, cos, sin, H, 2 * H, D, o, N * D, token0 * D)
        if pos0 == 0:                     # the sinks' own values over their codes'
            n = self.rows * SINK * D
            q = _tensor(src[HEADER:HEADER + n], torch.int8).view(L, 2, H, SINK, D)
            scale = _tensor(src[HEADER + n:HEADER + self.sink_bytes], torch.float16)
            out[:, :, :, token0:token0 + SINK] = q.float() * scale.float().view(L, 2, H, SINK, 1)

    def decode(self, buf, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A coded block as a new ``[L, 2, H, T, D]`` tensor."""
        out = torch.empty(self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)
        self.decode_into(buf, out)
        return out if out.dtype == dtype else out.to(dtype)


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A read-only byte array as a tensor (only read from)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(a, dtype=dtype)


_CODECS: dict[tuple, PcaCodec] = {}


def make_pca(spec: str, layers: int, kv_heads: int, block_tokens: int, head_dim: int,
             dtype: torch.dtype) -> PcaCodec:
    """The ``pca`` codec ``spec`` for a layout (made once a process per calibration, ratio,
    layout and decoder kind: its tables take a moment)."""
    ratio, ref = parse_spec(spec)
    cal = find_calibration(ref, layers, kv_heads, head_dim)
    key = (cal.sha256, ratio, layers, kv_heads, block_tokens, head_dim, dtype, BF16)
    with _LOCK:
        if key not in _CODECS:
            _CODECS[key] = PcaCodec(ratio, cal, layers, kv_heads, block_tokens, head_dim, dtype)
        return _CODECS[key]


def warm_up() -> None:
    """Compile (or load from numba's cache) the loops for the types a decode passes."""
    from . import codec_pca_kernels as kern
    bits = np.ones((1, 8), np.uint8)
    slot = np.arange(8, dtype=np.int32)[None]
    goff, gids = np.zeros(1, np.int64), np.zeros(1, np.int64)
    dt = np.uint16 if BF16 else np.float32
    for src in (np.frombuffer(bytes(24), np.uint8), np.zeros(24, np.uint8)):
        kern.unpack(src, goff, gids, bits, slot, np.zeros((1, 8, 1 << MAX_BITS), dt),
                    np.zeros((1, 8, 8), dt))
    kern.quantise(np.zeros((1, 8, 8), np.float32), np.zeros((1, 8, 255), np.float32), bits,
                  np.zeros(24, np.uint8), 0)
    y = np.zeros((1, 8, 32), dt)
    cs = np.ones((8, 8), np.float32)
    out = torch.zeros(256).numpy()                   # torch's allocations are 64-byte aligned
    for stream in (False, True):
        kern.finish(BF16, stream)(y, gids, np.zeros((1, 32), np.float32), cs, cs, 1, 2, 16, out,
                                  128, 0)
