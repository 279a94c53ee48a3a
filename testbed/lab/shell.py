"""How the lab runs commands: ``sh`` (a command, its failure one TestbedError line with what it
said) and ``ip`` (iproute2, in a namespace if named)."""
from __future__ import annotations

import subprocess

from ..errors import TestbedError


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode:
        raise TestbedError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return sh(*(["ip", "-n", ns] if ns else ["ip"]), *args, check=check)
