"""The pool (storage) node: the UDP server (server), where blocks are kept (store: in
memory; mooncake_store; disk_tier below DRAM), PUT assembly under budgets (assembly),
the staging arena blocks are served from (staging), GETs answered from XDP (xdpserve)
and the stored form of a block (blockfmt).
"""
