"""Demonstrations a new user runs: a block through the switch (basic, `make demo`) and a
transformer's prefix KV through the switch (inference, `make demo-inference`)."""
