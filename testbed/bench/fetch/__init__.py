"""The data path's benchmarks: the live-frames traffic generator and its XDP programs
(generator, trafficgen.c), GET replies/s against the ceiling and real peers (throughput), whole
blocks at a node (fetch, with fetch_lone, fetch_mooncake and fetch_auth), N readers of one block
(incast) and links that drop KV frames (loss)."""
