/* pass.c - the one-line XDP_PASS program every host-side veth end needs: without an XDP program
 * on the receiving peer, frames sent with XDP_TX or redirected into a veth are dropped. */
int xdp_pass(struct xdp_md *ctx)
{
    return XDP_PASS;
}
