"""`testbed bench serve` and `bench vllm`: serving loops on N inference nodes over shaped links
(serve, each node's loop serve_node, the workloads serve_workloads), with node and pool tiers
(serve_tiers, its nodes, pool and switch), on a fabric of switches (serve_fabric), and vLLM's own
server and client on the testbed (serve_vllm, vllm_server)."""
