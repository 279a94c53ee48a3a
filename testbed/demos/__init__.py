"""Demonstrations a new user runs: a block through the switch (basic, `make demo`), a
transformer's prefix KV through the switch (inference, `make demo-inference`) and vLLM engines
sharing prefix KV through the switch (vllm, `make demo-vllm`; model configs in models/)."""
