"""What the running kernel grants the data plane, probed before anything relies on it (as
`bpftool feature probe` and xdp-tools' `xdp-loader features` do): each kernel feature a box's
programs use is tried on its own, and the box's programs are loaded as they will be.
`switchd check` and `hostagent check` say for their box, feature by feature, granted or
refused, what it is for and what the project does without it (``Use``), and exit non-zero when
something the box needs is refused.

Kernels differ: this one (6.18.44) refuses ``bpf_xdp_adjust_meta`` to XDP programs and
BPF_PROG_TEST_RUN in live-frames mode, so nothing here uses either. Probes that need interfaces
make a network namespace of their own (``kvprobe<pid>``) and always remove it.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import NoXdp, cflags as xdp_cflags, libbpf, loader, netns
from .cache import _open_map, patched

UAPI_BPF_H = Path("/usr/include/linux/bpf.h")
BPF_F_XDP_HAS_FRAGS = 1 << 5
MAP_TYPES = {1: "hash", 2: "array", 5: "percpu_hash", 6: "percpu_array", 9: "lru_hash",
             14: "devmap", 17: "devmap_hash"}
PROBES_SOURCE = Path(__file__).resolve().parent / "features.c"


@dataclass(frozen=True)
class Use:
    """A feature a box uses (``needed``: it cannot run without it) or does not (``used_for``
    empty: listed so a user sees what the project avoids), and what the project does without."""
    feature: str                    # a helper's name, "map <type>", or a FEATURES key
    used_for: str
    without: str
    needed: bool = True


@dataclass
class Finding:
    what: str
    granted: bool
    detail: str = ""
    use: Use | None = None

    @property
    def fails(self) -> bool:
        return not self.granted and (self.use is None or self.use.needed)


# ---- helpers -----------------------------------------------------------------------------------
def helper_names(path: Path = UAPI_BPF_H) -> dict[int, str]:
    """{helper id: bpf_<name>} from the UAPI header's function mapper (ids explicit from Linux
    6.2 on, positional before)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    m = re.search(r"#define\s+_+BPF_FUNC_MAPPER\(FN[^)]*\)(.*?)\n\n", text, re.S)
    entries = re.findall(r"FN\((\w+)(?:,\s*(\d+))?", m.group(1) if m else "")
    return {int(n) if n else i: f"bpf_{name}" for i, (name, n) in enumerate(entries)}


def helpers_of(insns: bytes) -> set[int]:
    """Ids of the helpers a program's bytecode calls (BPF_CALL with src_reg 0)."""
    out = set()
    for i in range(0, len(insns), 8):
        code, regs, _, imm = struct.unpack_from("<BBhi", insns, i)
        if code == 0x85 and regs >> 4 == 0:
            out.add(imm)
    return out


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def probe_helper(helper: int, attach_type: int = 0) -> tuple[bool, str]:
    """Whether the kernel lets an XDP program call ``helper`` (bpftool's probe: a program that
    calls it; refused only when the verifier names the helper, not for its arguments)."""
    prog = (_insn(0xb7, 2) + _insn(0xb7, 3) + _insn(0xb7, 4) + _insn(0xb7, 5) +
            _insn(0x85, imm=helper) + _insn(0xb7, 0, imm=2) + _insn(0x95))
    try:
        os.close(libbpf.prog_load_xdp("kvprobe", prog, attach_type=attach_type))
    except OSError as exc:
        text = str(exc)
        if "refuses helper" in text or "does not know helper" in text:
            return False, text.split(": ")[-1]
    return True, ""


# ---- maps and programs -------------------------------------------------------------------------
def probe_map(mtype: int, flags: int = 0, value_size: int = 8) -> tuple[bool, str]:
    try:
        os.close(libbpf.map_create("kvprobe", mtype, 4, value_size, 4, flags))
    except OSError as exc:
        return False, str(exc)
    return True, ""


@dataclass
class LoadedProgram:
    name: str
    insns: int
    helpers: set[int]
    map_types: set[tuple[int, int]]         # (type, flags)
    attach: int
    error: str = ""


def load_programs(source: Path, programs: dict[str, int], cflags: list[str],
                  append: tuple[Path, ...] = ()) -> list[LoadedProgram]:
    """Each of ``programs`` (name -> attach type) of ``source`` compiled (or from the bytecode
    cache) and loaded on maps of its own, closed again: what it calls and uses, and the
    kernel's one-line reason where it refuses it. NoXdp when it cannot be compiled."""
    flags = xdp_cflags(*cflags)
    entry = loader.compiled_entry((source, *append), programs, flags)
    out = []
    for name, prog in entry["programs"].items():
        insns = bytes.fromhex(prog["insns"])
        maps = {m for _, m in prog["relocs"]}
        lp = LoadedProgram(name, len(insns) // 8, helpers_of(insns),
                           {tuple(entry["maps"][m]["layout"][i] for i in (0, 4)) for m in maps},
                           prog["attach"])
        fds: list[int] = []
        try:
            by_name = {m: _open_map(m, {**entry["maps"][m], "pinned": False}, None, fds)
                       for m in maps}
            fds.append(libbpf.prog_load_xdp(name, patched(insns, prog["relocs"], by_name),
                                            attach_type=prog["attach"]))
        except (OSError, NoXdp) as exc:
            lp.error = str(exc)
        finally:
            for fd in fds:
                os.close(fd)
        out.append(lp)
    return out


# ---- features that need interfaces -------------------------------------------------------------
@contextlib.contextmanager
def scratch(*pairs: tuple[str, str]):
    """A network namespace of its own with these veth pairs up, entered for the block, and
    always removed."""
    name = f"kvprobe{os.getpid()}"

    def run(*args: str) -> None:
        subprocess.run(["ip", "-n", name, *args], capture_output=True, check=True)

    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "netns", "add", name], capture_output=True, check=True)
    try:
        for a, b in pairs:
            run("link", "add", a, "type", "veth", "peer", "name", b)
            run("link", "set", a, "up")
            run("link", "set", b, "up")
        with netns.inside(name):
            yield {end: socket.if_nametoindex(end) for pair in pairs for end in pair}
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _simple(name: str, insns: bytes, attach_type: int = 0, prog_flags: int = 0) -> int:
    return libbpf.prog_load_xdp(name, insns, attach_type=attach_type, prog_flags=prog_flags)


XDP_PASS_INSNS = _insn(0xb7, 0, imm=2) + _insn(0x95)
XDP_DROP_INSNS = _insn(0xb7, 0, imm=1) + _insn(0x95)


def probe_test_run() -> tuple[bool, str]:
    fd = _simple("kvprobe", XDP_PASS_INSNS)
    try:
        verdict, _ = libbpf.xdp_test_run(fd, bytes(64))
        return verdict == 2, "" if verdict == 2 else f"verdict {verdict}"
    except OSError as exc:
        return False, str(exc)
    finally:
        os.close(fd)


def probe_native_veth() -> tuple[bool, str]:
    fd = _simple("kvprobe", XDP_PASS_INSNS)
    try:
        with scratch(("kvp0", "kvp1")) as ifs:
            libbpf.xdp_attach(ifs["kvp0"], fd, None, "native")
        return True, ""
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, str(exc)
    finally:
        os.close(fd)


def probe_live_frames() -> tuple[bool, str]:
    fd = _simple("kvprobe", XDP_DROP_INSNS)
    try:
        with scratch(("kvp0", "kvp1")) as ifs:
            libbpf.live_frames(fd, bytes(64), ifs["kvp0"], 4)
        return True, ""
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, str(exc)
    finally:
        os.close(fd)


def probe_multibuffer() -> tuple[bool, str]:
    """A frags-aware program attached natively to a veth at MTU 9000."""
    try:
        fd = _simple("kvprobe", XDP_PASS_INSNS, prog_flags=BPF_F_XDP_HAS_FRAGS)
    except OSError as exc:
        return False, str(exc)
    try:
        with scratch(("kvp0", "kvp1")):
            for dev in ("kvp0", "kvp1"):
                subprocess.run(["ip", "link", "set", dev, "mtu", "9000"], capture_output=True,
                               check=True)
            libbpf.xdp_attach(socket.if_nametoindex("kvp0"), fd, None, "native")
        return True, ""
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, str(exc)
    finally:
        os.close(fd)


def probe_packet_ring() -> tuple[bool, str]:
    from hostagent.common.packet_ring import PacketRing   # noqa: PLC0415 (a user, not a layer)
    try:
        with scratch(("kvp0", "kvp1")):
            ring = PacketRing("kvp0", 64, 64)
            try:
                ring.frames[:4] = 0xFF
                return ring.send(4) == 4, ""
            finally:
                ring.close()
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, str(exc)


def probe_broadcast() -> tuple[bool, str]:
    """One frame into a port whose program broadcasts it through a devmap with an egress
    program on each entry: both copies must pass the egress program."""
    try:
        bpf, fns = loader.load_xdp(PROBES_SOURCE, ("probe_broadcast", "probe_pass"),
                                   devmap_egress=("probe_egress",))
    except NoXdp as exc:
        return False, str(exc)
    try:
        with scratch(("kvp0", "kvp1"), ("kvp2", "kvp3"), ("kvp4", "kvp5")) as ifs:
            dm, count = bpf.get_table("probe_ports"), bpf.get_table("probe_count")
            for i, port in enumerate(("kvp2", "kvp4")):
                dm[dm.Key(i)] = dm.Leaf(ifs[port], fns["probe_egress"].fd)
            libbpf.xdp_attach(ifs["kvp1"], fns["probe_broadcast"].fd, None, "native")
            for port in ("kvp3", "kvp5"):
                libbpf.xdp_attach(ifs[port], fns["probe_pass"].fd, None, "native")
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
                s.bind(("kvp0", 0))
                s.send(b"\xff" * 12 + b"\x88\xb5" + bytes(50))
            end = time.monotonic() + 1
            while time.monotonic() < end and count[count.Key(0)].value < 2:
                time.sleep(0.01)
            n = count[count.Key(0)].value
            return n == 2, "" if n == 2 else f"{n} of 2 copies passed the egress program"
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, str(exc)
    finally:
        bpf.cleanup()


def probe_bpffs(path: str = "/sys/fs/bpf") -> tuple[bool, str]:
    from .pin import require_bpffs
    try:
        require_bpffs(path)
    except NoXdp as exc:
        return False, str(exc)
    fd = libbpf.map_create("kvprobe", libbpf.BPF_MAP_TYPE_ARRAY, 4, 4, 1)
    pin = os.path.join(path, f"kvprobe{os.getpid()}")
    try:
        libbpf.obj_pin(fd, pin)
        os.unlink(pin)
        return True, ""
    except OSError as exc:
        return False, str(exc)
    finally:
        os.close(fd)


def probe_mmapable() -> tuple[bool, str]:
    import mmap
    try:
        fd = libbpf.map_create("kvprobe", libbpf.BPF_MAP_TYPE_ARRAY, 4, 4096, 2,
                               libbpf.BPF_F_MMAPABLE)
    except OSError as exc:
        return False, str(exc)
    try:
        m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[0:4] = b"kvsw"
        ok = libbpf.map_lookup(fd, 0, 4096)[:4] == b"kvsw"
        m.close()
        return ok, "" if ok else "a write through the mapping was not in the map"
    except OSError as exc:
        return False, str(exc)
    finally:
        os.close(fd)


FEATURES = {
    "devmap broadcast with egress programs": probe_broadcast,
    "BPF_PROG_TEST_RUN": probe_test_run,
    "BPF_PROG_TEST_RUN live frames": probe_live_frames,
    "native XDP on veth": probe_native_veth,
    "XDP multi-buffer on veth": probe_multibuffer,
    "mmapable arrays": probe_mmapable,
    "bpffs pinning": probe_bpffs,
    "AF_PACKET TX ring": probe_packet_ring,
}


# ---- a box's check -----------------------------------------------------------------------------
def check(programs: list[LoadedProgram], uses: list[Use],
          purposes: dict[str, str]) -> list[Finding]:
    """Findings for a box: each program loaded (``purposes``: what it does), each helper and
    map type they use (``uses`` says what for and what without; a helper or map type not in
    ``uses`` is reported as needed by the programs that call it), each feature of ``uses``."""
    names, out = helper_names(), []
    by_feature = {u.feature: u for u in uses}
    for p in programs:
        out.append(Finding(f"program {p.name}", not p.error,
                           p.error or f"{p.insns:,} instructions",
                           Use(p.name, purposes.get(p.name, ""), "")))
    helpers: dict[int, tuple[int, list[str]]] = {}
    for p in programs:
        for h in p.helpers:
            helpers.setdefault(h, (p.attach, []))[1].append(p.name)
    for h, (attach, users) in sorted(helpers.items()):
        name = names.get(h, f"helper #{h}")
        granted, why = probe_helper(h, attach)
        out.append(Finding(f"helper {name}", granted, why, by_feature.get(
            name, Use(name, f"called by {', '.join(users)}", ""))))
    for u in uses:
        if u.feature.startswith("bpf_") and u.feature not in {names.get(h) for h in helpers}:
            hid = next((i for i, n in names.items() if n == u.feature), None)
            granted, why = probe_helper(hid) if hid is not None else (False, "unknown helper")
            out.append(Finding(f"helper {u.feature}", granted, why, u))
    types: dict[str, tuple[int, int, list[str]]] = {}
    for p in programs:
        for mtype, flags in sorted(p.map_types):
            mm = flags & libbpf.BPF_F_MMAPABLE
            label = f"map {MAP_TYPES.get(mtype, mtype)}" + (" (mmapable)" if mm else "")
            users = types.setdefault(label, (mtype, mm, []))[2]
            if p.name not in users:
                users.append(p.name)
    for label, (mtype, mm, users) in types.items():
        granted, why = probe_map(mtype, mm)
        out.append(Finding(label, granted, why, by_feature.get(
            label, Use(label, f"maps of {', '.join(users)}", ""))))
    for u in uses:
        if u.feature in FEATURES:
            granted, why = FEATURES[u.feature]()
            out.append(Finding(u.feature, granted, why, u))
    return out


def report(box: str, findings: list[Finding]) -> tuple[list[str], bool]:
    """Lines for a person (one per finding, then a verdict) and whether the box can run."""
    lines = [f"{box} check on kernel {os.uname().release}:"]
    w = max(len(f.what) for f in findings)
    for f in findings:
        state = "granted" if f.granted else "REFUSED" if f.fails else "refused"
        use = f.use
        if use is None or not use.used_for:
            note = f"not used: {use.without}" if use and use.without else ""
        elif f.granted:
            note = use.used_for
        else:
            note = f"{use.used_for}; without it: {use.without}" if use.without else use.used_for
        why = f" ({f.detail})" if f.detail and (not f.granted or f.what.startswith("program")) \
            else ""
        lines.append(f"  {state:8} {f.what:{w}}  {note}{why}")
    failed = [f for f in findings if f.fails]
    if failed:
        lines.append(f"{box} check: cannot run here: {failed[0].what} refused"
                     + (f" ({failed[0].detail})" if failed[0].detail else "")
                     + (f", and {len(failed) - 1} more" if len(failed) > 1 else ""))
    else:
        lines.append(f"{box} check: everything {box} needs is granted")
    return lines, not failed


def emit(box: str, findings: list[Finding], as_json: bool) -> int:
    """Print a box's findings (lines for a person, or JSON) and return its exit status."""
    import json
    lines, ok = report(box, findings)
    if as_json:
        print(json.dumps({"box": box, "kernel": os.uname().release, "ok": ok, "findings": [
            {"what": f.what, "granted": f.granted, "needed": f.fails or (
                f.granted and (f.use is None or f.use.needed) and bool(f.use and f.use.used_for)),
             "used_for": f.use.used_for if f.use else "", "without": f.use.without if f.use
             else "", "detail": f.detail} for f in findings]}, indent=1))
    else:
        print("\n".join(lines))
    return 0 if ok else 1


__all__ = ["FEATURES", "Finding", "LoadedProgram", "Use", "check", "helper_names", "helpers_of",
           "emit", "load_programs", "probe_helper", "probe_map", "report"]
