"""The kernel calls the fetch engine makes through libbpf (ctypes), beyond switchd.libbpf's:
creating maps and loading a program from bytecode (so a compiled program is reused without BCC),
reading and writing map entries, attaching to an interface in native mode with an expected old
program (``XDP_FLAGS_REPLACE``: never clobbering one attached meanwhile), reading a program's
name and maps, and BPF_PROG_TEST_RUN with XDP metadata (the generator's nonce). libbpf.so.1 is
Debian's libbpf1."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from switchd.libbpf import (BPF_F_TEST_XDP_LIVE_FRAMES, MapInfo, TestRunOpts, XdpMd, check_ret,
                            map_info_by_fd)

XDP_FLAGS_REPLACE, XDP_FLAGS_DRV_MODE = 1 << 4, 1 << 2
BPF_PROG_TYPE_XDP = 6
BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PERCPU_ARRAY = 2, 6
BPF_F_MMAPABLE = 1 << 10

_lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)


class _MapCreateOpts(ctypes.Structure):
    """struct bpf_map_create_opts (libbpf 1.1)."""
    _fields_ = [("sz", ctypes.c_size_t), ("btf_fd", ctypes.c_uint32),
                ("btf_key_type_id", ctypes.c_uint32), ("btf_value_type_id", ctypes.c_uint32),
                ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("inner_map_fd", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("map_extra", ctypes.c_uint64), ("numa_node", ctypes.c_uint32),
                ("map_ifindex", ctypes.c_uint32)]


class _XdpAttachOpts(ctypes.Structure):
    """struct bpf_xdp_attach_opts."""
    _fields_ = [("sz", ctypes.c_size_t), ("old_prog_fd", ctypes.c_int), ("_pad", ctypes.c_int)]


class _ProgInfo(ctypes.Structure):
    """The leading fields of struct bpf_prog_info (the kernel fills what fits)."""
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", ctypes.c_uint32),
                ("xlated_prog_len", ctypes.c_uint32), ("jited_prog_insns", ctypes.c_uint64),
                ("xlated_prog_insns", ctypes.c_uint64), ("load_time", ctypes.c_uint64),
                ("created_by_uid", ctypes.c_uint32), ("nr_map_ids", ctypes.c_uint32),
                ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16)]


_lib.bpf_map_create.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32,
                                ctypes.c_uint32, ctypes.c_uint32,
                                ctypes.POINTER(_MapCreateOpts)]
_lib.bpf_prog_load.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_void_p]
_lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_lib.bpf_map_update_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_uint64]
_lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(TestRunOpts)]
_lib.bpf_xdp_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                                ctypes.POINTER(_XdpAttachOpts)]
_lib.bpf_xdp_detach.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]
_lib.bpf_xdp_query_id.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
_lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint32]
_lib.bpf_map_get_fd_by_id.argtypes = [ctypes.c_uint32]
_lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_uint32)]


# ---- maps and programs -------------------------------------------------------------------------
def map_create(name: str, map_type: int, key_size: int, value_size: int, max_entries: int,
               flags: int = 0) -> int:
    opts = _MapCreateOpts(sz=ctypes.sizeof(_MapCreateOpts), map_flags=flags)
    return check_ret(_lib.bpf_map_create(map_type, name.encode(), key_size, value_size, max_entries,
                                      ctypes.byref(opts)), f"creating map {name}")


def prog_load_xdp(name: str, insns: bytes, license: str = "GPL") -> int:
    """Load (and verify) an XDP program from its bytecode, map references already resolved."""
    buf = ctypes.create_string_buffer(insns, len(insns))
    return check_ret(_lib.bpf_prog_load(BPF_PROG_TYPE_XDP, name.encode(), license.encode(), buf,
                                     len(insns) // 8, None), f"loading program {name}")


def map_lookup(fd: int, key: int, value_size: int) -> bytes:
    """The value under a u32 key (per-CPU maps: every CPU's, value_size rounded up to 8 each)."""
    k, v = ctypes.c_uint32(key), ctypes.create_string_buffer(value_size)
    check_ret(_lib.bpf_map_lookup_elem(fd, ctypes.byref(k), v), "reading a map entry")
    return v.raw


def map_update(fd: int, key: int, value: bytes) -> None:
    k, v = ctypes.c_uint32(key), ctypes.create_string_buffer(value, len(value))
    check_ret(_lib.bpf_map_update_elem(fd, ctypes.byref(k), v, 0), "writing a map entry")


def map_info(fd: int) -> MapInfo:
    return map_info_by_fd(fd)


def prog_fd_by_id(prog_id: int) -> int:
    return check_ret(_lib.bpf_prog_get_fd_by_id(prog_id), f"opening program id {prog_id}")


def prog_info(fd: int, nmaps: int = 16) -> tuple[str, list[int]]:
    """Name and map ids of a loaded program."""
    ids = (ctypes.c_uint32 * nmaps)()
    info = _ProgInfo(nr_map_ids=nmaps, map_ids=ctypes.addressof(ids))
    size = ctypes.c_uint32(ctypes.sizeof(info))
    check_ret(_lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)),
           "reading program info")
    return info.name.decode(errors="replace"), list(ids[:min(nmaps, info.nr_map_ids)])


def prog_map(prog_fd: int, name: str) -> tuple[int, MapInfo] | None:
    """An fd (the caller closes it) and the info of the program's map called ``name``."""
    for mid in prog_info(prog_fd)[1]:
        fd = check_ret(_lib.bpf_map_get_fd_by_id(mid), "opening a map by id")
        info = map_info_by_fd(fd)
        if info.name.decode(errors="replace") == name:
            return fd, info
        os.close(fd)
    return None


# ---- attaching ---------------------------------------------------------------------------------
def attached_id(ifindex: int) -> int:
    """Id of the native-mode XDP program on ``ifindex`` (in this thread's namespace); 0: none."""
    pid = ctypes.c_uint32(0)
    check_ret(_lib.bpf_xdp_query_id(ifindex, XDP_FLAGS_DRV_MODE, ctypes.byref(pid)),
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


def xdp_attach(ifindex: int, prog_fd: int, old_fd: int | None) -> None:
    """Attach in native mode; with ``old_fd``, only if that program is still the one there.
    A refusal's OSError carries the kernel's reason (libbpf's message), nothing is printed."""
    opts = _XdpAttachOpts(sz=ctypes.sizeof(_XdpAttachOpts), old_prog_fd=old_fd or 0)
    flags = XDP_FLAGS_DRV_MODE | (XDP_FLAGS_REPLACE if old_fd else 0)
    _messages.clear()
    old = _lib.libbpf_set_print(_keep_message)
    try:
        ret = _lib.bpf_xdp_attach(ifindex, prog_fd, flags, ctypes.byref(opts))
    finally:
        _lib.libbpf_set_print(ctypes.cast(old, _PRINT_FN) if old else _PRINT_FN())
    why = [m.removeprefix("libbpf: Kernel error message: ") for m in _messages
           if "Kernel error message" in m]
    check_ret(ret, "attaching XDP" + (f" ({why[-1]})" if why else ""))


def xdp_detach(ifindex: int) -> None:
    check_ret(_lib.bpf_xdp_detach(ifindex, XDP_FLAGS_DRV_MODE, None), "detaching XDP")


# ---- running -----------------------------------------------------------------------------------
def prog_test_run(prog_fd: int, frame: bytes, *, meta: bytes = b"", ifindex: int = 0,
             live: bool = False, repeat: int = 1, batch_size: int = 0,
             out_room: int = 256) -> tuple[int, bytes]:
    """BPF_PROG_TEST_RUN of an XDP program on ``meta`` (XDP metadata, a multiple of 4, at most
    32 bytes) + ``frame``. Live: the frames the program returns XDP_TX for are sent out of
    ``ifindex`` (returns (0, b"")); else (verdict, the frame as the program left it)."""
    buf = meta + frame
    data_in = ctypes.create_string_buffer(buf, len(buf))
    ctx = XdpMd(data=len(meta), data_end=len(buf), ingress_ifindex=ifindex)
    opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_in=ctypes.addressof(data_in),
                       data_size_in=len(buf), ctx_in=ctypes.addressof(ctx),
                       ctx_size_in=ctypes.sizeof(ctx), repeat=repeat)
    data_out = None
    if live:
        opts.flags, opts.batch_size = BPF_F_TEST_XDP_LIVE_FRAMES, batch_size
    else:
        data_out = ctypes.create_string_buffer(len(buf) + out_room)
        opts.data_out, opts.data_size_out = ctypes.addressof(data_out), len(data_out)
    check_ret(_lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    if live:
        return 0, b""
    return opts.retval, data_out.raw[:opts.data_size_out]
