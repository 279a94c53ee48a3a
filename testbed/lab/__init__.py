"""The testbed's lab: veth/namespace topologies (topology, with shaped links: links), a fabric of
switches (fabric), a running testbed with pool servers and switchd (lab; a Mooncake master:
mooncake), Python tasks run inside its nodes (tasks), the faults an operator or a failing
machine brings on it (fault_kinds), the test-only XDP programs its nodes carry (pass.c, lossy.c)
and TestbedError (testbed.errors), the error it raises."""
from .lab import Lab
from .tasks import Task, run_task, start_task
from .topology import Node, TestbedError, Topology, attach_loss, attach_pass_programs, ip

__all__ = ["Lab", "Node", "Task", "TestbedError", "Topology", "attach_loss",
           "attach_pass_programs", "ip", "run_task", "start_task"]
