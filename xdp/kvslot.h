/* kvslot.h - the slot protocol of the switch's cache (kv_cache: an array of struct kv_cache_val,
 * written in place). Every writer - the data plane filling a slot from a passing pool reply on
 * any CPU (kvswitch.c) and switchd putting or emptying one (its writer program, kvwrite.c, run
 * with BPF_PROG_TEST_RUN: Python never writes a slot itself) - goes through these functions;
 * readers (the hit path) check with them. A seqlock whose writers also exclude each other:
 *
 *  writer: claim  - seq even -> odd with one compare-and-swap; if seq is odd or the swap
 *                   loses, another writer holds the slot: give up (the fill is not learned,
 *                   switchd retries);
 *          write  - header and payload, in place;
 *          release- seq odd -> even (an atomic add: a locked instruction, so everything written
 *                   before it is visible before the new seq is).
 *  reader: q = seq; check q is even and the slot holds the chunk asked for (gen, owner, len);
 *          copy the payload; serve only if seq is still q. A slot read while it is written
 *          (odd, or changed across the copy) is a miss before the copy and a dropped reply
 *          after it (the asker retransmits): never torn bytes, never another chunk's.
 *
 * seq only grows (by 2 per write), so a reader can never see the same value around a write.
 * Loads are ordered as x86-64 orders them (TSO: loads are not reordered with loads, stores not
 * with stores); the compiler barriers keep clang from moving or caching the reads of seq. Map
 * lookups stay in the programs' own files (BCC rewrites map calls in the main file only). */
#ifndef KVSLOT_H
#define KVSLOT_H

#include "kvswitch.h"

static __always_inline __u64 kv_slot_seq(struct kv_cache_val *s)
{
    __u64 q = *(volatile __u64 *)&s->seq;      /* read again, never a value clang kept */
    asm volatile("" ::: "memory");             /* and before (after) what follows (precedes) */
    return q;
}

/* Take the slot for writing; 0 if another writer holds it. */
static __always_inline int kv_slot_claim(struct kv_cache_val *s)
{
    __u64 q = kv_slot_seq(s);
    return !(q & 1) && __sync_val_compare_and_swap(&s->seq, q, q + 1) == q;
}

/* Give a claimed slot back: what was written becomes visible to readers as one. */
static __always_inline void kv_slot_release(struct kv_cache_val *s)
{
    asm volatile("" ::: "memory");
    __sync_fetch_and_add(&s->seq, 1);
}

/* The header of a claimed slot (its payload is written by the caller). */
static __always_inline void kv_slot_label(struct kv_cache_val *s, __u32 gen, __u32 len,
                                          __u16 flags, __u32 csum, __u32 nchunks,
                                          const struct kv_cache_key *owner, __u64 filled_ns)
{
    s->gen = gen;
    s->len = len;
    s->flags = flags;
    s->csum = csum;
    s->nchunks = nchunks;
    s->hits = 0;
    s->filled_ns = filled_ns;
    s->owner = *owner;
}

/* Whether the slot, its seq read as q, is a finished write for chunk k of allocation gen. */
static __always_inline int kv_slot_holds(const struct kv_cache_val *s, __u64 q, __u32 gen,
                                         const struct kv_cache_key *k)
{
    const __u64 *a = (const __u64 *)&s->owner, *b = (const __u64 *)k;
    return !(q & 1) && s->gen == gen && s->len != 0 && a[0] == b[0] && a[1] == b[1] &&
           a[2] == b[2];
}

#endif /* KVSLOT_H */
