"""The cluster model and the policy evaluator checked against the live testbed: a replayed
trace slice on 4 nodes against the model (validate, `testbed sim validate`), bench serve's
workloads against the serving model (validate_serve, `sim validate --serve`) and on a fabric of
switches against the fabric model (validate_fabric, `sim validate --serve --racks`), and a trace
replayed through the switch against the offline evaluator (replay, `testbed replay`)."""
