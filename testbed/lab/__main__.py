"""``python -m testbed.lab TARGET ARGS``: run one task in this interpreter (testbed.lab.tasks),
as start_task does inside a node."""
import sys

from .tasks import _main

_main(*sys.argv[1:3])
