"""Where benchmark and evaluation results go: JSON files, written the same way by every tool,
each stamped with what made it (``measured``: the commit, whether the tracked files differed
from it, the kernel, the command), as asv's per-commit records are."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def measured(argv: list[str] | None = None) -> dict:
    """What is making a result now: the checkout's commit (None outside a git checkout), whether
    its tracked files are as committed (``clean``), the running kernel and the command line."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(("__main__.py", "/testbed", "/switchd", "/hostagent")):
        argv[0] = Path(argv[0]).parent.name if argv[0].endswith("__main__.py") else \
            Path(argv[0]).name
    return {"commit": commit, "clean": dirty == "" if commit else None,
            "kernel": os.uname().release, "command": shlex.join(argv)}


def is_stamp(value) -> bool:
    """Whether a result's ``measured`` is a stamp of what made it (``measured()``'s)."""
    return isinstance(value, dict) and "commit" in value and "command" in value


def write_json(path: str | Path | None, result: dict) -> None:
    """Write ``result`` to ``path`` (parents made), if a path is given, stamped with what made it
    (a stamp it already has is kept: a result rewritten from another). ``measured`` is the
    stamp's key: a result using it for anything else is refused (ValueError)."""
    if not path:
        return
    if "measured" in result and not is_stamp(result["measured"]):
        raise ValueError("a result's 'measured' is the stamp of what made it: give the data "
                         "another key")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, "measured": result.get("measured") or measured()}
    result = {"measured": result.pop("measured"), **result}
    path.write_text(json.dumps(result, indent=2) + "\n")
