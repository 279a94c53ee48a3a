"""hostagent: the KV block protocol endpoints, by role: the pool node (hostagent.pool),
the inference node (hostagent.inference), what both use (hostagent.common), and the
`hostagent` command line (hostagent.cli) that runs either."""
