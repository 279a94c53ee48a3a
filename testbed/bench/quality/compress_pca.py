"""What `testbed bench compress` needs for the calibrated ``pca`` codec
(``hostagent.inference.codec_pca``): its calibration for the model (made once, on the license
texts the quality windows never use) and the entropy of its codes."""
from __future__ import annotations


def uses_pca(codecs) -> bool:
    from hostagent.inference.codec import parse
    return any(parse(c)[0] == "pca" for c in codecs)


def ensure_calibration(model, tok, log=print) -> str:
    """The path of the pca calibration for ``model``'s layout in the calibration directory,
    computed first if there is none (``hostagent codec calibrate``'s work, on
    ``codec_pca.CALIBRATION_TEXTS``; a few minutes on one core)."""
    from hostagent.inference import codec_calibrate, codec_pca
    from hostagent.inference.codec import UnknownCodec
    from testbed.demos.realmodel import convert
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        return codec_pca.find_calibration(None, cfg.num_hidden_layers, heads, dim).path
    except UnknownCodec as exc:
        if not str(exc).startswith("no pca calibration"):
            raise
    name = convert()[0].name
    log(f"bench compress: calibrating the pca codec for {name} on "
        f"{', '.join(codec_pca.CALIBRATION_TEXTS)} ...")
    data = codec_calibrate.calibrate(model, codec_calibrate.license_sequences(tok), name,
                                     log=log)
    path = codec_calibrate.write(data, name)
    log(f"bench compress: pca calibration {path}")
    return str(path)


def pca_entropy(codec, block_kv) -> dict:
    """Empirical entropy of the pca codec's codes, per component over the blocks of
    ``block_kv`` [n, L, 2, H, T, D] (block i at position i * T) but the first (its own
    allocation): how much an ideal entropy coder would take off the fixed-rate streams."""
    import numpy as np
    from hostagent.inference import codec_pca
    T = codec.block_tokens
    counts: dict = {}
    bits_total = 0
    plan = codec.plan
    for i, block in enumerate(block_kv[1:], 1):
        coded = np.frombuffer(codec.encode(block, i * T), np.uint8)
        bits = np.unpackbits(coded[codec_pca.HEADER:], bitorder="little")
        p = 0
        for g, j in zip(*np.nonzero(plan.bits)):
            b = int(plan.bits[g, j])
            codes = bits[p:p + T * b].reshape(T, b) @ (1 << np.arange(b))
            counts.setdefault((g, j), np.zeros(1 << b))[:] += np.bincount(codes, minlength=1 << b)
            p += T * b
            bits_total += T * b
    entropy = 0.0
    for c in counts.values():
        q = c[c > 0] / c.sum()
        entropy += float(-(q * np.log2(q)).sum()) * c.sum()
    saved = float(entropy / bits_total)
    return {"bits_per_value": round(bits_total / ((len(block_kv) - 1) * codec.values), 4),
            "entropy_over_bits": round(saved, 4),
            "ratio_if_entropy_coded": round(codec.ratio / saved, 3)}
