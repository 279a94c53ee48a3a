"""Pinning maps on a bpf filesystem: the check that a pin directory is on one (one line saying how
to mount it otherwise), and the compiler flag that makes a program pin its maps there (the C side:
``KV_PIN_DIR``, see xdp/kvmaps.h). ``libbpf.pinned_map_info`` reads a pinned map's layout."""
from __future__ import annotations

from . import NoXdp


def bpffs_mounts() -> list[str]:
    """Mount points of bpf filesystems in this mount namespace."""
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2] == "bpf"]


def require_bpffs(pin_dir: str) -> None:
    """NoXdp unless ``pin_dir`` lies on a bpf filesystem."""
    if not any(pin_dir == m or pin_dir.startswith(m.rstrip("/") + "/") for m in bpffs_mounts()):
        raise NoXdp(f"{pin_dir} is not on a bpf filesystem: mount one with "
                    "'mount -t bpf bpf /sys/fs/bpf'")


def cflag(pin_dir: str) -> str:
    """The compiler flag that pins a program's maps in ``pin_dir``."""
    return f'-DKV_PIN_DIR="{pin_dir}"'


def split_cflag(flags: list[str]) -> tuple[str | None, list[str]]:
    """The pin directory ``flags`` name (``cflag``'s), and the flags with it replaced by a
    placeholder: what a program's code depends on is whether it pins, not where."""
    prefix = cflag("")[:-2]
    for i, f in enumerate(flags):
        if f.startswith(prefix) and f.endswith('"'):
            return f[len(prefix) + 1:-1], [*flags[:i], cflag("<pin dir>"), *flags[i + 1:]]
    return None, list(flags)
