"""The inference node: the XDP fetch engine (fetch/) and the asyncio fallback client
(client), the node DRAM tier (node_tier), the connectors that put a model's KV cache in
the pool (hf_connector for Hugging Face transformers, vllm_connector* for vLLM),
CacheBlend (blend, blend_store) and the KV codecs (codec, codec_kernels).
"""
