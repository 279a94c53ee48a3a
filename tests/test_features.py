"""The kernel feature check (xdp/features.py, `switchd check`, `hostagent check`): the helper
table and bytecode scan and the verdict (pure Python), a program the kernel refuses reported in
one line naming the helper (bpf), and both checks on this kernel, naming bpf_xdp_adjust_meta as
refused or granted as the kernel says, and not used (e2e: they make namespaces of their own)."""
import json
import struct
import subprocess
import sys

import pytest

from xdp import NoXdp, features, libbpf
from xdp.features import Finding, Use, emit, helper_names, helpers_of, report
from xdp.loader import load_xdp

ADJUST_META = 54


def insn(code, dst=0, src=0, off=0, imm=0):
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def test_helper_names_read_either_form_of_the_mapper(tmp_path):
    old = tmp_path / "old.h"        # Linux 6.1: positional
    old.write_text("#define __BPF_FUNC_MAPPER(FN)\t\\\n\tFN(unspec),\t\\\n\tFN(map_lookup_elem),"
                   "\t\\\n\tFN(map_update_elem),\n\n")
    new = tmp_path / "new.h"        # Linux 6.2 on: explicit ids
    new.write_text("#define ___BPF_FUNC_MAPPER(FN, ctx...)\t\\\n\tFN(unspec, 0, ##ctx)\t\\\n"
                   "\tFN(xdp_adjust_meta, 54, ##ctx)\t\\\n\n")
    assert helper_names(old) == {0: "bpf_unspec", 1: "bpf_map_lookup_elem",
                                 2: "bpf_map_update_elem"}
    assert helper_names(new) == {0: "bpf_unspec", 54: "bpf_xdp_adjust_meta"}
    assert helper_names()[ADJUST_META] == "bpf_xdp_adjust_meta"      # this machine's header


def test_helpers_of_finds_helper_calls_only():
    prog = insn(0x85, imm=54) + insn(0xb7, 0, imm=2) + insn(0x85, src=1, imm=3) + insn(0x95)
    assert helpers_of(prog) == {54}                 # src_reg 1: a call to a BPF function


def test_a_verifier_log_becomes_one_line():
    log = ("0: R1=ctx() R10=fp0\n0: (85) call bpf_xdp_adjust_meta#54\nprogram of this type "
           "cannot use helper bpf_xdp_adjust_meta#54\nprocessed 22 insns (limit 1000000)\n")
    assert libbpf.refusal(log) == \
        "the kernel refuses helper bpf_xdp_adjust_meta (#54) to this program"
    assert libbpf.refusal("0: (79) r0 = *(u64 *)(r3 +0)\nR3 !read_ok\nprocessed 1 insns\n") == \
        "R3 !read_ok"


def test_the_verdict_fails_only_on_what_is_needed(capsys):
    ok = [Finding("helper bpf_xdp_adjust_meta", False, "refused", Use(
        "bpf_xdp_adjust_meta", "", "rides in the frame", needed=False)),
          Finding("map hash", True, "", Use("map hash", "maps of kv_ingress", ""))]
    lines, fine = report("switchd", ok)
    assert fine and lines[-1] == "switchd check: everything switchd needs is granted"
    assert "not used: rides in the frame" in lines[1] and lines[1].split()[0] == "refused"
    bad = ok + [Finding("devmap broadcast with egress programs", False, "0 of 2 copies",
                        Use("devmap broadcast with egress programs", "replication",
                            "--no-coalesce"))]
    lines, fine = report("switchd", bad)
    assert not fine and lines[-1] == ("switchd check: cannot run here: devmap broadcast with "
                                      "egress programs refused (0 of 2 copies)")
    assert "REFUSED" in lines[3] and "without it: --no-coalesce" in lines[3]
    assert emit("switchd", bad, as_json=True) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and [f["granted"] for f in out["findings"]] == [False, True, False]


@pytest.mark.bpf
def test_a_program_the_kernel_refuses_is_one_line_naming_the_helper(tmp_path, capfd):
    """XDP programs may never call bpf_skb_load_bytes (a socket buffer's helper): the load
    fails with one line naming it, and no verifier log reaches the terminal."""
    src = tmp_path / "refused.c"
    src.write_text("int refused(struct xdp_md *ctx) { __u32 x = 0; return "
                   "bpf_skb_load_bytes(ctx, 0, &x, 4) ? XDP_PASS : XDP_DROP; }\n")
    with pytest.raises(NoXdp) as err:
        load_xdp(src, ("refused",))
    message = str(err.value)
    assert "\n" not in message and "bpf_skb_load_bytes" in message, message
    assert "processed" not in capfd.readouterr().err


@pytest.mark.bpf
def test_the_adjust_meta_probe_agrees_with_a_load_of_a_program_that_calls_it(tmp_path):
    src = tmp_path / "meta.c"
    src.write_text("int meta(struct xdp_md *ctx) { return bpf_xdp_adjust_meta(ctx, -8) ? "
                   "XDP_DROP : XDP_PASS; }\n")
    granted, why = features.probe_helper(ADJUST_META)
    if granted:
        load_xdp(src, ("meta",))[0].cleanup()
    else:
        with pytest.raises(NoXdp, match="refuses helper bpf_xdp_adjust_meta"):
            load_xdp(src, ("meta",))


@pytest.mark.e2e
@pytest.mark.parametrize("box", ["switchd", "hostagent"])
def test_each_box_checks_this_kernel(box):
    r = subprocess.run([sys.executable, "-m", box, "check", "--json"], capture_output=True,
                       text=True, timeout=120)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvprobe" not in left, "a probe left its namespace behind"
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads(r.stdout)
    found = {f["what"]: f for f in out["findings"]}
    meta = found["helper bpf_xdp_adjust_meta"]
    assert meta["used_for"] == "" and meta["granted"] == features.probe_helper(ADJUST_META)[0]
    assert found["BPF_PROG_TEST_RUN live frames"]["used_for"] == ""
    programs = [w for w in found if w.startswith("program ")]
    assert programs and all(found[p]["granted"] for p in programs)
    if box == "switchd":
        assert found["devmap broadcast with egress programs"]["granted"]
