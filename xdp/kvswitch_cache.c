/* kvswitch_cache.c - the switch's cache, a part of kvswitch.c (pasted where kvswitch.c includes
 * it, as xdp/loader.py compiles a program: BCC rewrites map calls in its main file only),
 * so it sees what kvswitch.c includes and defines above it.
 *
 * Hits: a GET's chunk found through the block index (cached) and the GET turned into its reply
 * in place (answer_get). Misses: demand counted into the sketch switchd reads (count_miss).
 * Learning: a pool reply's payload copied into its block's slot as it passes (learn_reply), slots
 * carved from the fill region switchd granted (carve); its CRC is checked at the slot's first
 * hit (checked_slot, crc32_ieee), off the path of the reader whose reply taught it. */

/* CRC-32 (IEEE, reflected, as zlib.crc32), sliced: 16 bytes a step through KV_CRC_SLICES
 * tables of 256 entries (table k takes a byte k more zero bytes along; table 0 is the classic
 * byte-at-a-time one), written by switchd when it loads the program (an empty table fails
 * every check, so nothing is learned, never anything wrong). One byte at a time, a 3 KiB reply
 * took 7.6 us here, most of a cold fetch's time through the switch; sliced it takes 1.45
 * (docs/throughput.md). Words are read little-endian, as BPF runs on this host. */
struct kv_crc_table {
    __u32 t[KV_CRC_SLICES * 256];
};
BPF_ARRAY(kv_crc_table, struct kv_crc_table, 1);

/* bytes the tail loop covers: what whole steps leave (fewer when a chunk is that small) */
#define KV_CRC_TAIL (KV_CHUNK < KV_CRC_SLICES ? KV_CHUNK : KV_CRC_SLICES)

/* CRC of p[0..len), len <= KV_CHUNK, p 8-byte aligned. Run at a learned slot's first hit,
 * so what the cache serves always matches its CRC. The loops always run their full counts and keep
 * the CRC of the first len bytes with arithmetic, not a branch on len: a branch would make the
 * verifier walk the rest of the loop once per possible length. The step loop takes the whole
 * 16-byte steps below len; the tail loop then takes the len % 16 bytes after them, one at a
 * time, from a window kept inside p. (Sign-mask idioms such as -(x & 1) or (s64)x >> 63 are
 * avoided on purpose: they crashed this kernel's verifier in maybe_fork_scalars.) */
static __always_inline __u32 crc32_ieee(const struct kv_crc_table *tab, const __u8 *p, __u32 len)
{
    const __u32 *t = tab->t;
    __u32 c = 0xffffffff;
#pragma clang loop unroll(disable)
    for (__u32 i = 0; i < KV_CHUNK / 16; i++) {
        __u64 w0 = *(const __u64 *)(p + 16 * i), w1 = *(const __u64 *)(p + 16 * i + 8);
        __u32 a = (__u32)w0 ^ c, b = (__u32)(w0 >> 32), e = (__u32)w1, f = (__u32)(w1 >> 32);
        __u32 d = t[15 * 256 + (a & 0xff)] ^ t[14 * 256 + ((a >> 8) & 0xff)] ^
                  t[13 * 256 + ((a >> 16) & 0xff)] ^ t[12 * 256 + (a >> 24)] ^
                  t[11 * 256 + (b & 0xff)] ^ t[10 * 256 + ((b >> 8) & 0xff)] ^
                  t[9 * 256 + ((b >> 16) & 0xff)] ^ t[8 * 256 + (b >> 24)] ^
                  t[7 * 256 + (e & 0xff)] ^ t[6 * 256 + ((e >> 8) & 0xff)] ^
                  t[5 * 256 + ((e >> 16) & 0xff)] ^ t[4 * 256 + (e >> 24)] ^
                  t[3 * 256 + (f & 0xff)] ^ t[2 * 256 + ((f >> 8) & 0xff)] ^
                  t[256 + ((f >> 16) & 0xff)] ^ t[f >> 24];
        __u32 take = (16 * i + 15 - len) >> 31;   /* 1 while all 16 bytes are below len */
        c ^= (c ^ d) * take;
    }
    /* the window's start, 64-bit: a 32-bit one is compared on a zero-extended copy, and the
     * verifier cannot carry that bound back to the register that addresses p */
    __u32 whole = len & ~15u;
    __u64 base = whole;
    if (base > KV_CHUNK - KV_CRC_TAIL)
        base = KV_CHUNK - KV_CRC_TAIL;
#pragma clang loop unroll(disable)
    for (__u32 j = 0; j < KV_CRC_TAIL; j++) {
        __u32 pos = base + j;
        __u32 d = (c >> 8) ^ t[(c ^ p[base + j]) & 0xff];
        __u32 take = ((pos - len) >> 31) & ((whole - 1 - pos) >> 31);  /* whole <= pos < len */
        c ^= (c ^ d) * take;
    }
    return ~c;
}

static __always_inline __u64 le64(const __u8 *b)
{
    __u64 x = 0;
#pragma unroll
    for (int i = 7; i >= 0; i--)
        x = (x << 8) | b[i];
    return x;
}

static __always_inline void sketch_add(__u32 row, __u64 a, __u64 b, __u64 x)
{
    struct kv_sketch_row *r = kv_sketch.lookup(&row);
    if (r) {
        __u32 col = ((a * x + b) >> (64 - KV_SKETCH_BITS)) & (KV_SKETCH_WIDTH - 1);
        if (r->c[col] != 0xffffffff)
            r->c[col]++;
    }
}

static __always_inline void block_key(struct kv_block_key *bk, const struct kv_cache_key *k)
{
    bk->ns = k->ns;
    __builtin_memcpy(bk->key, k->key, sizeof(bk->key));
}

/* A miss: demand for the block goes into the sketch (once per fetch: on chunk 0). */
static __always_inline void count_miss(struct kv_cache_key *k)
{
    struct kv_ns_stats *st = ns_stats(k->ns);
    if (st)
        st->misses++;
    if (k->chunk != 0)
        return;
    __u64 x = le64(k->key) ^ (le64(k->key + 8) * KV_SKETCH_HI_MUL) ^
              ((__u64)k->ns * KV_SKETCH_NS_MUL);
    sketch_add(0, KV_SKETCH_A0, KV_SKETCH_B0, x);
    sketch_add(1, KV_SKETCH_A1, KV_SKETCH_B1, x);
    sketch_add(2, KV_SKETCH_A2, KV_SKETCH_B2, x);
    sketch_add(3, KV_SKETCH_A3, KV_SKETCH_B3, x);
    struct kv_block_key bk = {};
    block_key(&bk, k);
    struct kv_recent *rec = kv_recent.lookup(&bk);
    if (rec) {
        rec->last_ns = bpf_ktime_get_ns();
    } else {
        struct kv_recent fresh = {};
        fresh.last_ns = bpf_ktime_get_ns();
        kv_recent.update(&bk, &fresh);
    }
}

/* A learned slot's first hit, its seq read as q: its payload checked against the CRC the pool's
 * reply carried, as a writer of the slot (so no write can come between the check and its mark).
 * A slot that passes is marked checked; one that fails is emptied: its bytes are never served.
 * Returns whether it may be served; 0 also when another CPU holds the slot (a miss this time). */
static __always_inline int checked_slot(struct kv_cache_val *v, __u64 q)
{
    if (__sync_val_compare_and_swap(&v->seq, q, q + 1) != q)
        return 0;
    __u32 zero = 0;
    struct kv_crc_table *tab = kv_crc_table.lookup(&zero);
    __u32 len = v->len;
    int ok = tab && len >= 1 && len <= KV_CHUNK && crc32_ieee(tab, v->data, len) == v->csum;
    if (ok) {
        v->flags &= ~KV_CF_UNCHECKED;
    } else {
        v->len = 0;
        v->gen = 0;
        count(KV_STAT_FILL_CORRUPT, 1);    /* never serve bytes that fail their own checksum */
    }
    kv_slot_release(v);
    return ok;
}

/* k's slot, if its block has slots and the one for k holds k's chunk, finished (kvslot.h);
 * *seq: the slot's sequence word as read, for the check after the copy. */
static __always_inline struct kv_cache_val *cached(struct kv_cache_key *k, __u64 *seq)
{
    struct kv_block_key bk = {};
    block_key(&bk, k);
    struct kv_block *b = kv_blocks.lookup(&bk);
    if (!b)
        return 0;
    __u32 gen = b->gen, idx = b->base + k->chunk;
    if (k->chunk >= b->slots)
        return 0;
    struct kv_cache_val *v = kv_cache.lookup(&idx);
    if (!v)
        return 0;
    __u64 q = kv_slot_seq(v);
    if (!kv_slot_holds(v, q, gen, k)) {
        if ((q & 1) || (v->gen == gen && v->len))  /* being written, or for another chunk */
            count(KV_STAT_REUSED, 1);
        return 0;                  /* else not filled yet: a plain miss */
    }
    if (v->flags & KV_CF_UNCHECKED) {
        if (!checked_slot(v, q))
            return 0;              /* it failed its CRC (emptied), or another CPU checks it */
        q = kv_slot_seq(v);
        if (!kv_slot_holds(v, q, gen, k))
            return 0;
    }
    *seq = q;
    return v;
}

/* Turn the GET in ctx into the reply carrying slot `v`, found for `k` at sequence `seq`.
 * Returns the XDP verdict. */
static __always_inline int answer_get(struct xdp_md *ctx, struct kv_cache_val *v,
                                      struct kv_cache_key *k, __u64 seq, __u32 room)
{
    __u32 ns = k->ns;
    __u32 len = v->len;
    if (len == 0 || len > KV_CHUNK)
        return XDP_PASS;           /* never happens for slots we wrote; be safe */
    if (len > room) {
        count(KV_STAT_NO_ROOM, 1);
        return XDP_PASS;
    }
    int r = kv_reply_in_place(ctx, v->data, len, v->nchunks, v->csum, 0xffff,
                              bpf_htons(KV_F_FROM_SWITCH));
    if (r != XDP_TX)
        return r;
    if (kv_slot_seq(v) != seq) {   /* written again (for another chunk?) while we copied */
        count(KV_STAT_REUSED, 1);
        return XDP_DROP;           /* the asker retransmits */
    }

    v->hits++;                     /* not atomic: a popularity count may lose a concurrent hit */
    count(KV_STAT_GET_HIT, 1);
    count(KV_STAT_HIT_BYTES, len);
    struct kv_ns_stats *st = ns_stats(ns);
    if (st) {
        st->hits++;
        st->hit_bytes += len;
    }
    return XDP_TX;
}

/* Slots for a block of n chunks that has none: n of them, or as many as are left (its first
 * chunks: the ones every fetch starts with), from the fill region switchd granted (kv_settings
 * KV_SET_FILL_NEXT..KV_SET_FILL_END), under a new data-plane generation. switchd owns the
 * allocator: it grants the region, takes what was carved into its books from kv_blocks, and
 * never hands out what the index or the region holds. If two CPUs carve for the same block,
 * one index entry wins and the other range is left for switchd to take back. */
static __always_inline struct kv_block *carve(struct kv_block_key *bk, __u32 n)
{
    __u32 ni = KV_SET_FILL_NEXT, ei = KV_SET_FILL_END, gi = KV_SET_DP_GEN;
    __u64 *next = kv_settings.lookup(&ni), *end = kv_settings.lookup(&ei);
    __u64 *gens = kv_settings.lookup(&gi);
    if (!next || !end || !gens || n == 0 || n > KV_CACHE_ENTRIES)
        return 0;
    __u64 e = *(volatile __u64 *)end, at = *(volatile __u64 *)next;
    if (at >= e)
        return 0;                  /* the region is used up until switchd grants another */
    __u64 want = e - at < n ? e - at : n;
    __u64 base = __sync_fetch_and_add(next, want);
    if (base + want > e)
        return 0;                  /* another CPU carved it first */
    struct kv_block nb = {};
    nb.base = base;
    nb.nchunks = n;
    nb.slots = want;
    nb.gen = KV_GEN_DATAPLANE | (__u32)__sync_fetch_and_add(gens, 1);
    kv_blocks.insert(bk, &nb);
    return kv_blocks.lookup(bk);
}

/* Copy a pool reply's payload into its slot if its block is admitted (or switchd's speculative
 * budget lasts), unchecked: its CRC is checked at its first hit (checked_slot), not on this
 * reader's path. Leaves the frame as it was, but invalidates packet pointers. */
static __always_inline void learn_reply(struct xdp_md *ctx, struct kv_frame *f,
                                        struct kv_cache_key *k)
{
    struct kvhdr *kv = f->kv;
    struct kv_block_key bk = {};
    block_key(&bk, k);
    struct kv_admit_val *a = kv_admit.lookup(&bk);
    __u16 flags = KV_CF_FILLED | KV_CF_UNCHECKED;
    if (a && a->expires_ns && a->expires_ns < bpf_ktime_get_ns())
        return;
    if (!a) {
        __u64 share_n = setting(KV_SET_SHARE_N);
        if (share_n > 1 && le64(k->key) % share_n != setting(KV_SET_SHARE_K))
            return;                /* another switch's share of the hot set */
        /* Not admitted: learn it anyway while switchd's speculative budget lasts, so a block
         * is cached from its first miss and switchd decides at its next step whether it stays
         * (as an offline policy would on the miss itself) instead of waiting for a second. */
        __u32 idx = KV_SET_SPEC_FILL;
        __s64 *budget = (__s64 *)kv_settings.lookup(&idx);
        if (!budget || *budget <= 0 || __sync_fetch_and_add(budget, -1) <= 0)
            return;
        flags |= KV_CF_SPECULATIVE;
    }
    __u64 len = kv_opaque_len(f->payload_len);
    __u32 nchunks = bpf_ntohl(kv->nchunks), csum = bpf_ntohl(kv->csum);
    struct kv_block *b = kv_blocks.lookup(&bk);
    if (!b)
        b = carve(&bk, nchunks);
    if (!b || len < 1 || len > KV_CHUNK || b->nchunks != nchunks || k->chunk >= b->slots) {
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    __u32 gen = b->gen, idx = b->base + k->chunk;
    struct kv_cache_val *s = kv_cache.lookup(&idx);
    if (!s || !kv_slot_claim(s)) {     /* being written by someone else right now */
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    s->len = 0;                        /* empty until the payload is in */
    if (bpf_xdp_load_bytes(ctx, KV_PAYLOAD_OFF, s->data, len)) {
        s->gen = 0;
        kv_slot_release(s);
        count(KV_STAT_FILL_FAIL, 1);
        return;
    }
    kv_slot_label(s, gen, len, flags, csum, nchunks, k, bpf_ktime_get_ns());
    kv_slot_release(s);
    count(KV_STAT_FILL, 1);
    if (flags & KV_CF_SPECULATIVE)
        count(KV_STAT_SPEC_FILL, 1);
}
