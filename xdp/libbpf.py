"""The one ctypes binding of libbpf (Debian's libbpf1, libbpf.so.1) for what BCC 0.26 has no
Python binding for: creating maps and loading a program from bytecode, reading and writing map
entries, map and program info, pinning and opening pinned objects, attaching/detaching XDP through
``bpf_xdp_attach`` (with ``XDP_FLAGS_REPLACE``: never clobbering a program attached meanwhile;
the kernel's reason for a refusal is kept, not printed), and BPF_PROG_TEST_RUN (the XDP tests,
the fuzzer, the live-frames traffic generator and the fetch engine's send ring)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re

BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1
XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE, XDP_FLAGS_REPLACE = 1 << 1, 1 << 2, 1 << 4
MODE_FLAGS = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}
BPF_PROG_TYPE_XDP, BPF_XDP_DEVMAP = 6, 33
BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_DEVMAP = 2, 6, 14
BPF_F_MMAPABLE = 1 << 10

_lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)


class TestRunOpts(ctypes.Structure):
    """struct bpf_test_run_opts as of libbpf 1.1."""
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


class XdpMd(ctypes.Structure):
    """struct xdp_md, the XDP program context (for ctx_in)."""
    _fields_ = [(name, ctypes.c_uint32) for name in (
        "data", "data_end", "data_meta", "ingress_ifindex", "rx_queue_index", "egress_ifindex")]


class MapInfo(ctypes.Structure):
    """The leading fields of struct bpf_map_info (the kernel fills what fits)."""
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class _ProgInfo(ctypes.Structure):
    """The leading fields of struct bpf_prog_info (the kernel fills what fits)."""
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", ctypes.c_uint32),
                ("xlated_prog_len", ctypes.c_uint32), ("jited_prog_insns", ctypes.c_uint64),
                ("xlated_prog_insns", ctypes.c_uint64), ("load_time", ctypes.c_uint64),
                ("created_by_uid", ctypes.c_uint32), ("nr_map_ids", ctypes.c_uint32),
                ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16)]


class _MapCreateOpts(ctypes.Structure):
    """struct bpf_map_create_opts (libbpf 1.1)."""
    _fields_ = [("sz", ctypes.c_size_t), ("btf_fd", ctypes.c_uint32),
                ("btf_key_type_id", ctypes.c_uint32), ("btf_value_type_id", ctypes.c_uint32),
                ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("inner_map_fd", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("map_extra", ctypes.c_uint64), ("numa_node", ctypes.c_uint32),
                ("map_ifindex", ctypes.c_uint32)]


class _ProgLoadOpts(ctypes.Structure):
    """struct bpf_prog_load_opts up to the verifier's log (libbpf 1.1; sz says how many)."""
    _fields_ = [("sz", ctypes.c_size_t), ("attempts", ctypes.c_int),
                ("expected_attach_type", ctypes.c_int), ("prog_btf_fd", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("prog_ifindex", ctypes.c_uint32),
                ("kern_version", ctypes.c_uint32), ("attach_btf_id", ctypes.c_uint32),
                ("attach_btf_obj_fd", ctypes.c_uint32), ("attach_prog_fd", ctypes.c_uint32),
                ("fd_array", ctypes.c_void_p), ("func_info", ctypes.c_void_p),
                ("func_info_cnt", ctypes.c_uint32), ("func_info_rec_size", ctypes.c_uint32),
                ("line_info", ctypes.c_void_p), ("line_info_cnt", ctypes.c_uint32),
                ("line_info_rec_size", ctypes.c_uint32), ("log_level", ctypes.c_uint32),
                ("log_size", ctypes.c_uint32), ("log_buf", ctypes.c_void_p)]


class _XdpAttachOpts(ctypes.Structure):
    """struct bpf_xdp_attach_opts."""
    _fields_ = [("sz", ctypes.c_size_t), ("old_prog_fd", ctypes.c_int), ("_pad", ctypes.c_int)]


_lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(TestRunOpts)]
_lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
_lib.bpf_obj_pin.argtypes = [ctypes.c_int, ctypes.c_char_p]
_lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_uint32)]
_lib.bpf_map_create.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32,
                                ctypes.c_uint32, ctypes.c_uint32,
                                ctypes.POINTER(_MapCreateOpts)]
_lib.bpf_prog_load.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_void_p]
_lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_lib.bpf_map_update_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_uint64]
_lib.bpf_xdp_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                                ctypes.POINTER(_XdpAttachOpts)]
_lib.bpf_xdp_query_id.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
_lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint32]
_lib.bpf_map_get_fd_by_id.argtypes = [ctypes.c_uint32]


def check_ret(ret: int, what: str) -> int:
    """A libbpf return value, or OSError(errno, "what: reason") for a negative one."""
    if ret < 0:
        err = ctypes.get_errno() or -ret
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


# ---- maps and programs -------------------------------------------------------------------------
def map_create(name: str, map_type: int, key_size: int, value_size: int, max_entries: int,
               flags: int = 0) -> int:
    opts = _MapCreateOpts(sz=ctypes.sizeof(_MapCreateOpts), map_flags=flags)
    return check_ret(_lib.bpf_map_create(map_type, name.encode(), key_size, value_size,
                                         max_entries, ctypes.byref(opts)), f"creating map {name}")


def prog_load_xdp(name: str, insns: bytes, license: str = "GPL", attach_type: int = 0,
                  prog_flags: int = 0) -> int:
    """Load (and verify) an XDP program from its bytecode, map references already resolved
    (``attach_type``: BPF_XDP_DEVMAP for a program run on devmap redirects). A refusal is an
    OSError whose message ends with the verifier's reason in one line (``refusal``)."""
    buf = ctypes.create_string_buffer(insns, len(insns))

    def load(log=None) -> int:
        opts = _ProgLoadOpts(sz=ctypes.sizeof(_ProgLoadOpts), expected_attach_type=attach_type,
                             prog_flags=prog_flags)
        if log is not None:
            opts.log_level, opts.log_size, opts.log_buf = 1, len(log), ctypes.addressof(log)
        return _lib.bpf_prog_load(BPF_PROG_TYPE_XDP, name.encode(), license.encode(), buf,
                                  len(insns) // 8, ctypes.byref(opts))

    fd = load()
    if fd >= 0:
        return fd
    err = ctypes.get_errno() or -fd
    log = ctypes.create_string_buffer(1 << 22)
    fd = load(log)                    # again, for the verifier's log (a retry may even pass)
    if fd >= 0:
        return fd
    why = refusal(log.value.decode(errors="replace"))
    raise OSError(err, f"loading program {name}: {os.strerror(err)}" + (f": {why}" if why else ""))


_HELPER_REFUSED = re.compile(r"(?:program of this type cannot use helper|unknown func) "
                             r"(\w+)#(\d+)")
_HELPER_UNKNOWN = re.compile(r"invalid func unknown#(\d+)")


def refusal(log: str) -> str:
    """The verifier's reason for refusing a program, in one line: the helper the kernel does not
    grant, else the log's last line that is not its statistics."""
    m = _HELPER_REFUSED.search(log)
    if m:
        return f"the kernel refuses helper {m.group(1)} (#{m.group(2)}) to this program"
    m = _HELPER_UNKNOWN.search(log)
    if m:
        return f"the kernel does not know helper #{m.group(1)}"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("processed ", "verification time"))]
    return lines[-1][:200] if lines else ""


def map_lookup(fd: int, key: int, value_size: int) -> bytes:
    """The value under a u32 key (per-CPU maps: every CPU's, value_size rounded up to 8 each)."""
    k, v = ctypes.c_uint32(key), ctypes.create_string_buffer(value_size)
    check_ret(_lib.bpf_map_lookup_elem(fd, ctypes.byref(k), v), "reading a map entry")
    return v.raw


def map_update(fd: int, key: int, value: bytes) -> None:
    k, v = ctypes.c_uint32(key), ctypes.create_string_buffer(value, len(value))
    check_ret(_lib.bpf_map_update_elem(fd, ctypes.byref(k), v, 0), "writing a map entry")


def map_info(fd: int, what: str = "a map") -> MapInfo:
    """Id, type, key/value size and capacity of an open map."""
    info = MapInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check_ret(_lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)),
              f"reading info of {what}")
    return info


def obj_get(path: str) -> int:
    """An fd of the object pinned at ``path``."""
    return check_ret(_lib.bpf_obj_get(path.encode()), f"opening pinned map {path}")


def obj_pin(fd: int, path: str) -> None:
    check_ret(_lib.bpf_obj_pin(fd, path.encode()), f"pinning {path}")


def pinned_map_info(path: str) -> MapInfo:
    """Id, type, key/value size and capacity of the map pinned at ``path``."""
    fd = obj_get(path)
    try:
        return map_info(fd, path)
    finally:
        os.close(fd)


def prog_fd_by_id(prog_id: int) -> int:
    return check_ret(_lib.bpf_prog_get_fd_by_id(prog_id), f"opening program id {prog_id}")


def _prog_info(fd: int, nmaps: int) -> tuple[_ProgInfo, list[int]]:
    ids = (ctypes.c_uint32 * nmaps)()
    info = _ProgInfo(nr_map_ids=nmaps, map_ids=ctypes.addressof(ids))
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check_ret(_lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)),
              "reading program info")
    return info, list(ids[:min(nmaps, info.nr_map_ids)])


def prog_info(fd: int, nmaps: int = 16) -> tuple[str, list[int]]:
    """Name and map ids of a loaded program."""
    info, ids = _prog_info(fd, nmaps)
    return info.name.decode(errors="replace"), ids


def prog_tag(fd: int) -> bytes:
    """The kernel's tag of a loaded program: a hash of its instructions with map references
    left out, so the same program on other maps has the same tag."""
    return bytes(_prog_info(fd, 0)[0].tag)


def prog_map(prog_fd: int, name: str) -> tuple[int, MapInfo] | None:
    """An fd (the caller closes it) and the info of the program's map called ``name``."""
    for mid in prog_info(prog_fd)[1]:
        fd = check_ret(_lib.bpf_map_get_fd_by_id(mid), "opening a map by id")
        info = map_info(fd)
        if info.name.decode(errors="replace") == name:
            return fd, info
        os.close(fd)
    return None


# ---- attaching ---------------------------------------------------------------------------------
def attached_id(ifindex: int, mode: str = "native") -> int:
    """Id of the XDP program attached to ``ifindex`` in ``mode`` (this thread's namespace);
    0: none."""
    pid = ctypes.c_uint32(0)
    check_ret(_lib.bpf_xdp_query_id(ifindex, MODE_FLAGS[mode], ctypes.byref(pid)),
              "querying XDP")
    return pid.value


# libbpf's messages (e.g. the kernel's reason for refusing an attach) are kept, not printed
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_lib.libbpf_set_print.argtypes = [_PRINT_FN]
_lib.libbpf_set_print.restype = ctypes.c_void_p
_libc = ctypes.CDLL(None)
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
_messages: list[str] = []


@_PRINT_FN
def _keep_message(level: int, fmt: bytes, args: int) -> int:
    buf = ctypes.create_string_buffer(512)
    _libc.vsnprintf(buf, len(buf), fmt, args)        # va_list: a pointer on x86-64 and arm64
    _messages.append(buf.value.decode(errors="replace").strip())
    return 0


def xdp_attach(ifindex: int, prog_fd: int, old_fd: int | None = None,
               mode: str = "native") -> None:
    """Attach ``prog_fd`` (-1: detach) in ``mode``; with ``old_fd``, only if that program is
    still the one there. A refusal's OSError carries the kernel's reason (libbpf's message),
    nothing is printed."""
    opts = _XdpAttachOpts(sz=ctypes.sizeof(_XdpAttachOpts), old_prog_fd=old_fd or 0)
    flags = MODE_FLAGS[mode] | (XDP_FLAGS_REPLACE if old_fd else 0)
    _messages.clear()
    old = _lib.libbpf_set_print(_keep_message)
    try:
        ret = _lib.bpf_xdp_attach(ifindex, prog_fd, flags, ctypes.byref(opts))
    finally:
        _lib.libbpf_set_print(ctypes.cast(old, _PRINT_FN) if old else _PRINT_FN())
    why = [m.removeprefix("libbpf: Kernel error message: ") for m in _messages
           if "Kernel error message" in m]
    check_ret(ret, ("attaching XDP" if prog_fd >= 0 else "detaching XDP") +
              (f" ({why[-1]})" if why else ""))


# ---- running -----------------------------------------------------------------------------------
def xdp_test_run(prog_fd: int, frame: bytes, *, meta: bytes = b"", ifindex: int = 0,
                 repeat: int = 1, out_room: int = 4096) -> tuple[int, bytes]:
    """Run an XDP program on ``meta`` (XDP metadata, a multiple of 4, at most 32 bytes) +
    ``frame`` (received on ``ifindex`` if given); returns (verdict, the frame as the program
    left it)."""
    buf = meta + frame
    data_in = ctypes.create_string_buffer(buf, len(buf))
    data_out = ctypes.create_string_buffer(len(buf) + out_room)
    ctx = XdpMd(data=len(meta), data_end=len(buf), ingress_ifindex=ifindex)
    opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_in=ctypes.addressof(data_in),
                       data_out=ctypes.addressof(data_out), data_size_in=len(buf),
                       data_size_out=len(data_out), repeat=repeat)
    if ifindex or meta:
        opts.ctx_in, opts.ctx_size_in = ctypes.addressof(ctx), ctypes.sizeof(ctx)
    check_ret(_lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    return opts.retval, data_out.raw[:opts.data_size_out]


class XdpRunner:
    """Runs one XDP program on frame after frame (up to ``room`` bytes), reusing its buffers: a
    command channel to a program (e.g. switchd's slot writer) at a few microseconds a call.
    ``run`` returns the program's verdict; the frame it leaves is not copied out."""

    def __init__(self, prog_fd: int, room: int = 4096):
        self.fd, self.buf = prog_fd, ctypes.create_string_buffer(room)
        self.opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_in=ctypes.addressof(self.buf))

    def run(self, frame: bytes) -> int:
        ctypes.memmove(self.buf, frame, len(frame))
        self.opts.data_size_in, self.opts.data_size_out = len(frame), 0
        check_ret(_lib.bpf_prog_test_run_opts(self.fd, ctypes.byref(self.opts)),
                  "BPF_PROG_TEST_RUN")
        return self.opts.retval


def live_frames(prog_fd: int, frame: bytes, ifindex: int, repeat: int, batch_size: int = 0,
                meta: bytes = b"") -> float:
    """Transmit what the program makes of ``meta`` + ``frame`` out of ``ifindex``, ``repeat``
    times (the frames it returns XDP_TX for). Returns the kernel-measured seconds."""
    buf = meta + frame
    data_in = ctypes.create_string_buffer(buf, len(buf))
    ctx = XdpMd(data=len(meta), data_end=len(buf), ingress_ifindex=ifindex)
    opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_in=ctypes.addressof(data_in),
                       data_size_in=len(buf), ctx_in=ctypes.addressof(ctx),
                       ctx_size_in=ctypes.sizeof(ctx), repeat=repeat,
                       flags=BPF_F_TEST_XDP_LIVE_FRAMES, batch_size=batch_size)
    check_ret(_lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN (live)")
    return opts.duration * repeat / 1e9
