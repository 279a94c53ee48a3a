"""What reusing KV does to a real model (SmolLM2-135M on real text): the KV codecs' ratio,
perplexity, agreement, speed and load from the switch (compress), and CacheBlend's reuse of
passages' KV at any position (blend)."""
