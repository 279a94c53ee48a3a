/* kvmaps.h - the switch's BPF maps (layouts in kvswitch.h). Compiled with -DKV_PIN_DIR="..."
 * every map is pinned there, so a restarted switchd (or `switchd stats`) finds the same maps;
 * without it (unit tests) the maps are private to the loaded object. */
#ifndef KVMAPS_H
#define KVMAPS_H

#include "kvswitch.h"

#ifdef KV_PIN_DIR
#define KV_MAP(type, k, v, name, n) BPF_TABLE_PINNED(type, k, v, name, n, KV_PIN_DIR "/" #name)
#define KV_FMAP(type, k, v, name, n, f) \
    BPF_TABLE_PINNED(type, k, v, name, n, KV_PIN_DIR "/" #name, f)
#else
#define KV_MAP(type, k, v, name, n) BPF_TABLE(type, k, v, name, n)
#define KV_FMAP(type, k, v, name, n, f) BPF_F_TABLE(type, k, v, name, n, f)
#endif

/* chunk cache: slots written in place under kvslot.h's protocol, mmapped by switchd to read */
KV_FMAP("array", __u32, struct kv_cache_val, kv_cache, KV_CACHE_ENTRIES, BPF_F_MMAPABLE);
/* where each cached block's slots are: (ns, key) -> base, nchunks, gen; switchd evicts a block
 * by deleting its entry (its slots are then no block's: never served, reused by a later one) */
KV_FMAP("hash", struct kv_block_key, struct kv_block, kv_blocks, KV_BLOCK_ENTRIES,
        BPF_F_NO_PREALLOC);
/* admit set: blocks whose passing pool replies are copied into kv_cache */
KV_MAP("hash", struct kv_block_key, struct kv_admit_val, kv_admit, KV_ADMIT_ENTRIES);
/* port roles by ifindex; a port without an entry is an inference-node port */
KV_MAP("hash", __u32, struct kv_port_cfg, kv_ports, KV_PORT_ENTRIES);
/* ports known to have no checks, by ifindex (kvswitch.h, KV_PORT_CLEAR_SLOTS) */
KV_MAP("array", __u32, __u32, kv_port_clear, KV_PORT_CLEAR_SLOTS);
/* port security: which port owns a bound source (kvswitch.h, KV_SRC_ENTRIES) */
KV_MAP("hash", __u64, __u32, kv_src_macs, KV_SRC_ENTRIES);
KV_MAP("hash", __be32, __u32, kv_src_ips, KV_SRC_ENTRIES);
/* namespaces a limited port may ask for (KV_PF_NS_LIMITED) */
KV_MAP("hash", struct kv_port_ns_key, __u32, kv_port_ns, KV_PORT_ENTRIES * 16);
/* miss coalescing: rounds in flight and who waits on each port (LRU: stale entries age out) */
KV_MAP("lru_hash", struct kv_cache_key, struct kv_pending, kv_pending, KV_PENDING_ENTRIES);
KV_MAP("lru_hash", struct kv_waiter_key, struct kv_waiter, kv_waiters, KV_WAITER_ENTRIES);
/* popularity: count-min sketch of misses, the blocks recently missed, per-namespace counters */
KV_MAP("percpu_array", __u32, struct kv_sketch_row, kv_sketch, KV_SKETCH_DEPTH);
KV_MAP("lru_hash", struct kv_block_key, struct kv_recent, kv_recent, KV_RECENT_ENTRIES);
KV_MAP("percpu_array", __u32, struct kv_ns_stats, kv_ns_low, KV_NS_LOW);
KV_MAP("percpu_hash", __u32, struct kv_ns_stats, kv_ns_stats, KV_NS_ENTRIES);
/* settings, KV_SET_* */
KV_MAP("array", __u32, __u64, kv_settings, KV_SET_MAX);
/* per-CPU counters, KV_STAT_* */
KV_MAP("percpu_array", __u32, __u64, kv_stats, KV_STAT_MAX);

#endif /* KVMAPS_H */
