"""`testbed bench lmcache`: kvswitch as LMCache's remote tier beside LMCache's server, Redis and
Mooncake Store (lmcache_bench; each inference node's engine: lmcache_node)."""
