/* kvfetch_maps.h - the fetch engine's BPF maps (layouts in kvfetch.h). The engine creates its
 * own maps of these definitions at load time (xdp.loader's bytecode cache): the sizes compiled
 * here are placeholders for kvf_arena and kvf_meta. Declarations only: BCC rewrites map accesses
 * (name.lookup()) in the main file, not in headers. */
#ifndef KV_FETCH_MAPS_H
#define KV_FETCH_MAPS_H

#include "kvfetch.h"

BPF_F_TABLE("array", u32, struct kv_fetch_slot, kvf_arena, KV_FETCH_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, u64, kvf_meta, KV_FETCH_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct kv_fetch_xfer, kvf_xfers, KV_FETCH_XFERS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct kv_fetch_ctl, kvf_ctl, 1, BPF_F_MMAPABLE);
BPF_ARRAY(kvf_routes, struct kv_fetch_route, KV_FETCH_ROUTES);
BPF_PERCPU_ARRAY(kvf_stats, u64, KV_FETCH_STAT_MAX);

#endif /* KV_FETCH_MAPS_H */
