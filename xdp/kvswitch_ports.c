/* kvswitch_ports.c - port checks, a part of kvswitch.c (pasted where kvswitch.c includes it,
 * as xdp/loader.py compiles a program: BCC rewrites map calls in its main file only), so it
 * sees what kvswitch.c includes and defines above it.
 *
 * Tenant isolation (ns_allowed, limited_port_may_pass) and port security: a secured port's
 * frames carry its bound source, one no other port owns (source_ok, bind_port; kv_src_macs,
 * kv_src_ips; docs/security.md); a trunk that owns its sources carries only its own
 * (trunk_source_ok): across a fabric, no rack can claim another rack's host or a pool node. */

/* Tenant isolation: a port limited to some namespaces never gets (or causes) anything else. */
static __always_inline int ns_allowed(struct xdp_md *ctx, struct kv_port_cfg *port, __u32 ns)
{
    if (!port || !(port->flags & KV_PF_NS_LIMITED))
        return 1;
    __u32 n = port->nns;
    if (n <= KV_PORT_NS_INLINE) {      /* the usual case: a few tenants, no second lookup */
#pragma unroll
        for (int i = 0; i < KV_PORT_NS_INLINE; i++)
            if (i < n && port->ns[i] == ns)
                return 1;
        return 0;
    }
    struct kv_port_ns_key pk = {};
    pk.ifindex = ctx->ingress_ifindex;
    pk.ns = ns;
    return kv_port_ns.lookup(&pk) != 0;
}

/* What a limited port may send besides valid KV requests for its namespaces: frames that cannot
 * be KV requests in disguise. ARP; IPv4 without options, unfragmented, and not UDP to the KV port
 * (those parse as KV, valid or not); IPv6 whose next header is TCP, ICMPv6, or UDP not to the KV
 * port. VLAN tags, IP options and fragments, IPv6 extension headers, other protocols and invalid
 * KV frames are dropped: a pool node's stack would strip or reassemble them and answer. */
static __always_inline int limited_port_may_pass(void *data, void *data_end, int parsed)
{
    struct ethhdr *eth = data;
    if (parsed != KV_NOT_KV || (void *)(eth + 1) > data_end)
        return 0;
    if (eth->h_proto == bpf_htons(ETH_P_ARP))
        return 1;
    if (eth->h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = (void *)(eth + 1);
        return (void *)(ip + 1) <= data_end && ip->ihl == 5 && !(ip->frag_off & bpf_htons(0x3fff));
    }
    if (eth->h_proto != bpf_htons(ETH_P_IPV6))
        return 0;
    struct ipv6hdr *ip6 = (void *)(eth + 1);
    if ((void *)(ip6 + 1) > data_end)
        return 0;
    if (ip6->nexthdr == IPPROTO_TCP || ip6->nexthdr == IPPROTO_ICMPV6)
        return 1;
    struct udphdr *udp = (void *)(ip6 + 1);
    return ip6->nexthdr == IPPROTO_UDP && (void *)(udp + 1) <= data_end &&
           udp->dest != bpf_htons(KV_UDP_PORT);
}

static __always_inline __u64 mac_key(const __u8 *mac)
{
    __u64 k = 0;
    __builtin_memcpy(&k, mac, ETH_ALEN);
    return k;
}

/* Whether a source is bound to a port other than `ifindex` (kv_src_macs, kv_src_ips). */
static __always_inline int mac_taken(__u64 mac, __u32 ifindex)
{
    __u32 *owner = kv_src_macs.lookup(&mac);
    return owner && *owner != ifindex;
}

static __always_inline int ip_taken(__be32 ip, __u32 ifindex)
{
    __u32 *owner = kv_src_ips.lookup(&ip);
    return owner && *owner != ifindex;
}

/* Bind an unbound secured port to (mac, ip), unless another port owns either: the owner entries
 * are claimed first (an insert that fails means someone else has it), then the port's config.
 * Runs once per port (or once after an operator's relearn), never on the hit path. */
static __always_inline int bind_port(struct kv_port_cfg *port, __u32 ifindex, const __u8 *src,
                                     __be32 ip)
{
    if (__sync_fetch_and_or(&port->flags, KV_PF_BINDING) & KV_PF_BINDING)
        return 0;                  /* another CPU is binding it right now */
    __u64 mk = mac_key(src);
    int ok = 0;
    if (kv_src_macs.insert(&mk, &ifindex) && mac_taken(mk, ifindex)) {
        count(KV_STAT_SRC_TAKEN, 1);
    } else if (kv_src_ips.insert(&ip, &ifindex) && ip_taken(ip, ifindex)) {
        count(KV_STAT_SRC_TAKEN, 1);
        __u32 *owner = kv_src_macs.lookup(&mk);
        if (owner && *owner == ifindex)
            kv_src_macs.delete(&mk);
    } else {
        __builtin_memcpy(port->mac, src, ETH_ALEN);
        port->ip = ip;
        __sync_fetch_and_or(&port->flags, KV_PF_BOUND);
        count(KV_STAT_SRC_LEARNED, 1);
        ok = 1;
    }
    __sync_fetch_and_and(&port->flags, ~(__u64)KV_PF_BINDING);
    return ok;
}

/* The source a frame claims: its Ethernet source and, for IPv4 and ARP, its address in *ip (0:
 * none, e.g. an address probe). Returns 0 when the frame cannot carry a checkable source (from a
 * group address, an ARP whose sender is not its Ethernet source, a VLAN tag: the inner source),
 * 2 for IPv4 and ARP (an address a port may be bound to), 1 for the rest (IPv6, ...). */
static __always_inline int frame_source(void *data, void *data_end, __be32 *ip)
{
    struct ethhdr *eth = data;
    *ip = 0;
    if ((void *)(eth + 1) > data_end || (eth->h_source[0] & 1))
        return 0;                  /* no frame comes from a group address */
    if (eth->h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *iph = (void *)(eth + 1);
        if ((void *)(iph + 1) > data_end)
            return 0;
        *ip = iph->saddr;
        return 2;
    }
    if (eth->h_proto == bpf_htons(ETH_P_ARP)) {
        struct arphdr *arp = (void *)(eth + 1);
        __u8 *sha = (void *)(arp + 1);
        if ((void *)(sha + ETH_ALEN + 4) > data_end || arp->ar_hln != ETH_ALEN ||
            arp->ar_pln != 4 || !mac_eq(sha, eth->h_source))
            return 0;              /* an ARP sender other than the frame's source: a spoof */
        __builtin_memcpy(ip, sha + ETH_ALEN, 4);
        return 2;                  /* address probes (sender 0.0.0.0) are checked, not learned */
    }
    if (eth->h_proto == bpf_htons(ETH_P_8021Q) || eth->h_proto == bpf_htons(ETH_P_8021AD))
        return 0;                  /* the inner source cannot be checked here */
    return 1;
}

/* Port security: a secured port's frames carry its bound source, or are dropped; every frame
 * type is checked (its Ethernet source; an ARP's sender too; an IPv4 packet's source too). A
 * port whose source switchd left unset binds to the source of its first ARP or IPv4 frame with a
 * sender address, unless another port owns that MAC or address (a pool port is bound before any
 * frame is seen); until then its frames pass only if their sources belong to nobody else. The
 * binding is sticky: only the operator unbinds a port (switchd port relearn). */
static __always_inline int source_ok(struct xdp_md *ctx, struct kv_port_cfg *port, void *data,
                                     void *data_end)
{
    __be32 ip;
    int kind = frame_source(data, data_end, &ip);
    if (!kind)
        return 0;
    struct ethhdr *eth = data;
    if (port->flags & KV_PF_BOUND) {
        if (!mac_eq(eth->h_source, port->mac))
            return 0;
        if (eth->h_proto == bpf_htons(ETH_P_IP))
            return ip == port->ip;
        return eth->h_proto != bpf_htons(ETH_P_ARP) || ip == port->ip || !ip;
    }
    if (port->flags & KV_PF_BINDING)
        return 0;                  /* another CPU is binding the port right now */
    __u32 ifindex = ctx->ingress_ifindex;
    __u64 mk = mac_key(eth->h_source);
    if (mac_taken(mk, ifindex) || (ip && ip_taken(ip, ifindex))) {
        count(KV_STAT_SRC_TAKEN, 1);
        return 0;                  /* another port's source: never passed, never learned */
    }
    if (kind != 2 || !ip)
        return 1;                  /* nothing to bind to yet (IPv6, a probe): its MAC is free */
    return bind_port(port, ifindex, eth->h_source, ip);
}

/* Whether a source entry is this trunk's: an unowned one becomes its own (an insert that
 * fails means another CPU or port took it first: look again). */
static __always_inline int trunk_owns_mac(__u64 mac, __u32 ifindex)
{
    __u32 *owner = kv_src_macs.lookup(&mac);
    if (!owner) {
        if (!kv_src_macs.insert(&mac, &ifindex))
            count(KV_STAT_SRC_OWNED, 1);
        owner = kv_src_macs.lookup(&mac);
    }
    return owner && *owner == ifindex;
}

static __always_inline int trunk_owns_ip(__be32 ip, __u32 ifindex)
{
    __u32 *owner = kv_src_ips.lookup(&ip);
    if (!owner) {
        if (!kv_src_ips.insert(&ip, &ifindex))
            count(KV_STAT_SRC_OWNED, 1);
        owner = kv_src_ips.lookup(&ip);
    }
    return owner && *owner == ifindex;
}

/* A trunk that owns its sources (KV_PF_SOURCES): every source it carries is its own, the first
 * time it is seen if nobody owns it yet. On a rack switch the uplink owns the pool nodes
 * (written by switchd before any frame) and every host of other racks it has carried; on the
 * pool-side switch each downlink owns its rack's hosts. A frame claiming a source another port
 * owns is dropped (and counted in KV_STAT_SRC_TAKEN): a host of one rack cannot speak as a host
 * of another, nor as a pool node, through any box. */
static __always_inline int trunk_source_ok(struct xdp_md *ctx, void *data, void *data_end)
{
    __be32 ip;
    if (!frame_source(data, data_end, &ip))
        return 0;
    struct ethhdr *eth = data;
    __u32 ifindex = ctx->ingress_ifindex;
    if (!trunk_owns_mac(mac_key(eth->h_source), ifindex) || (ip && !trunk_owns_ip(ip, ifindex))) {
        count(KV_STAT_SRC_TAKEN, 1);
        return 0;
    }
    return 1;
}
