"""SGLang's HiCache storage interface without SGLang installed: its wheel pins a CUDA torch and
does not install beside the CPU torch, but ``hicache_storage`` and ``storage/backend_factory``
import from the unpacked wheel with the CPU torch (and orjson, pybase64, triton, pillow,
IPython and transformers, which the venv has). ``make setup`` runs this module once; the tests
call ``ensure()``, which puts the unpacked wheel on ``sys.path``.

The wheel is fetched with ``pip download --no-deps sglang==VERSION`` and unpacked into the
project's cache (``$KVSWITCH_CACHE``, default ``~/.cache/kvswitch``) as ``sglang-VERSION``.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.5.23"
CACHE = Path(os.environ.get("KVSWITCH_CACHE", Path.home() / ".cache" / "kvswitch"))
INSTALL = (f"{sys.executable} -m testbed.sglang_wheel  (or 'make setup'; it runs pip download "
           f"--no-deps sglang=={VERSION})")


def root(version: str = VERSION) -> Path:
    """Where the unpacked wheel lives (its ``sglang`` package is inside)."""
    return CACHE / f"sglang-{version}"


def fetch(version: str = VERSION) -> Path:
    """Download and unpack the wheel unless it is there; its directory."""
    dest = root(version)
    if (dest / "sglang" / "srt" / "mem_cache" / "hicache_storage.py").exists():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=".sglang-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary", ":all:", f"sglang=={version}", "-d", tmp],
                           capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, f"sglang-{version}-*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"pip download sglang=={version} failed: "
                               f"{(r.stderr or r.stdout).strip()[-500:]}")
        unpacked = os.path.join(tmp, "unpacked")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(unpacked, [n for n in z.namelist() if n.startswith("sglang/")])
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(unpacked, dest)
    return dest


def ensure(version: str = VERSION) -> Path:
    """The unpacked wheel on ``sys.path`` (fetched if missing); its directory."""
    dest = fetch(version)
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    return dest


if __name__ == "__main__":
    print(f"sglang {VERSION} interface: {fetch()}")
