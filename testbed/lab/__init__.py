"""The testbed's lab: veth/namespace topologies (topology), a running testbed with pool servers
and switchd (lab), Python tasks run inside its nodes (tasks), the test-only XDP programs its
nodes carry (pass.c, lossy.c) and TestbedError (testbed.errors), the error it raises."""
from .lab import Lab
from .tasks import Task, run_task, start_task
from .topology import Node, TestbedError, Topology, attach_loss, attach_pass_programs, ip

__all__ = ["Lab", "Node", "Task", "TestbedError", "Topology", "attach_loss",
           "attach_pass_programs", "ip", "run_task", "start_task"]
