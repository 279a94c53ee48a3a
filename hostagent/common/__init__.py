"""What the pool node, the inference node, the CLI and the testbed share: block keys
(hashing), keyed block authentication (auth), UDP socket settings (udp), the transfer
types both clients return and raise (transfer), eviction orders (eviction) and the
tier policy (tier_policy).
"""
