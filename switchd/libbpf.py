"""ctypes bindings for the few libbpf calls BCC 0.26 has no Python binding for: opening a pinned
object, reading a map's info, and BPF_PROG_TEST_RUN (used by the unit tests, the fuzzer and the
live-frames traffic generator). libbpf.so.1 comes from Debian's libbpf1."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1

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


_lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(TestRunOpts)]
_lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
_lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_uint32)]


def check_ret(ret: int, what: str) -> int:
    """A libbpf return value, or OSError(errno, "what: reason") for a negative one."""
    if ret < 0:
        err = ctypes.get_errno() or -ret
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def map_info_by_fd(fd: int, what: str = "a map") -> MapInfo:
    """Id, type, key/value size and capacity of an open map."""
    info = MapInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check_ret(_lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)),
           f"reading info of {what}")
    return info


def map_info(path: str) -> MapInfo:
    """Id, type, key/value size and capacity of the map pinned at ``path``."""
    fd = check_ret(_lib.bpf_obj_get(path.encode()), f"opening pinned map {path}")
    try:
        return map_info_by_fd(fd, path)
    finally:
        os.close(fd)


def xdp_test_run(prog_fd: int, frame: bytes, *, ifindex: int = 0, repeat: int = 1,
             out_room: int = 4096) -> tuple[int, bytes]:
    """Run an XDP program once on ``frame``; returns (verdict, frame as the program left it)."""
    data_in = ctypes.create_string_buffer(frame, len(frame))
    data_out = ctypes.create_string_buffer(len(frame) + out_room)
    ctx = XdpMd(data=0, data_end=len(frame), ingress_ifindex=ifindex)
    opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts),
                       data_in=ctypes.cast(data_in, ctypes.c_void_p).value,
                       data_out=ctypes.cast(data_out, ctypes.c_void_p).value,
                       data_size_in=len(frame), data_size_out=len(data_out),
                       repeat=repeat)
    if ifindex:
        opts.ctx_in = ctypes.addressof(ctx)
        opts.ctx_size_in = ctypes.sizeof(ctx)
    check_ret(_lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    return opts.retval, data_out.raw[:opts.data_size_out]


def live_frames(prog_fd: int, frame: bytes, ifindex: int, repeat: int,
                batch_size: int = 0) -> float:
    """Transmit what the program makes of ``frame``, ``repeat`` times, out of ``ifindex`` (the
    program returns XDP_TX). Returns the kernel-measured seconds."""
    data_in = ctypes.create_string_buffer(frame, len(frame))
    ctx = XdpMd(data=0, data_end=len(frame), ingress_ifindex=ifindex)
    opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts),
                       data_in=ctypes.cast(data_in, ctypes.c_void_p).value,
                       data_size_in=len(frame), ctx_in=ctypes.addressof(ctx),
                       ctx_size_in=ctypes.sizeof(ctx), repeat=repeat,
                       flags=BPF_F_TEST_XDP_LIVE_FRAMES, batch_size=batch_size)
    check_ret(_lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN (live)")
    return opts.duration * repeat / 1e9
