"""CacheBlend on a Hugging Face Llama-style decoder: reuse the KV of passages that sit anywhere in
a prompt, not only at its start (issue #31; Yao et al., EuroSys'25).

It owns the compute side: moving a passage's KV, computed at positions 0.., to its positions in a
prompt (``rerotate``: keys are multiplied by the RoPE rotation of the offset, values are kept),
picking the tokens to recompute (``select``: largest KV deviation between the reused and the
freshly computed KV of a check layer) and the fused prefill (``blend_prefill``), which runs the
first layer over every token, the check layer's projections over every token, and every later
layer only over the selected tokens and the question, whose queries attend over the fused KV.
``hostagent.blend_store`` moves passages' KV through the pool (position-independent keys).

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
    """Keys [1, H, T, D] computed at positions 0..T-1, moved to offset..offset+T-1."""
    if offset == 0:
        return keys
    cos, sin = cos_sin(model, torch.tensor([offset]), keys.dtype)
    return _rope(keys, cos, sin)


def move(model, kv: KV, offset: int) -> KV:
    """A passage's KV (all layers) moved to ``offset``: keys re-rotated, values as they are."""
    return [(rerotate(model, k, offset), v) for k, v in kv]


def deviation(fresh_k, fresh_v, old_k, old_v) -> torch.Tensor:
    """Per token [T]: squared L2 distance of K and V summed over heads and dims."""
    return (((fresh_k - old_k) ** 2).sum(dim=(0, 1, 3)) +
            ((fresh_v - old_v) ** 2).sum(dim=(0, 1, 3)))


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
def passage_kv(model, tokens, position: int = 0) -> KV:
    """A passage's KV computed alone (no context) at positions ``position``..: what is stored."""
    ids = torch.tensor([list(tokens)])
    pos = torch.arange(position, position + ids.shape[1])[None]
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    return [(k.clone(), v.clone()) for k, v in cache_kv(cache)]


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


@torch.inference_mode()
def blend_prefill(model, tokens, reused: KV, candidates: torch.Tensor, ratio: float,
                  check_layer: int = 1) -> Blended:
    """The fused prefill of ``tokens``, whose first R positions have ``reused`` KV (every
    layer, already at their positions) and whose tail (R..) is computed fresh. Layers below
    ``check_layer`` run over every token; at ``check_layer`` the fresh K and V of every token are
    compared with the reused ones and ``ratio`` of the ``candidates`` (bool mask over the R
    reused positions) with the largest deviation are selected; from there on only the selected
    tokens and the tail run, their fresh KV replacing the reused KV in the fused cache."""
    inner = model.model
    ids = torch.tensor([list(tokens)])
    T, R = ids.shape[1], reused[0][0].shape[2]
    if not 0 <= R < T or candidates.shape != (R,):
        raise ValueError("reused KV must cover a proper prefix; candidates one flag per reused "
                         "position")
    if not 1 <= check_layer < len(inner.layers):
        raise ValueError("check_layer must be a layer after the first")
    h = inner.embed_tokens(ids)
    pos = torch.arange(T)
    cos, sin = cos_sin(model, pos, h.dtype)
    fused: KV = []
    idx = pos                                        # the tokens still running
    selected = torch.empty(0, dtype=torch.long)
    for li, layer in enumerate(inner.layers):
        x = layer.input_layernorm(h)
        q, k, v = _qkv(layer.self_attn, x, cos[:, :, idx], sin[:, :, idx])
        if li < check_layer:                       # every token, fresh
            fused.append((k, v))
            h = _attend(layer, h, q, k, v, idx, pos)
            continue
        if li == check_layer:                      # every token's fresh K/V is at hand here
            rk, rv = reused[li]
            dev = deviation(k[:, :, :R], v[:, :, :R], rk, rv)
            selected = select(dev, candidates, round(ratio * int(candidates.sum())))
            keep = torch.cat((selected, torch.arange(R, T)))
            q, k, v, h = q[:, :, keep], k[:, :, keep], v[:, :, keep], h[:, keep]
            idx = keep
        rk, rv = reused[li]
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
def continuation_nll(model, logits: torch.Tensor, cache: DynamicCache, cont) -> float:
    """Mean negative log-likelihood of the tokens ``cont`` following the prompt whose last
    logits and cache are given; the cache is cropped back afterwards."""
    n = cache.get_seq_length()
    lp = [torch.log_softmax(logits.float(), -1)[cont[0]]]
    if len(cont) > 1:
        out = model(input_ids=torch.tensor([list(cont[:-1])]), past_key_values=cache,
                    use_cache=True)
        ls = torch.log_softmax(out.logits[0].float(), -1)
        lp += [ls[i, t] for i, t in enumerate(cont[1:])]
    if cache.get_seq_length() > n:
        cache.crop(n - cache.get_seq_length())      # negative: drop that many
    return float(-torch.stack(lp).mean())
