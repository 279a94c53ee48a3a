"""The inference node: the XDP fetch engine (fetch/) and the asyncio fallback client
(client), the node DRAM tier (node_tier), the connectors that put a serving engine's KV cache
in the pool (connectors/: vLLM, Hugging Face transformers, LMCache, SGLang), CacheBlend (blend,
blend_store) and the KV codecs (codec, codec_kernels; the calibrated transform codec pca:
codec_pca, codec_pca_kernels, codec_calibrate).
"""
