"""Benchmarks, each a library function returning its result (JSON and plots written by the
caller's paths): the live-frames traffic generator and its XDP programs (generator,
trafficgen.c), switch throughput against the ceiling and real peers (throughput), incast
(incast), lossy links (loss) and sustained load (soak)."""
