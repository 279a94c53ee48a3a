"""Tasks fail fast (testbed/lab/tasks.py): a task that fails at start ends the wait for its start
line at once with its own error, its fellow tasks stopped; one that never gets ready is named
with what it said last; a task's standard error reaches ours as it is written; ``gather`` ends
at the first failure. The tasks run as local processes (no namespaces needed)."""
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from testbed.lab.tasks import StartLine, gather, start_task
from testbed.lab.topology import TestbedError as LabError

LOCAL = SimpleNamespace(popen=lambda node, argv, **kw: subprocess.Popen(argv, **kw))
HERE = "test_tasks"


# ---- what the tasks run (imported by the task's fresh interpreter) ----------------------------
def ready_then_work(line: str, seconds: float) -> dict:
    StartLine.wait(line)
    time.sleep(seconds)
    return {"worked": seconds}


def fail_at_start(line: str) -> None:
    print("loading the engine ...", file=sys.stderr, flush=True)
    raise RuntimeError("the kernel refuses helper bpf_xdp_adjust_meta")


def stall(line: str) -> None:
    print("waiting for a pool node that never answers", file=sys.stderr, flush=True)
    time.sleep(600)


def talk_then_fail(seconds: float) -> None:
    for i in range(3):
        print(f"step {i}", file=sys.stderr, flush=True)
    time.sleep(seconds)
    raise SystemExit(3)


def start(target: str, *args):
    return start_task(LOCAL, "h1", f"{HERE}:{target}", *args)


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    """The task's interpreter imports this file by its module name."""
    monkeypatch.setenv("PYTHONPATH", str(__import__("pathlib").Path(__file__).parent))


def test_a_task_that_fails_at_start_ends_the_wait_at_once_with_its_error(tmp_path):
    line = StartLine(str(tmp_path), 2)
    tasks = [start("ready_then_work", line.path, 60), start("fail_at_start", line.path)]
    t0 = time.monotonic()
    with pytest.raises(LabError, match="fail_at_start failed: .*refuses helper "
                                       "bpf_xdp_adjust_meta"):
        line.go(tasks, timeout=600)
    assert time.monotonic() - t0 < 10
    assert tasks[0].proc.wait(5) is not None, "its fellow task is stopped"


def test_a_task_that_never_gets_ready_is_named_with_what_it_said(tmp_path):
    line = StartLine(str(tmp_path), 2)
    tasks = [start("ready_then_work", line.path, 60), start("stall", line.path)]
    with pytest.raises(LabError) as err:
        line.ready(tasks, timeout=3)
    message = str(err.value)
    assert message.startswith("not ready after 3 s: h1: test_tasks:stall"), message
    assert "never answers" in message and "ready_then_work" not in message
    assert all(t.proc.wait(5) is not None for t in tasks)


def test_gather_ends_at_the_first_failure_and_echoes_as_written(tmp_path, capfd):
    tasks = [start("talk_then_fail", 0.5), start("ready_then_work", str(tmp_path), 60)]
    (tmp_path / "go").write_text(f"{time.time():.6f}")
    t0 = time.monotonic()
    with pytest.raises(LabError, match="talk_then_fail failed: step 2$"):
        gather(tasks, timeout=120)
    assert time.monotonic() - t0 < 10
    assert "[h1] step 2" in capfd.readouterr().err
    assert gather([start("ready_then_work", str(tmp_path), 0.1)]) == [{"worked": 0.1}]
