"""Benchmarks, one package per experiment, each a library function returning its result (JSON
and plots written to the caller's paths):

  serve     serving loops on N nodes over shaped links: bench serve, its --tiers and --racks
            variants, and vLLM's own server (bench vllm)
  faults    one fault at a time while serving (bench faults), sustained load (soak, soak --faults)
  fetch     the data path: the traffic generator and its XDP programs, GET throughput, whole-block
            fetches, incast, lossy links
  stores    kvswitch as LMCache's remote tier beside the stores LMCache users pick today
  quality   what reusing KV does to a real model: the KV codecs (compress), CacheBlend (blend)
  validate  the cluster model and the policy evaluator checked against the live testbed"""
