"""The testbed's one error, TestbedError: a testbed could not be built, run or torn down, or a
run was asked for what cannot be (the `testbed` command line prints it as one line). The lab
raises it (testbed.lab re-exports it), and so do the benchmarks and the cluster model."""
from __future__ import annotations


class TestbedError(RuntimeError):
    """A testbed could not be built, run or torn down; the message says why in one line."""
