/* kvwrite.c - switchd's writer program: the one way userspace writes a cache slot. switchd runs
 * it with BPF_PROG_TEST_RUN on a struct kv_write_cmd (kvswitch.h) followed by the payload; it
 * claims the slot under the slot protocol (kvslot.h), as the data plane's fill path does, so a
 * reader never sees a half-written slot served and two writers never interleave. Returns
 * KV_WRITE_DONE, KV_WRITE_BUSY (the slot is being written: try again) or KV_WRITE_BAD.
 *
 * Compiled on its own with kvmaps.h (switchd's tools that open only the pinned maps), or
 * appended to kvswitch.c (one object with the data plane's private maps: unit tests). */
#include <linux/bpf.h>
#include "kvmaps.h"
#include "kvslot.h"

int kv_write(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct kv_write_cmd *c = data;
    if (data + KV_WRITE_HEADER > data_end)
        return KV_WRITE_BAD;
    __u32 idx = c->slot;
    __u32 len = c->val.len;
    struct kv_cache_val *s = kv_cache.lookup(&idx);
    if (!s || len > KV_CHUNK || data + KV_WRITE_HEADER + len > data_end)
        return KV_WRITE_BAD;
    if (!kv_slot_claim(s))
        return KV_WRITE_BUSY;
    s->len = 0;                    /* empty until the payload is in */
    if (len && bpf_xdp_load_bytes(ctx, KV_WRITE_HEADER, s->data, len)) {
        s->gen = 0;
        kv_slot_release(s);
        return KV_WRITE_BAD;
    }
    kv_slot_label(s, len ? c->val.gen : 0, len, c->val.flags, c->val.csum, c->val.nchunks,
                  &c->val.owner, 0);
    kv_slot_release(s);
    return KV_WRITE_DONE;
}
