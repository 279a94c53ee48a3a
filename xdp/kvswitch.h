/* kvswitch.h - the switch's private BPF map layouts and constants (its data plane and switchd
 * share them; no endpoint needs them). The wire format is in kvproto.h. Constants are plain
 * `#define KV_<NAME> <integer>` lines, read by switchd through the xdp package. */
#ifndef KVSWITCH_H
#define KVSWITCH_H

#include "kvproto.h"

/* ---- cache entries -------------------------------------------------------------------- */
/* Chunk payload a cache entry holds: the deployment's chunk size (kvproto.h), set at compile
 * time with -DKV_CHUNK. */
#ifndef KV_CHUNK
#define KV_CHUNK KV_DEFAULT_CHUNK
#endif
#ifndef KV_CACHE_ENTRIES
#define KV_CACHE_ENTRIES 65536
#endif
#define KV_CRC_SLICES 16           /* kv_crc_table: CRC-32 tables, 256 entries each */
#define KV_ADMIT_ENTRIES 65536
#define KV_PORT_ENTRIES 256
#define KV_PORT_NS_INLINE 8        /* namespaces a port's config holds itself */
/* kv_port_clear[ifindex] (ifindexes below KV_PORT_CLEAR_SLOTS): 1 says the port has no checks
 * (neither KV_PF_SECURED nor KV_PF_NS_LIMITED), sparing its frames the kv_ports lookup (~12 % of
 * a hit, docs/throughput.md). 0, the default, says nothing: look the port up. switchd clears a
 * port's slot before giving it checks and sets it only after taking them away, so a stale or
 * missing slot costs a lookup, never a check. */
#define KV_PORT_CLEAR_SLOTS 4096

struct kv_block_key {              /* a block: key of the admit set */
    __u32 ns;                      /* host order */
    __u8  key[16];                 /* as on the wire */
};

struct kv_cache_key {              /* a chunk: key of the cache */
    __u32 ns;                      /* host order */
    __u32 chunk;                   /* host order */
    __u8  key[16];                 /* as on the wire */
};

/* The cache is an array of chunk slots (kv_cache) indexed through a small hash of blocks
 * (kv_blocks): chunk i of a block is slot base + i. A slot is written in place, under the slot
 * protocol of kvslot.h (seq), by the data plane's fill path and by switchd's writer program
 * (kvwrite.c) only; it is served only if it was written for the block's current allocation
 * (gen) and names the very chunk asked for (owner). */
struct kv_cache_val {
    __u64 seq;                     /* kvslot.h: odd while a writer holds the slot (64 bits: the
                                      compare-and-swap BCC's instruction set has) */
    __u32 gen;                     /* kv_block.gen of the allocation it was written for; 0: none */
    __u16 len;                     /* payload bytes held, 1..KV_CHUNK (0: empty) */
    __u16 flags;                   /* KV_CF_* */
    __u32 csum;                    /* CRC-32 of data[0..len), as carried on the wire */
    __u32 nchunks;                 /* chunks in the block */
    __u64 hits;                    /* GETs answered from this slot (data plane adds) */
    __u64 filled_ns;               /* bpf_ktime_get_ns() when it was learned (0: put) */
    /* The chunk this slot was written for, checked by the hit path (with gen and seq) before it
     * copies the payload: an index entry only says where to look. */
    struct kv_cache_key owner;
    __u8  data[KV_CHUNK];
};
#define KV_CACHE_VAL_HEADER 64     /* bytes of kv_cache_val before data[] */

struct kv_block {                  /* kv_blocks value: where a block's slots are */
    __u32 base;                    /* slot of chunk 0 */
    __u32 nchunks;                 /* chunks in the block */
    __u32 gen;                     /* unique per allocation: switchd's below KV_GEN_DATAPLANE, the
                                      data plane's (carved from the fill region) above */
    __u32 slots;                   /* chunks 0..slots-1 have slots base..base+slots-1: all of
                                      them, or a prefix the data plane carved from what was left */
};
#define KV_GEN_DATAPLANE 0x80000000
/* Blocks the index holds: as many as slots (a block has at least one chunk). */
#define KV_BLOCK_ENTRIES KV_CACHE_ENTRIES

/* What switchd's writer program (kvwrite.c) is run on with BPF_PROG_TEST_RUN: the slot, the
 * header it gets (seq ignored), then len payload bytes. len 0 empties the slot. */
struct kv_write_cmd {
    __u32 slot;
    __u32 reserved;
    struct kv_cache_val val;       /* only its first KV_CACHE_VAL_HEADER bytes are in the frame */
};
#define KV_WRITE_HEADER 72         /* bytes of a write command before the payload */
#define KV_WRITE_DONE 2            /* verdicts: written (XDP_PASS), */
#define KV_WRITE_BUSY 1            /* another writer holds the slot (XDP_DROP): try again, */
#define KV_WRITE_BAD 0             /* bad command (XDP_ABORTED) */
#define KV_CF_FILLED 1             /* learned from a passing pool reply (else put by switchd) */
#define KV_CF_SPECULATIVE 2        /* filled for a block not (yet) admitted: switchd decides */
#define KV_CF_UNCHECKED 4          /* learned, its CRC not checked yet: the first hit checks it
                                      (and empties the slot if it fails), never a reader */

struct kv_admit_val {              /* admit set: replies for these blocks are cached as they pass */
    __u64 expires_ns;              /* 0: until removed */
    __u32 flags;
    __u32 reserved;
};

#define KV_ROLE_HOST 0             /* inference node port: its replies are never learned */
#define KV_ROLE_POOL 1             /* pool (storage) node port: its replies may fill the cache */
struct kv_port_cfg {
    __u32  role;                   /* KV_ROLE_* */
    __u32  reserved0;
    __u64  flags;                  /* KV_PF_* (64 bits: the data plane binds atomically) */
    __u8   mac[6];                 /* KV_PF_SECURED: the one source the port's frames may carry, */
    __u16  reserved;               /* Ethernet source and ARP sender hardware address ... */
    __be32 ip;                     /* ... IPv4 source and ARP sender address (once KV_PF_BOUND) */
    __u32  nns;                    /* KV_PF_NS_LIMITED: how many of ns[] hold its namespaces; more
                                      than KV_PORT_NS_INLINE: look them up in kv_port_ns */
    __u32  ns[KV_PORT_NS_INLINE];  /* its namespaces, checked without a map lookup */
};
#define KV_PF_NS_LIMITED 1         /* only namespaces in kv_port_ns may be asked for here; and only
                                      frames the data plane can check pass (see kvswitch_ports.c) */
#define KV_PF_SECURED 2            /* frames must come from the port's bound source */
#define KV_PF_BOUND 4              /* mac and ip are set: by switchd, or by the data plane from the
                                      port's first ARP or IPv4 frame (sticky) */
#define KV_PF_BINDING 8            /* the data plane is binding it on some CPU (transient) */
#define KV_PF_TRUNK 16             /* a link to another switch, carrying many nodes' frames: an
                                      uplink (pool role) also carries replies another switch
                                      made from its cache (KV_F_FROM_SWITCH), which answer this
                                      switch's rounds as a pool node's replies do */
#define KV_PF_SOURCES 32           /* a trunk that owns the sources it carries: each source (MAC,
                                      IPv4) first seen on it becomes its own (kv_src_macs,
                                      kv_src_ips), and a frame whose source another port owns is
                                      dropped; switchd writes those behind an uplink beforehand */

/* Who owns a source: kv_src_macs (MAC in the low 6 bytes of a u64, as in memory) and kv_src_ips
 * (IPv4, network order) map a source to the ifindex of the one port it belongs to: a secured
 * port's bound source, or one of the many a trunk carries (KV_PF_SOURCES). A port never learns,
 * nor sends from, a source another port owns; switchd writes a pool port's, every --port-bind
 * source and the pool nodes behind an uplink before attaching, the data plane a learned one as
 * it binds a port or first sees it on a trunk. */
#define KV_SRC_ENTRIES 65536

struct kv_port_ns_key {            /* per-port namespace allow-list */
    __u32 ifindex;
    __u32 ns;
};

/* ---- miss coalescing (incast relief) ---- */
#define KV_PENDING_ENTRIES 65536
#define KV_WAITER_ENTRIES 262144
#define KV_DEVMAP_SLOTS 64         /* switch ports a reply can be replicated to */

struct kv_waiter {                 /* where a replica for this port goes */
    __u64 gen;                     /* kv_pending.gen of the round it joined */
    __u8  mac[6];
    __be16 port;                   /* UDP source port of the GET */
    __be32 ip;                     /* IPv4 source of the GET */
    __be32 req_id;                 /* the asker's latest request id */
    __u32 coalesced;               /* 1: held here (its reply is a KV_F_REPLICA copy) */
    __u32 reserved;
};

struct kv_pending {                /* a chunk whose GET went upstream and whose reply is awaited */
    __u64 gen;                     /* bpf_ktime_get_ns() when the upstream GET passed */
    __u32 waiters;                 /* ports waiting (the first asker included) */
    __u32 first_ifindex;           /* port of the first asker */
    __be32 daddr;                  /* where the upstream GET went: only GETs to the same pool */
    __be16 dport;                  /* address (IP, UDP port, MAC) may wait in this round */
    __u8  dmac[6];
    __u16 flags;                   /* KV_RF_* */
    __u64 sent;                    /* when its latest upstream GET passed (gen: when it opened) */
    struct kv_waiter first;        /* the first asker, kept here until a second port waits too
                                      (KV_RF_SHARED): a lone reader's round writes no waiter */
};
#define KV_RF_PROBATION 1          /* a round that expired was asked for again: nobody more is
                                      held for this chunk until a reply for it passes (a requester
                                      re-arming a round nobody answers cannot hold others
                                      beyond one round timeout); those already held stay held
                                      and get that reply */
#define KV_RF_SHARED 2             /* the first asker is in kv_waiters too (another port joined) */
#define KV_ROUND_SAMPLE 16         /* a lone round samples the round time one chunk in this many */

struct kv_waiter_key {
    struct kv_cache_key chunk;
    __u32 ifindex;                 /* switch port the GET came in on */
};

struct kv_devport {                /* devmap value: BCC's layout for an egress program */
    __u32 ifindex;
    int prog_fd;
};

/* ---- popularity (read and reset by switchd every interval) ---- */
/* A count-min sketch of GET misses per block (counted on chunk 0, which every fetch asks for):
 * KV_SKETCH_DEPTH rows of KV_SKETCH_WIDTH u32 counters, per CPU. Row r's column for block
 * (ns, key) is ((A_r * x + B_r) mod 2^64) >> (64 - KV_SKETCH_BITS) where
 * x = lo64(key) ^ (hi64(key) * KV_SKETCH_HI_MUL) ^ (ns * KV_SKETCH_NS_MUL) mod 2^64, the key's
 * halves read little-endian. */
#define KV_SKETCH_DEPTH 4
#define KV_SKETCH_BITS 12
#define KV_SKETCH_WIDTH 4096
#define KV_SKETCH_HI_MUL 0xC2B2AE3D27D4EB4F
#define KV_SKETCH_NS_MUL 0x9E3779B97F4A7C15
#define KV_SKETCH_A0 0xD6E8FEB86659FD93
#define KV_SKETCH_A1 0xA0761D6478BD642F
#define KV_SKETCH_A2 0xE7037ED1A0B428DB
#define KV_SKETCH_A3 0x8EBC6AF09C88C6E3
#define KV_SKETCH_B0 0x589965CC75374CC3
#define KV_SKETCH_B1 0x1D8E4E27C47D124F
#define KV_SKETCH_B2 0x2545F4914F6CDD1D
#define KV_SKETCH_B3 0x9FB21C651E98DF25
struct kv_sketch_row {
    __u32 c[KV_SKETCH_WIDTH];
};
/* blocks recently missed: the candidates switchd asks the sketch about */
#define KV_RECENT_ENTRIES 65536
struct kv_recent {
    __u64 last_ns;                 /* last miss */
    __u32 nchunks;                 /* block size, from the first pool reply seen (0: unknown) */
    __u32 reserved;
};

/* per-namespace counters (per CPU): namespaces below KV_NS_LOW in an array (no hashing on the
 * hit path), the others in a hash of KV_NS_ENTRIES */
#define KV_NS_LOW 256
#define KV_NS_ENTRIES 1024
struct kv_ns_stats {
    __u64 hits;
    __u64 misses;
    __u64 hit_bytes;
};

/* admit-set flags */
#define KV_AF_PINNED 1             /* pinned by an operator: switchd never evicts it before expiry */

/* settings (u64 array, written by switchd) */
#define KV_SET_COALESCE 0          /* 1: hold concurrent misses and replicate the reply */
#define KV_SET_PENDING_NS 1        /* a pending round older than this is retried upstream */
#define KV_SET_PORT_CHECKS 3       /* 1: some port has checks (KV_PF_NS_LIMITED, KV_PF_SECURED) */
#define KV_SET_SPEC_FILL 2         /* chunks of blocks not admitted that may still be learned
                                      (s64, decremented per fill; switchd refills it each step) */
#define KV_SET_ROUND_SRTT_NS 4     /* written by the data plane: smoothed time from a round's
                                      upstream GET to its reply (RFC 6298's SRTT, rounds never
                                      retried only) */
#define KV_SET_ROUND_VAR_NS 5      /* written by the data plane: its mean deviation (RTTVAR) */
#define KV_SET_FILL_NEXT 6         /* the fill region switchd grants the data plane: slots */
#define KV_SET_FILL_END 7          /* [next, end) for blocks with no slots yet (carve) */
#define KV_SET_DP_GEN 8            /* the data plane's allocation counter (KV_GEN_DATAPLANE | n) */
#define KV_SET_GEN 9               /* switchd's allocation counter (under its allocator's lock) */
#define KV_SET_SHARE_N 10         /* > 1: blocks not admitted are learned only if their key's
                                      first 8 bytes (little-endian) mod N are KV_SET_SHARE_K: the
                                      switch's share of the hot set in a split placement */
#define KV_SET_SHARE_K 11
#define KV_SET_MAX 12
#define KV_ROUND_CAP 8             /* a round times out after max(pending, SRTT + 4 RTTVAR), at
                                      most this many pending timeouts: a reply queued behind a
                                      shaped link's backlog is late, not lost */

/* per-CPU counters, indexes into kv_stats */
#define KV_STAT_PACKETS 0          /* frames seen */
#define KV_STAT_NON_KV 1           /* not KV protocol: passed untouched */
#define KV_STAT_MALFORMED 2        /* KV port but invalid: passed untouched, never answered */
#define KV_STAT_GET_HIT 3          /* GET answered by the switch */
#define KV_STAT_GET_MISS 4         /* GET forwarded to the pool node */
#define KV_STAT_HIT_BYTES 5        /* payload bytes served by the switch */
#define KV_STAT_FILL 6             /* chunks learned from passing replies */
#define KV_STAT_FILL_FAIL 7        /* admitted reply that could not be stored (no slot for it:
                                      fill region used up; its slot being written) */
#define KV_STAT_NO_ROOM 8          /* hit whose request carried too little room: forwarded */
#define KV_STAT_OTHER_KV 9         /* other KV messages (PUT, ACK, ...) forwarded */
#define KV_STAT_FORGED 10          /* no longer counted: replies from non-pool ports are dropped
                                      (KV_STAT_NOT_FROM_POOL) */
#define KV_STAT_XDP_ABORTED 11     /* verdict counters: KV_STAT_XDP_ABORTED + XDP_* verdict */
#define KV_STAT_XDP_DROP 12
#define KV_STAT_XDP_PASS 13
#define KV_STAT_XDP_TX 14
#define KV_STAT_XDP_REDIRECT 15
#define KV_STAT_COALESCED 16       /* GETs held because the same chunk was already asked for */
#define KV_STAT_REPLICATED 17      /* replies broadcast to several waiting ports */
#define KV_STAT_REPLICAS 18        /* copies delivered by the egress program */
#define KV_STAT_REPLICA_SKIP 19    /* broadcast copies dropped at ports with no waiter */
#define KV_STAT_EXPIRED 20         /* pending rounds found stale and retried upstream */
#define KV_STAT_UNCOALESCED 21     /* GETs not held: a second asker on a port already waiting */
#define KV_STAT_FILL_CORRUPT 22    /* learned payload that failed its CRC at its first hit:
                                      emptied, never served */
#define KV_STAT_DENIED 23          /* request for a namespace its port may not use: dropped */
#define KV_STAT_UNSOLICITED 24     /* pool reply matching no outstanding request: never learned */
#define KV_STAT_SPEC_FILL 25       /* of KV_STAT_FILL: chunks learned speculatively */
#define KV_STAT_REUSED 26          /* a looked-up slot was being written (kvslot.h) or holds
                                      another chunk of the same allocation: the GET was handled
                                      as a miss, or, if it was written while its payload was
                                      copied, the half-made reply dropped */
#define KV_STAT_SPOOFED 27         /* frame from a secured port with another source: dropped */
#define KV_STAT_UNCHECKED 28       /* frame from a limited port the data plane cannot fully check
                                      (VLAN tag, IP options or fragment, IPv6 extension header,
                                      invalid KV, other protocol): dropped */
#define KV_STAT_BAD_UDP_CSUM 29    /* GET whose UDP checksum fails (the pseudo-header-only form
                                      included, see reply.h): never held nor answered, forwarded */
#define KV_STAT_OTHER_DEST 30      /* GET for a chunk whose open round went to another address:
                                      forwarded, not held */
#define KV_STAT_SRC_LEARNED 31     /* a secured port learned its source from its first frame */
#define KV_STAT_NOT_FROM_POOL 32   /* reply (GET_REPLY, PUT_ACK, NACK, ERROR, or anything from UDP
                                      port KV_UDP_PORT) on a port that is not a pool port: dropped */
#define KV_STAT_SRC_TAKEN 33       /* frame on a secured port carrying a source (MAC or IPv4) bound
                                      to another port: dropped, never learned (also in spoofed) */
#define KV_STAT_PORT_ZERO 34       /* GET from UDP port 0 (nobody can be answered there): dropped */
#define KV_STAT_UNHELD 35          /* GET for a chunk whose round expired unanswered: forwarded,
                                      not held (KV_RF_PROBATION) */
#define KV_STAT_REASKED 36         /* a waiting port's GET again, after the round's reply was due:
                                      forwarded upstream (its GET or the reply may be lost); the
                                      round's timers are not touched */
#define KV_STAT_NACK_CLOSED 37     /* NACK from a pool port closing an open round: its waiters get
                                      it too (replicated like a reply, never learned) */
#define KV_STAT_GROUP_DEST 38      /* GET to a group (broadcast/multicast) MAC: never answered nor
                                      held here (a reply needs the pool node's own MAC): forwarded */
#define KV_STAT_SRC_OWNED 39       /* a source first seen on a trunk that owns its sources
                                      (KV_PF_SOURCES) became that trunk's */
#define KV_STAT_MAX 40

#endif /* KVSWITCH_H */
