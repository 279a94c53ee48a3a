/* kvserve_maps.h - a pool node's XDP GET server's BPF maps (layouts in kvserve.h); their sizes
 * are compiled in (hostagent/pool/xdpserve.py sets KV_SERVE_SEGS, _SLOTS and _BLOCKS for the
 * arena). Declarations only: BCC rewrites map accesses (name.lookup()) in the main file, not in
 * headers. */
#ifndef KV_SERVE_MAPS_H
#define KV_SERVE_MAPS_H

#include "kvserve.h"

BPF_F_TABLE("array", __u32, struct kv_serve_seg, kvs_arena, KV_SERVE_SEGS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", __u32, struct kv_serve_slot, kvs_slots, KV_SERVE_SLOTS, BPF_F_MMAPABLE);
BPF_HASH(kvs_index, struct kv_serve_key, struct kv_serve_block, KV_SERVE_BLOCKS);
BPF_HASH(kvs_addrs, __be32, __u32, KV_SERVE_ADDRS);
BPF_PERCPU_ARRAY(kvs_stats, __u64, KV_SERVE_STAT_MAX);

#endif /* KV_SERVE_MAPS_H */
