/* kvproto.h - the one definition of the KV block protocol (v1) wire format: the public part that
 * every endpoint speaks. The switch's private map layouts are in kvswitch.h. The XDP programs
 * include it; the Python side (package kvproto) reads the #define constants from this file and
 * the struct layout through BCC, so there is no hand-kept twin. docs/protocol.md explains every
 * field.
 *
 * Constants are plain `#define KV_<NAME> <integer>` lines so tools can read them; keep it that way.
 */
#ifndef KVPROTO_H
#define KVPROTO_H

#include <linux/types.h>

/* ---- wire format ------------------------------------------------------------------------- */
#define KV_UDP_PORT 19286          /* 0x4B56, "KV": servers listen here */
#define KV_MAGIC 19286             /* 0x4B56 */
#define KV_VERSION 1
#define KV_HDR_LEN 48              /* sizeof(struct kvhdr) */

/* ops */
#define KV_OP_GET 1                /* request one chunk; carries `len` zeroed bytes of room */
#define KV_OP_GET_REPLY 2          /* one chunk of payload */
#define KV_OP_PUT 3                /* store one chunk of a block */
#define KV_OP_PUT_ACK 4            /* chunk stored (status tells if the block is complete) */
#define KV_OP_NACK 5               /* the block or chunk is not there (status says why) */
#define KV_OP_ERROR 6              /* the request was refused (status says why) */

/* flags (bit set) */
#define KV_F_FROM_SWITCH 1         /* reply written by the switch's data plane */
#define KV_F_NO_CACHE 2            /* GET: do not serve from (and do not hold at) the switch */
#define KV_F_REPLICA 4             /* reply is a switch-made copy for a coalesced waiter */
#define KV_F_BLOCK_DONE 8          /* PUT_ACK: every chunk of the block is now stored */

/* status codes (0 in every successful message) */
#define KV_ST_OK 0
#define KV_ST_NOT_FOUND 1          /* NACK: no such block */
#define KV_ST_BAD_REQUEST 2        /* ERROR: malformed or inconsistent header */
#define KV_ST_NO_SPACE 3           /* ERROR: the pool node cannot hold the block */
#define KV_ST_CHECKSUM 4           /* ERROR: PUT payload does not match its checksum */
#define KV_ST_BAD_VERSION 5        /* ERROR: version not spoken here */
#define KV_ST_TOO_LARGE 6          /* ERROR: chunk larger than the node accepts */
#define KV_ST_INCOMPLETE 7         /* NACK: the block exists but not all chunks are stored */
#define KV_ST_UNAVAILABLE 8        /* ERROR: the pool node cannot reach its store right now */

/* All multi-byte fields are big-endian (network order). 48 bytes, naturally aligned. */
struct kvhdr {
    __be16 magic;                  /* KV_MAGIC */
    __u8   version;                /* KV_VERSION */
    __u8   op;                     /* KV_OP_* */
    __be16 flags;                  /* KV_F_* */
    __be16 status;                 /* KV_ST_* */
    __be32 ns;                     /* namespace (tenant / model version); part of every key */
    __be32 req_id;                 /* chosen by the requester, echoed in the reply */
    __u8   key[16];                /* 128-bit block key (chained prefix hash) */
    __be32 chunk;                  /* chunk index within the block */
    __be32 nchunks;                /* chunks in the block (0 in a GET: unknown to the asker) */
    __be16 len;                    /* payload bytes after the header (GET: bytes of room) */
    __be16 reserved;               /* must be 0 */
    __be32 csum;                   /* CRC-32 (IEEE) of the payload; 0 in a GET */
};

/* Largest payload the protocol allows: a 3520-byte MTU minus IPv4 (20), UDP (8) and kvhdr (48).
 * (Deployments on veth stop lower: this kernel refuses native XDP above a 3506-byte MTU.) */
#define KV_MAX_PAYLOAD 3444

/* ---- the chunk: the unit the switch caches and serves, one datagram's payload ---------- */
/* A deployment's chunk size is a multiple of KV_CHUNK_ALIGN (the switch and the fetch engine
 * move chunks in 8-byte words) from KV_CHUNK_ALIGN to KV_MAX_CHUNK: the largest one whose frame
 * fits the MTU native XDP takes on a veth (KV_VETH_MAX_MTU; a larger one needs multi-buffer
 * programs). Programs are compiled for it: -DKV_CHUNK=<bytes>. */
#define KV_DEFAULT_CHUNK 1024
#define KV_CHUNK_ALIGN 8
#define KV_VETH_MAX_MTU 3506
#define KV_MAX_CHUNK 3424          /* (KV_VETH_MAX_MTU + 14 - KV_PAYLOAD_OFF) rounded down to 8 */

/* Frame geometry of a KV datagram: untagged Ethernet, IPv4 without options, UDP (parse.h checks
 * these against the kernel's structs at compile time). */
#define KV_ETH_LEN 14
#define KV_IPV4_LEN 20
#define KV_UDP_LEN 8
#define KV_HDR_OFF 42              /* KV_ETH_LEN + KV_IPV4_LEN + KV_UDP_LEN */
#define KV_PAYLOAD_OFF 90          /* KV_HDR_OFF + KV_HDR_LEN: the per-chunk frame overhead */

#endif /* KVPROTO_H */

