"""A short fuzzing run in every test pass (`testbed fuzz` runs the long one): random and mutated
frames through the data plane never break its invariants, and the reference that judges them
does catch a wrong answer."""
import pytest

from testbed.fuzz import reference_parse, reference_reply, run_fuzz

pytestmark = pytest.mark.bpf


def test_short_fuzz_run_finds_no_violation():
    result = run_fuzz(4000, seed=7, log=lambda *_: None)
    assert result["violations"] == 0, result["examples"]
    assert result["valid"] > 1000 and result["invalid"] > 600 and result["tx"] > 100
    assert result["port_drops"] > 300 and result["reply_drops"] > 300
    counters = result["counters"]
    assert counters["malformed"] == result["invalid"] and counters["non_kv"] == result["not_kv"]
    assert counters["spoofed"] + counters["unchecked"] + counters["denied"] == result["port_drops"]
    assert counters["not_from_pool"] == result["reply_drops"]


def test_reference_rejects_what_the_switch_must_not_answer():
    from testbed.fuzz import HOST_IP, MACS, POOL_IP, build, kv
    from kvproto import Op, PORT
    frame = build(MACS[0], MACS[1], HOST_IP, POOL_IP, 40000, PORT, kv(Op.GET, 1, b"k" * 16, 0,
                                                                      room=64))
    ref = reference_parse(frame)
    assert isinstance(ref, dict) and ref["len"] == 64
    assert reference_parse(frame[:-1]) == "bad"
    assert reference_parse(frame[:12] + b"\x86\xdd" + frame[14:]) is None
    good = reference_reply(frame, ref, b"abc", 1)
    assert good != reference_reply(frame, ref, b"abd", 1)
