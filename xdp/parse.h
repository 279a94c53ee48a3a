/* parse.h - bounds-checked parsing of Ethernet/IPv4/UDP/kvhdr frames for the XDP programs.
 * Only untagged Ethernet + IPv4 without options, unfragmented, UDP to or from KV_UDP_PORT is KV
 * traffic; everything else is somebody else's and must pass untouched. */
#ifndef KV_PARSE_H
#define KV_PARSE_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include "kvproto.h"

_Static_assert(KV_ETH_LEN == sizeof(struct ethhdr) && KV_IPV4_LEN == sizeof(struct iphdr) &&
               KV_UDP_LEN == sizeof(struct udphdr), "kvproto.h frame geometry");
_Static_assert(KV_MAX_CHUNK == (KV_VETH_MAX_MTU + KV_ETH_LEN - KV_PAYLOAD_OFF) / KV_CHUNK_ALIGN *
               KV_CHUNK_ALIGN, "kvproto.h chunk bound");
_Static_assert(KV_HDR_OFF == KV_ETH_LEN + KV_IPV4_LEN + KV_UDP_LEN &&
               KV_PAYLOAD_OFF == KV_HDR_OFF + KV_HDR_LEN &&
               KV_HDR_LEN == sizeof(struct kvhdr), "kvproto.h offsets");

enum kv_parse_result { KV_NOT_KV = 0, KV_BAD = 1, KV_OK = 2 };

struct kv_frame {                  /* eth, ip, udp: set when KV_OK or KV_BAD; kv: when KV_OK */
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp;
    struct kvhdr *kv;
    __u32 payload_len;             /* kvhdr.len, verified against the IP and UDP lengths */
};

static __always_inline __u16 kv_csum_fold(__u32 sum)
{
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return (__u16)~sum;
}

/* RFC 1071 checksum of a 20-byte IPv4 header; 0 when the stored checksum is right. */
static __always_inline __u16 kv_ip_csum(struct iphdr *ip)
{
    __u16 *w = (__u16 *)ip;
    __u32 sum = 0;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(struct iphdr) / 2); i++)
        sum += w[i];
    return kv_csum_fold(sum);
}

static __always_inline int kv_parse(void *data, void *data_end, struct kv_frame *f)
{
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
        return KV_NOT_KV;          /* short frames, VLAN tags, IPv6, ARP ... */
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl != 5 ||
        ip->protocol != IPPROTO_UDP || (ip->frag_off & bpf_htons(0x3fff)))
        return KV_NOT_KV;          /* IP options, fragments, other protocols */
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > data_end)
        return KV_NOT_KV;
    if (udp->dest != bpf_htons(KV_UDP_PORT) && udp->source != bpf_htons(KV_UDP_PORT))
        return KV_NOT_KV;
    f->eth = eth;                  /* set for KV_BAD too: a caller may look at its ports */
    f->ip = ip;
    f->udp = udp;
    struct kvhdr *kv = (void *)(udp + 1);
    if ((void *)(kv + 1) > data_end)
        return KV_BAD;
    __u32 ip_len = bpf_ntohs(ip->tot_len);
    __u32 frame_ip_len = (__u32)((long)data_end - (long)ip);
    __u32 want = sizeof(struct iphdr) + sizeof(struct udphdr) + KV_HDR_LEN;
    __u32 payload = bpf_ntohs(kv->len);
    if (ip_len < want || ip_len > frame_ip_len || kv_ip_csum(ip) != 0 ||
        bpf_ntohs(udp->len) != ip_len - sizeof(struct iphdr) ||
        payload != ip_len - want || payload > KV_MAX_PAYLOAD ||
        kv->magic != bpf_htons(KV_MAGIC) || kv->version != KV_VERSION || kv->reserved != 0)
        return KV_BAD;             /* lying lengths, bad magic/version, corrupt IP header */
    f->kv = kv;
    f->payload_len = payload;
    return KV_OK;
}

#endif /* KV_PARSE_H */
