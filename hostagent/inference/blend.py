"""CacheBlend on a Hugging Face Llama-style decoder: reuse the KV of passages that sit anywhere in
a prompt, not only at its start (issue #31; Yao et al., EuroSys'25).

It owns the compute side: moving a passage's KV, computed at positions 0.., to its positions in a
prompt (``rerotate``: keys are multiplied by the RoPE rotation of the offset, values are kept),
picking the tokens to recompute (``select``: largest KV deviation between the reused and the
freshly computed KV of a check layer) and the fused prefill (``blend_prefill``), which runs the
first layer over every token, the check layer's projections over every token, and every later
layer only over the selected tokens and the question, whose queries attend over the fused KV.
``hostagent.inference.blend_store`` moves passages' KV through the pool (position-independent keys).

RoPE. Llama-style models (``rotate_half``) rotate each pair (i, i + D/2) of a key by angle
p * inv_freq[i]; rotations compose, so R(p + o) k = R(o) (R(p) k): re-rotating a key computed at
p by the offset o gives the key at p + o, up to float rounding. Only RoPE types whose
``attention_scaling`` is 1 compose this way (default, linear, dynamic within range, llama3);
others are refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch                                       # noqa: E402
import torch.nn.functional as F                    # noqa: E402
from transformers import DynamicCache              # noqa: E402

KV = list[tuple[torch.Tensor, torch.Tensor]]       # per layer (K, V), each [1, H, T, D]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def rotary(model):
    """The model's rotary embedding module (Llama, Mistral, Qwen2 layouts)."""
    rot = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rot is None:
        raise ValueError("the model has no rotary embedding (model.model.rotary_emb)")
    if float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        raise ValueError("RoPE with attention scaling does not compose: re-rotation refused")
    return rot


def cos_sin(model, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of the model's RoPE at ``positions`` (1-D), each [1, 1, T, D]."""
    x = torch.empty(0, dtype=dtype)
    cos, sin = rotary(model)(x, positions[None])
    return cos[:, None], sin[:, None]


@torch.inference_mode()
def rerotate(model, keys: torch.Tensor, offset: int) -> torch.Tensor:
    """Keys [1, H, T, D] computed at positions p..p+T-1, moved by ``offset`` (p+offset..;
    negative offsets move back)."""
    if offset == 0:
        return keys
    cos, sin = cos_sin(model, torch.tensor([offset]), keys.dtype)
    return _rope(keys, cos, sin)


def move(model, kv: KV, offset: int) -> KV:
    """A passage's KV (all layers) moved to ``offset``: keys re-rotated, values as they are."""
    return [(rerotate(model, k, offset), v) for k, v in kv]


def deviation(fresh_k, fresh_v, old_k, old_v, of: str = "kv") -> torch.Tensor:
    """Per token [T]: squared L2 distance of K and/or V (``of``: "kv", "k", "v") summed over
    heads and dims."""
    if of not in ("kv", "k", "v"):
        raise ValueError(f"deviation of {of!r}: one of kv, k, v")
    out = torch.zeros(fresh_k.shape[2], dtype=torch.float32)
    if "k" in of:
        out = out + ((fresh_k - old_k).float() ** 2).sum(dim=(0, 1, 3))
    if "v" in of:
        out = out + ((fresh_v - old_v).float() ** 2).sum(dim=(0, 1, 3))
    return out


def select(dev: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` candidate positions (bool mask ``candidates`` over dev's tokens) with the
    largest deviation, sorted by position (ties: the earlier position)."""
    count = max(0, min(int(count), int(candidates.sum())))
    if count == 0:
        return torch.empty(0, dtype=torch.long)
    pos = torch.nonzero(candidates, as_tuple=True)[0]
    vals = dev[pos]
    # stable: sort by (-dev, position)
    order = sorted(range(len(pos)), key=lambda i: (-float(vals[i]), int(pos[i])))[:count]
    return torch.sort(pos[torch.tensor(order)]).values


def to_cache(kv: KV, config=None) -> DynamicCache:
    return DynamicCache([(k, v) for k, v in kv], config=config)


def cache_kv(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.inference_mode()
def passage_kv(model, tokens, position: int = 0, lead=()) -> KV:
    """A passage's KV computed without the prompt's context: what is stored. With ``lead``
    tokens (a fixed leading text, e.g. the system prompt) the passage is computed after them, at
    positions ``position + len(lead)``.., and only the passage's KV is kept: the lead takes the
    attention sink that the passage's first token becomes when computed alone."""
    lead = list(lead)
    ids = torch.tensor([lead + list(tokens)])
    pos = torch.arange(position, position + ids.shape[1])[None]
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    n = len(lead)
    return [(k[:, :, n:].clone(), v[:, :, n:].clone()) for k, v in cache_kv(cache)]


@dataclass
class Blended:
    logits: torch.Tensor          # for the token after the prompt
    cache: DynamicCache           # the fused cache of the whole prompt
    selected: torch.Tensor        # reused positions recomputed (sorted)
    recomputed: int               # tokens run through every layer (selected + the fresh tail)


def _qkv(attn, x, cos, sin):
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _attend(layer, h, q, k_all, v_all, q_pos, k_pos):
    """Attention of queries at q_pos over keys at k_pos (causal by position), o_proj, residual,
    MLP, residual."""
    attn = layer.self_attn
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=attn.scaling,
                                         enable_gqa=q.shape[1] != k_all.shape[1])
    h = h + attn.o_proj(out.transpose(1, 2).reshape(*h.shape[:-1], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _shares(ratio: float, layers: int, widen: float) -> list[float]:
    """Gradual filtering: the share kept at each of ``layers`` check layers, from
    ``ratio * widen`` at the first down to ``ratio`` at the last (geometric)."""
    if layers == 1:
        return [ratio]
    return [min(1.0, ratio * widen ** ((layers - 1 - i) / (layers - 1))) for i in range(layers)]


@torch.inference_mode()
def blend_prefill(model, tokens, reused: KV, candidates: torch.Tensor, ratio: float,
                  check_layers=(1,), widen: float = 1.0, forced: torch.Tensor | None = None,
                  of: str = "kv") -> Blended:
    """The fused prefill of ``tokens``, whose first R positions have ``reused`` KV (every
    layer, already at their positions) and whose tail (R..) is computed fresh.

    Layers below the first check layer run over every token. At each check layer the fresh K/V
    (``of``: K and V, K or V) of the reused tokens still running are compared with the reused
    ones and the ones with the largest deviation are kept: ``ratio * widen`` of the
    ``candidates`` (bool mask over the R reused positions) at the first check layer, narrowing
    geometrically to ``ratio`` at the last (CacheBlend's gradual filtering; one check layer:
    ``ratio`` at once). ``forced`` positions (bool mask) are always kept and count within the
    budget. From a check layer on only the kept tokens and the tail run; their fresh KV replaces
    the reused KV in the fused cache of that layer and above."""
    inner = model.model
    ids = torch.tensor([list(tokens)])
    T, R = ids.shape[1], reused[0][0].shape[2]
    if not 0 <= R < T or candidates.shape != (R,):
        raise ValueError("reused KV must cover a proper prefix; candidates one flag per reused "
                         "position")
    checks = sorted(set(int(c) for c in check_layers))
    if not checks or not 1 <= checks[0] or checks[-1] >= len(inner.layers):
        raise ValueError("check layers must be layers after the first")
    forced = torch.zeros(R, dtype=torch.bool) if forced is None else forced.bool()
    shares = dict(zip(checks, _shares(ratio, len(checks), widen)))
    ncand = int(candidates.sum())
    h = inner.embed_tokens(ids)
    pos = torch.arange(T)
    cos, sin = cos_sin(model, pos, h.dtype)
    fused: KV = []
    idx = pos                                        # the tokens still running (sorted)
    selected = torch.empty(0, dtype=torch.long)
    for li, layer in enumerate(inner.layers):
        x = layer.input_layernorm(h)
        q, k, v = _qkv(layer.self_attn, x, cos[:, :, idx], sin[:, :, idx])
        if li < checks[0]:                         # every token, fresh
            fused.append((k, v))
            h = _attend(layer, h, q, k, v, idx, pos)
            continue
        rk, rv = reused[li]
        if li in shares:                           # the running tokens' fresh K/V are at hand
            nr = int((idx < R).sum())              # reused positions come first (sorted)
            ridx = idx[:nr]
            dev = torch.zeros(R)
            dev[ridx] = deviation(k[:, :, :nr], v[:, :, :nr], rk[:, :, ridx], rv[:, :, ridx], of)
            now = torch.zeros(R, dtype=torch.bool)
            now[ridx] = True
            budget = round(shares[li] * ncand) - int(forced.sum())
            chosen = select(dev, now & candidates & ~forced, budget)
            selected = torch.sort(torch.cat((chosen, torch.nonzero(forced)[:, 0]))).values
            keep = torch.cat((selected, torch.arange(R, T)))
            rows = torch.searchsorted(idx, keep)
            q, k, v, h = q[:, :, rows], k[:, :, rows], v[:, :, rows], h[:, rows]
            idx = keep
        K = torch.cat((rk, rk.new_empty(1, rk.shape[1], T - R, rk.shape[3])), dim=2)
        V = torch.cat((rv, rv.new_empty(1, rv.shape[1], T - R, rv.shape[3])), dim=2)
        K[:, :, idx], V[:, :, idx] = k, v
        fused.append((K, V))
        h = _attend(layer, h, q, K, V, idx, pos)
    logits = model.lm_head(inner.norm(h[:, -1:]))[0, -1]
    return Blended(logits, to_cache(fused, model.config), selected, len(idx))


@torch.inference_mode()
def reuse_prefill(model, tokens, reused: KV):
    """No recompute: the reused KV as it is, the tail prefilled over it. (logits, cache)"""
    cache = to_cache([(k.clone(), v.clone()) for k, v in reused], model.config)
    R = reused[0][0].shape[2]
    out = model(input_ids=torch.tensor([list(tokens)[R:]]), past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache


@torch.inference_mode()
def continuation_nll(model, logits: torch.Tensor, cache: DynamicCache, cont,
                     with_agreement: bool = False):
    """Mean negative log-likelihood of the tokens ``cont`` following the prompt whose last
    logits and cache are given; the cache is cropped back afterwards. ``with_agreement``:
    (nll, teacher-forced agreement: the share of positions whose argmax, given ``cont`` before
    it, is ``cont``'s token)."""
    n = cache.get_seq_length()
    ls = torch.log_softmax(logits.float(), -1)[None]
    if len(cont) > 1:
        out = model(input_ids=torch.tensor([list(cont[:-1])]), past_key_values=cache,
                    use_cache=True)
        ls = torch.cat((ls, torch.log_softmax(out.logits[0].float(), -1)))
    want = torch.tensor(list(cont))
    nll = float(-ls[torch.arange(len(want)), want].mean())
    if cache.get_seq_length() > n:
        cache.crop(n - cache.get_seq_length())      # negative: drop that many
    if with_agreement:
        return nll, float((ls.argmax(-1) == want).float().mean())
    return nll
