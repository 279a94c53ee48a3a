"""The one way experiments run Python inside a testbed node: ``run_task(topo, node, "module:func",
*args)`` calls ``func(*args)`` in a fresh interpreter inside the node's namespace (a coroutine
function is run with asyncio) and returns what it returned; arguments and the result travel as
JSON. ``start_task`` starts one and returns a handle, for several nodes at once. Commands that
are not Python functions (the CLIs, ping, iperf3) run with ``Topology.run``/``popen``."""
from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
from typing import Any

from .topology import TestbedError, Topology, python_argv


class Task:
    """A task running in a node; ``result()`` waits for it."""

    def __init__(self, proc: subprocess.Popen, node: str, target: str):
        self.proc, self.node, self.target = proc, node, target

    def result(self, timeout: float | None = 3600) -> Any:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise TestbedError(f"{self.node}: {self.target} still running after {timeout} s")
        if self.proc.returncode:
            raise TestbedError(f"{self.node}: {self.target} failed: {err.strip()[-800:]}")
        lines = out.strip().splitlines()
        if not lines:
            raise TestbedError(f"{self.node}: {self.target} printed no result: {err[-400:]}")
        return json.loads(lines[-1])


def start_task(topo: Topology, node: str, target: str, *args: Any) -> Task:
    proc = topo.popen(node, python_argv(__name__, target, json.dumps(args)),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Task(proc, node, target)


def run_task(topo: Topology, node: str, target: str, *args: Any,
             timeout: float | None = 3600) -> Any:
    return start_task(topo, node, target, *args).result(timeout)


def _main(target: str, args: str) -> None:
    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(*json.loads(args))
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(*sys.argv[1:3])
