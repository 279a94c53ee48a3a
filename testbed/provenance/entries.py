"""Which code a command line runs: the *entry* of a result's ``measured.command`` (or of the
command ``MADE_BY`` says made an unstamped result) — the function of a console script's click
command, or a module run as a script or with ``python -m`` — and where that code was before it
moved (``MOVED``, ``places``)."""
from __future__ import annotations

import importlib
import inspect
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    """Where a command's code starts: a module and, for a click command, the function it runs
    (its ``__qualname__``; None: the whole module, run as a script or with -m)."""
    module: str
    function: str | None = None

    def __str__(self) -> str:
        return self.module + (f":{self.function}" if self.function else "")


# Entries whose code moved to another module or function: its place now -> its place before
# ("module" or "module:function"), so that a result made before the move is compared with the
# code its command ran then. A place that moved again is followed (the chain of ``places``).
MOVED: dict[str, str] = {
    # testbed/bench/ in packages by experiment
    "testbed.bench.faults.cli:command": "testbed.bench.faults_cli:command",
    "testbed.bench.stores.cli:command": "testbed.bench.lmcache_cli:command",
    "testbed.bench.quality.compress:command.<locals>.compress":
        "testbed.bench.compress:command.<locals>.compress",
    "testbed.bench.serve.serve_vllm:command.<locals>.vllm":
        "testbed.bench.serve_vllm:command.<locals>.vllm",
    "testbed.bench.fetch.fetch_auth": "testbed.bench.fetch_auth",
    # the live validations out of the pure model, testbed/sim/, into testbed/bench/validate/
    "testbed.bench.validate.cli:sim_validate": "testbed.sim.cli:sim_validate",
    # one registration style: every command a click command beside its code, in one table
    "testbed.bench.fetch.cli:throughput": "testbed.cli:throughput",
    "testbed.bench.fetch.cli:incast": "testbed.cli:incast",
    "testbed.bench.fetch.cli:loss": "testbed.cli:loss",
    "testbed.bench.fetch.cli:fetch": "testbed.cli:fetch",
    "testbed.bench.serve.cli:serve": "testbed.cli:serve",
    "testbed.bench.serve.cli:vllm": "testbed.bench.serve.serve_vllm:command.<locals>.vllm",
    "testbed.bench.faults.cli:faults_cmd": "testbed.bench.faults.cli:command",
    "testbed.bench.faults.cli:soak": "testbed.cli:soak",
    "testbed.bench.stores.cli:lmcache": "testbed.bench.stores.cli:command",
    "testbed.bench.quality.cli:compress":
        "testbed.bench.quality.compress:command.<locals>.compress",
    "testbed.bench.quality.cli:blend": "testbed.cli:blend",
    "testbed.bench.validate.cli:replay": "testbed.cli:replay",
}


def places(entry: Entry) -> list[Entry]:
    """``entry`` and the places its code had before (``MOVED``), newest first."""
    out = [entry]
    while (before := MOVED.get(str(out[-1]))) and len(out) <= len(MOVED):
        module, _, function = before.partition(":")
        out.append(Entry(module, function or None))
    return out


class UnknownCommand(ValueError):
    """A command line that names no entry in this repository (the message says why)."""


def entry_of(command: str, root: str | Path) -> Entry:
    """The entry a command line runs, in the repository at ``root``: a console script of its
    pyproject.toml (``testbed bench fetch ...``: the function of the click command its words
    name, as the running interpreter's copy of the project defines it), ``python -m module``,
    ``python path/to/module.py`` or a path to a module (as sys.argv[0] is for ``-m``). Leading
    ``VAR=value`` words are skipped. Raises UnknownCommand.

    A click command's function is looked up in the project as this interpreter imports it
    (the command line as it is now), which is how ``testbed results-check`` runs."""
    argv = shlex.split(command)
    while argv and re.fullmatch(r"\w+=.*", argv[0]):
        argv.pop(0)
    if not argv:
        raise UnknownCommand("an empty command")
    root = Path(root)
    scripts = _scripts(root)
    prog = Path(argv[0]).name
    if prog.startswith("python") and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            if argv[2] in scripts:
                return _click_entry(scripts[argv[2]], argv[3:], command)
            return Entry(argv[2])
        argv = argv[1:]
    if argv[0].endswith(".py"):           # the path's tail that names a module here: never
        path = Path(argv[0]).with_suffix("")    # its root (another checkout's absolute path)
        parts = path.parts[path.is_absolute():]
        for k in range(len(parts), 0, -1):
            if (root / Path(*parts[-k:])).with_suffix(".py").is_file():
                return Entry(".".join(parts[-k:]))
        raise UnknownCommand(f"{argv[0]} is not a module of {root}")
    if prog in scripts:
        return _click_entry(scripts[prog], argv[1:], command)
    raise UnknownCommand(f"'{command}' runs neither a console script of pyproject.toml nor a "
                         "module")


def _scripts(root: Path) -> dict[str, str]:
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return data.get("project", {}).get("scripts", {})


def _click_entry(target: str, words: list[str], command: str) -> Entry:
    module, _, attr = target.partition(":")
    try:
        cmd = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownCommand(f"cannot load {target}: {exc}") from None
    for word in words:
        if not hasattr(cmd, "commands"):
            break
        cmd = cmd.commands.get(word, cmd)
    if hasattr(cmd, "commands") or getattr(cmd, "callback", None) is None:
        raise UnknownCommand(f"'{command}' names no command of {target}")
    fn = inspect.unwrap(cmd.callback)
    return Entry(fn.__module__, fn.__qualname__)
