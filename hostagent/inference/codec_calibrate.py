"""Calibrating the ``pca`` KV codec (``hostagent.inference.codec_pca``) for a model:
``hostagent codec calibrate --model DIR`` (``calibrate_dir``), or ``calibrate()`` on a loaded
model.

From calibration text (by default Debian's license texts ``codec_pca.CALIBRATION_TEXTS``, which
the quality measurements of ``testbed bench compress`` never use), per group (a layer's K or V,
its KV heads together; keys with RoPE taken off at their positions; the first ``SINK`` tokens of
every sequence left out, as the codec leaves them out):

1. the KV's mean and covariance, over every token of the text (up to ``max_tokens`` a text);
2. the model's sensitivity to the group: the Fisher information of its next-token distribution
   with respect to the cached KV, ``E[g g^T]`` of the gradients of ``log p(y)`` for next tokens
   ``y`` sampled from the model itself (a seeded generator), taken with prefixes of several
   lengths of each text and ``cont`` tokens after them;
3. the principal axes of the KV in that metric (``W^{1/2} C W^{1/2}``, ``W`` the Fisher matrix
   plus a small ridge): the transform ``enc = W^{1/2} U``, its inverse ``dec = U^T W^{-1/2}``,
   each axis's sign fixed (its largest entry positive);
4. per component, Lloyd-Max quantisers for 1..8 bits fitted to the calibration samples (on the
   sorted samples' prefix sums: exact cells, 60 iterations from the quantiles) and the squared
   error of 0..8 bits.

Everything runs in one thread, float64 where statistics add up, so the same model and text give
the same file, byte for byte (on the same kind of CPU: another one's float rounding may give
another file, hence another SHA-256 and other block keys, never a wrong decode).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np
import torch

from .codec_pca import (CALIBRATION_TEXTS, FORMAT, MAX_BITS, SINK, calibration_dir,
                        load_calibration)

DEFAULT_PREFIXES = (128, 256, 512, 768, 1024, 1536, 2048, 3072)
LICENSES = Path("/usr/share/common-licenses")


def _rotary(model) -> tuple[torch.Tensor, float]:
    """The model's RoPE frequencies (float32, ``head_dim / 2``) and its attention scaling."""
    rot = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise ValueError("the pca codec needs a model with rotary position embeddings "
                         "(model.model.rotary_emb)")
    return rot.inv_freq.detach().float().clone(), float(getattr(rot, "attention_scaling", 1.0))


def _unrope(k: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """``k`` [..., T, D] at positions 0..T-1 with the rotation taken off (``R^T k / scale``);
    for a gradient with respect to post-RoPE keys, ``_unrope(g) * scale**2`` is the gradient
    with respect to pre-RoPE keys."""
    T, D = k.shape[-2:]
    f = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
    rot = torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1)
    return (k * cos - rot * sin) / scale


def _groups(layers, inv_freq, scale, lo: int, grad: bool = False) -> torch.Tensor:
    """The KV (or its gradients) of ``layers`` ((keys, values) pairs) from token ``lo`` as
    [L, T - lo, 2 * H * D] float64 (a token's K heads, then its V heads)."""
    ks = torch.stack([(k.grad if grad else k)[0] for k, _ in layers])
    vs = torch.stack([(v.grad if grad else v)[0] for _, v in layers])
    ks = _unrope(ks.float(), inv_freq, scale) * (scale ** 2 if grad else 1.0)
    L, H, T, D = ks.shape
    kv = torch.stack([ks, vs.float()], 1)[:, :, :, lo:]          # [L, 2, H, T', D]
    return kv.permute(0, 3, 1, 2, 4).reshape(L, T - lo, 2 * H * D).double()


def lloyd(c: torch.Tensor, iters: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max quantisers for 1..MAX_BITS bits of each column of ``c`` [N, k] (float64):
    levels [k, 2^(MAX_BITS+1) - 2] (b bits at offset 2^b - 2) and squared error [k, MAX_BITS+1]
    (0 bits: reconstructed as 0)."""
    N, k = c.shape
    xs = c.T.contiguous().sort(1).values                              # [k, N]
    cs = torch.cat([torch.zeros(k, 1, dtype=torch.float64), xs.cumsum(1)], 1)
    sq = (xs * xs).sum(1)
    levels = np.zeros((k, (1 << (MAX_BITS + 1)) - 2), np.float32)
    dist = np.zeros((k, MAX_BITS + 1))
    dist[:, 0] = (sq / N).numpy()

    def cells(q):
        edges = (q[:, 1:] + q[:, :-1]) / 2
        idx = torch.searchsorted(xs, edges)                           # samples below each edge
        b = torch.cat([torch.zeros(k, 1, dtype=torch.long), idx,
                       torch.full((k, 1), N, dtype=torch.long)], 1)
        return b[:, 1:] - b[:, :-1], cs.gather(1, b[:, 1:]) - cs.gather(1, b[:, :-1])

    for bits in range(1, MAX_BITS + 1):
        n = 1 << bits
        q = xs[:, ((torch.arange(n, dtype=torch.float64) + 0.5) / n * N).long().clamp(max=N - 1)]
        for _ in range(iters):
            cnt, s = cells(q)
            q = torch.where(cnt > 0, s / cnt.clamp_min(1), q).sort(1).values
        cnt, s = cells(q)
        err = sq - 2 * (q * s).sum(1) + (cnt * q * q).sum(1)
        levels[:, n - 2:2 * n - 2] = q.float().numpy()
        dist[:, bits] = (err.clamp_min(0) / N).numpy()
    return levels, dist


def _sqrt_pair(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, v = torch.linalg.eigh(w)
    e = e.clamp_min(e.max() * 1e-12)
    return (v * e.sqrt()) @ v.T, (v * e.rsqrt()) @ v.T


def calibrate(model, sequences: dict[str, list[int]], model_name: str = "model",
              max_tokens: int = 8192, prefixes=DEFAULT_PREFIXES, cont: int = 128,
              ridge: float = 1e-4, log=print) -> bytes:
    """A calibration file's bytes for ``model`` (a transformers decoder with RoPE) from token
    sequences by name (the module docstring)."""
    from transformers import DynamicCache
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inv_freq, scale = _rotary(model)
        cfg = model.config
        L = cfg.num_hidden_layers
        H = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        G, P = L, 2 * H * D
        params = [p.requires_grad for p in model.parameters()]
        for p in model.parameters():
            p.requires_grad_(False)
        t0 = time.monotonic()
        xs = []                                              # [2L, T', P] per sequence
        for name, ids in sorted(sequences.items()):
            ids = list(ids)[:max_tokens]
            cache = DynamicCache(config=cfg)
            with torch.inference_mode():
                for a in range(0, len(ids), 256):
                    model(input_ids=torch.tensor([ids[a:a + 256]]), past_key_values=cache,
                          use_cache=True, logits_to_keep=1)
            xs.append(_groups([(l.keys, l.values) for l in cache.layers], inv_freq, scale,
                              SINK).float())
        x = torch.cat(xs, 1)                                 # [G, N, P]
        del xs
        log(f"calibrate: KV of {x.shape[1]} tokens ({time.monotonic() - t0:.0f} s)")
        gen = torch.Generator().manual_seed(0)
        fisher, n = torch.zeros(G, P, P, dtype=torch.float64), 0
        for name, ids in sorted(sequences.items()):
            for pre in prefixes:
                if len(ids) < pre + cont:
                    continue
                cache = DynamicCache(config=cfg)
                with torch.no_grad():
                    model(input_ids=torch.tensor([ids[:pre]]), past_key_values=cache,
                          use_cache=True, logits_to_keep=1)
                leaves = []
                for layer in cache.layers:
                    layer.keys = layer.keys.detach().requires_grad_(True)
                    layer.values = layer.values.detach().requires_grad_(True)
                    leaves.append((layer.keys, layer.values))
                logits = model(input_ids=torch.tensor([ids[pre:pre + cont]]),
                               past_key_values=cache, use_cache=True).logits[0].float()
                lp = torch.log_softmax(logits, -1)
                y = torch.multinomial(lp.detach().exp(), 1, generator=gen)
                (-lp.gather(1, y).sum()).backward()
                g = _groups(leaves, inv_freq, scale, SINK, grad=True)
                fisher += g.transpose(1, 2) @ g
                n += g.shape[1]
        if not n:
            raise ValueError(f"no text is {min(prefixes) + cont} tokens long: nothing to "
                             f"measure the model's sensitivity on")
        log(f"calibrate: sensitivity from {n} token gradients ({time.monotonic() - t0:.0f} s)")
        out = {k: [] for k in ("mean", "enc", "dec", "levels", "dist")}
        for g in range(G):
            mu = x[g].double().mean(0)
            xc = x[g].double() - mu
            w = fisher[g] / n
            w = w + ridge * torch.trace(w) / P * torch.eye(P, dtype=torch.float64)
            wh, wih = _sqrt_pair(w)
            e, u = torch.linalg.eigh(wh @ (xc.T @ xc / xc.shape[0]) @ wh)
            u = u.flip(1)                                    # largest variance first
            u = u * torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
            enc = wh @ u
            levels, dist = lloyd(xc @ enc)
            for k, v in (("mean", mu.float().numpy()), ("enc", enc.float().numpy()),
                         ("dec", (u.T @ wih).float().numpy()), ("levels", levels),
                         ("dist", dist)):
                out[k].append(v)
        log(f"calibrate: transforms and quantisers ({time.monotonic() - t0:.0f} s)")
        for p, r in zip(model.parameters(), params):
            p.requires_grad_(r)
    finally:
        torch.set_num_threads(threads)
    from safetensors.numpy import save
    arrays = {k: np.ascontiguousarray(np.stack(v)) for k, v in out.items()}
    arrays["inv_freq"] = inv_freq.numpy()
    meta = {"format": FORMAT, "model": model_name, "layers": str(L), "kv_heads": str(H),
            "head_dim": str(D), "sink": str(SINK), "rope_scale": repr(scale),
            "tokens": str(int(x.shape[1])), "fisher_tokens": str(n),
            "texts": json.dumps({k: hashlib.sha256(json.dumps(list(v)[:max_tokens]).encode())
                                 .hexdigest() for k, v in sorted(sequences.items())}),
            "prefixes": json.dumps(list(prefixes)), "cont": str(cont), "ridge": repr(ridge)}
    # one metadata entry (safetensors writes a metadata map in no fixed order)
    return save(arrays, metadata={"kvswitch-pca": json.dumps(meta, sort_keys=True)})


def write(data: bytes, model_name: str, directory: str | Path | None = None) -> Path:
    """Store calibration bytes as ``pca-<model>-<sha256 16>.safetensors`` in ``directory``
    (default: the calibration directory); the path."""
    d = Path(directory) if directory else calibration_dir()
    d.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9.]+", "-", model_name.lower()).strip("-")[:48] or "model"
    path = d / f"pca-{slug}-{hashlib.sha256(data).hexdigest()[:16]}.safetensors"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def license_sequences(tok, names=CALIBRATION_TEXTS) -> dict[str, list[int]]:
    """Token ids of Debian's license texts ``names``."""
    return {n: tok((LICENSES / n).read_text(encoding="utf-8"))["input_ids"] for n in names}


def calibrate_dir(model_dir: str, text_files=(), max_tokens: int = 8192,
                  out_dir: str | None = None, log=print) -> dict:
    """``hostagent codec calibrate``: calibrate the checkpoint in ``model_dir`` on
    ``text_files`` (default: Debian's ``CALIBRATION_TEXTS``) and store the file; its path,
    SHA-256 and the ``kv_codec`` naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = ({Path(f).name: tok(Path(f).read_text(encoding="utf-8"))["input_ids"]
             for f in text_files} if text_files else license_sequences(tok))
    name = Path(model_dir).resolve().name
    path = write(calibrate(model, seqs, name, max_tokens, log=log), name, out_dir)
    cal = load_calibration(path)
    return {"path": str(path), "sha256": cal.sha256, "kv_codec": f"pca@{cal.id}"}
