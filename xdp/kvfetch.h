/* kvfetch.h - the fetch engine's constants and structs (xdp/kvfetch.c; the engine, in
 * hostagent/inference/fetch/program.py, reads the constants with xdp.constants and checks its numpy
 * views against the sizes stated here). Constants are plain `#define KV_<NAME> <integer>` lines so
 * tools can read them. */
#ifndef KV_FETCH_H
#define KV_FETCH_H

#include "kvproto.h"

#ifndef KV_CHUNK
#define KV_CHUNK KV_DEFAULT_CHUNK /* chunk payload bytes (kvproto.h): set at compile time */
#endif
#define KV_FETCH_SLOTS 16         /* arena slots as compiled; the engine sizes the maps itself */
#define KV_FETCH_XFERS 256        /* transfer table entries (the top 8 bits of a request id) */
#define KV_FETCH_ROUTES 64        /* destination headers (pool nodes) */
#define KV_FETCH_GEN_MASK 16777215   /* 24-bit generations; 0 is never used */
#define KV_FETCH_XFER_SIZE 64     /* sizeof(struct kv_fetch_xfer) */
#define KV_FETCH_CTL_SIZE 16      /* sizeof(struct kv_fetch_ctl) */

/* kv_fetch_xfer.status bits (set by this program, cleared by the driver) */
#define KV_FETCH_XS_NACK 1        /* a NACK answered one of its GETs (err: the status code) */
#define KV_FETCH_XS_ERROR 2       /* an ERROR answered one of its GETs (err: the status code) */
#define KV_FETCH_XS_NCHUNKS 4     /* a reply said the block has another number of chunks */

/* per-CPU counters, indexes into kvf_stats */
#define KV_FETCH_STAT_ACCEPTED 0     /* chunks written into the arena */
#define KV_FETCH_STAT_DUPLICATE 1    /* reply for a chunk already held: dropped, not rewritten */
#define KV_FETCH_STAT_STALE 2        /* reply to the engine's port for no active transfer/gen. */
#define KV_FETCH_STAT_WRONG_BLOCK 3  /* right request id, other namespace or key */
#define KV_FETCH_STAT_BAD_CHUNK 4    /* chunk index or chunk count not the transfer's */
#define KV_FETCH_STAT_BAD_LEN 5      /* payload length not the chunk's */
#define KV_FETCH_STAT_MALFORMED 6    /* to the engine's port but not a valid KV message */
#define KV_FETCH_STAT_NACK 7         /* NACK or ERROR for an active transfer */
#define KV_FETCH_STAT_OTHER_OP 8     /* another op, or a GET_REPLY with a status */
#define KV_FETCH_STAT_PASSED 9       /* frames not for the engine, passed */
#define KV_FETCH_STAT_LOSS 10        /* KV frames dropped by the test loss stand-in (loss_ppm) */
#define KV_FETCH_STAT_LOAD_FAIL 11   /* bpf_xdp_load_bytes failed, or no slot */
#define KV_FETCH_STAT_WRONG_SOURCE 12 /* a reply not from the MAC, IP and port the GET went to */
#define KV_FETCH_STAT_MAX 13

/* Offsets in a route's header (Ethernet, IPv4, UDP of the GETs it sends) */
#define KV_FETCH_R_DMAC 0         /* the pool node's (or its gateway's) MAC */
#define KV_FETCH_R_SMAC 6         /* the engine's MAC */
#define KV_FETCH_R_SADDR 26       /* the engine's IPv4 address */
#define KV_FETCH_R_DADDR 30       /* the pool node's IPv4 address */
#define KV_FETCH_R_DPORT 36       /* the pool node's UDP port */

struct kv_fetch_slot {
    __u8 b[KV_CHUNK];
};

struct kv_fetch_xfer {            /* one active transfer; 64 bytes */
    __u32 gen;                    /* 0: inactive. Written last by the driver when it activates */
    __u32 ns;
    __u8  key[16];
    __u32 nchunks;                /* 0: unknown (only chunk 0 is accepted, its count recorded) */
    __u32 base;                   /* first arena slot */
    __u32 nslots;                 /* slots reserved: chunk < nslots */
    __u32 route;                  /* bits 0-15: kvf_routes index of the pool node asked;
                                     16-31: GET flags every GET of the transfer carries (the
                                     engine's sender reads them) */
    __u32 status;                 /* KV_FETCH_XS_* */
    __u32 err;                    /* KV status of the last NACK/ERROR */
    __u32 received;               /* chunks written (duplicates racing on two CPUs may add 2) */
    __u32 tail_len;               /* payload bytes of the block's last chunk, once received */
    __u32 seen_nchunks;           /* chunk count carried by the replies */
    __u32 bad;                    /* replies for this transfer dropped as inconsistent */
};

struct kv_fetch_ctl {
    __u32 port;                   /* the engine's UDP port, network byte order in the low 16 */
    __u32 loss_ppm;               /* testbed only: drop this share of received KV frames */
    __u32 owner;                  /* pid of the process driving it (another engine leaves it) */
    __u32 reserved;
};

struct kv_fetch_route {
    __u8 hdr[KV_HDR_OFF];         /* Ethernet, IPv4 (checksum set), UDP (checksum 0) */
    __u8 pad[6];
};

_Static_assert(sizeof(struct kv_fetch_xfer) == KV_FETCH_XFER_SIZE, "transfer entry size");
_Static_assert(sizeof(struct kv_fetch_ctl) == KV_FETCH_CTL_SIZE, "control block size");

#endif /* KV_FETCH_H */
