"""testbed: veth/namespace topologies, traffic, demos, benchmarks and trace replay."""
