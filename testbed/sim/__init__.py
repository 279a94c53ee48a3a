"""Traces and the cluster model, pure: Mooncake-format traces (trace), the offline policy
evaluator and its hindsight references (evaluate, hindsight, baselines), and the cluster-scale
model of the KV tiers (config, workload, tiers, codec, model) with its break-even sweep (sweep),
at bench serve's scale (serve_model) and on a fabric of switches (fabric_serve_model,
fabric_sweep). It imports neither the lab nor the benchmarks: its checks against the live
testbed are the benchmarks' (bench/validate)."""
