"""hostagent: the KV block protocol endpoints (pool-node server, inference-node client)."""
