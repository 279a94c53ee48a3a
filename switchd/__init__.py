"""switchd: the control plane of the in-network KV-cache switch (loader, maps, policy, CLI)."""
