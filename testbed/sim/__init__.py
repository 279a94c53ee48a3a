"""Traces and the cluster model: Mooncake-format traces (trace), the offline policy evaluator and
its hindsight references (evaluate, hindsight), live trace replay on the testbed (replay), and the
cluster-scale model of the KV tiers (config, workload, tiers, model) with its break-even sweep
(sweep) and its validation against the testbed (validate)."""
