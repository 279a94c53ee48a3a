/* kvserve.h - a pool node's XDP GET server's constants and structs (xdp/kvserve.c; the pool
 * node, in hostagent/pool/xdpserve.py, reads the constants with xdp.constants and views
 * kvs_slots through the ctypes layout BCC builds from struct kv_serve_slot). Constants are plain
 * `#define KV_<NAME> <integer>` lines so tools can read them. */
#ifndef KV_SERVE_H
#define KV_SERVE_H

#include "kvproto.h"

#ifndef KV_SERVE_SEG_SHIFT
#define KV_SERVE_SEG_SHIFT 22     /* log2 of a segment's bytes: 4 MiB (compile time) */
#endif
#ifndef KV_SERVE_SEGS
#define KV_SERVE_SEGS 4           /* segments in the arena (compile time) */
#endif
#ifndef KV_SERVE_SLOTS
#define KV_SERVE_SLOTS 4096       /* chunk slots (compile time) */
#endif
#ifndef KV_SERVE_BLOCKS
#define KV_SERVE_BLOCKS 1024      /* index entries (compile time) */
#endif
#define KV_SERVE_SEG (1 << KV_SERVE_SEG_SHIFT)
#define KV_SERVE_ADDRS 64         /* IPv4 addresses of this node GETs may be sent to */
#define KV_SERVE_SLOT_SIZE 56     /* sizeof(struct kv_serve_slot) */
#define KV_SERVE_BLOCK_SIZE 8     /* sizeof(struct kv_serve_block) */

/* per-CPU counters, indexes into kvs_stats */
#define KV_SERVE_STAT_PACKETS 0     /* frames seen */
#define KV_SERVE_STAT_HIT 1         /* GETs answered here */
#define KV_SERVE_STAT_HIT_BYTES 2   /* payload bytes sent with them */
#define KV_SERVE_STAT_PASSED 3      /* GETs for a block not in the index: passed to the server */
#define KV_SERVE_STAT_NO_ROOM 4     /* GETs whose room is smaller than the chunk: passed */
#define KV_SERVE_STAT_BAD_CHUNK 5   /* GETs past the block's last chunk: passed (the server
                                       answers BAD_REQUEST) */
#define KV_SERVE_STAT_REUSED 6      /* the slot was freed or rewritten: passed before the copy,
                                       dropped after it */
#define KV_SERVE_STAT_NOT_MINE 7    /* GETs to another address or a group address: passed */
#define KV_SERVE_STAT_BAD_UDP_CSUM 8  /* GETs whose UDP checksum the stack may drop (wrong, or
                                         the pseudo-header-only form: reply.h): passed, the stack
                                         decides */
#define KV_SERVE_STAT_OTHER_KV 9    /* other KV messages (PUT, ...): passed */
#define KV_SERVE_STAT_MALFORMED 10  /* KV port but invalid: passed */
#define KV_SERVE_STAT_NON_KV 11     /* not KV: passed */
#define KV_SERVE_STAT_FAILED 12     /* the reply could not be made (tail or copy failed) */
#define KV_SERVE_STAT_SEG_END 13    /* the chunk ends too near its segment's end: passed */
#define KV_SERVE_STAT_PORT_ZERO 14  /* GETs from UDP port 0, which no reply can reach: dropped */
#define KV_SERVE_STAT_MAX 16

struct kv_serve_seg {
    __u8 b[KV_SERVE_SEG];
};

struct kv_serve_slot {             /* per chunk of a staged block, written by Python (mmapped) */
    __u32 gen;                     /* generation of the staged block it belongs to; 0: none */
    __u32 ns;                      /* the chunk it describes: namespace (host order), */
    __u8  key[16];                 /* key (as on the wire) */
    __u32 chunk;                   /* and index */
    __u32 nchunks;                 /* chunks in its block */
    __u32 len;                     /* payload bytes, 1..KV_MAX_PAYLOAD */
    __u32 crc;                     /* their CRC-32 (the writer's, as on the wire) */
    __u64 off;                     /* where they are: byte offset in the arena */
    __u64 last_ns;                 /* chunk 0's slot: when a GET for it was last answered here */
};

struct kv_serve_key {              /* a block */
    __u32 ns;                      /* host order */
    __u8  key[16];                 /* as on the wire */
};

struct kv_serve_block {            /* where a block is; checked against kvs_slots, never trusted */
    __u32 first;                   /* slot of chunk 0 */
    __u32 nchunks;
};

_Static_assert(sizeof(struct kv_serve_slot) == KV_SERVE_SLOT_SIZE, "KV_SERVE_SLOT_SIZE");
_Static_assert(sizeof(struct kv_serve_block) == KV_SERVE_BLOCK_SIZE, "KV_SERVE_BLOCK_SIZE");
_Static_assert(KV_SERVE_SEG > 2 * KV_MAX_PAYLOAD, "a segment holds many chunks");

#endif /* KV_SERVE_H */
