"""`testbed bench vllm --workload busy` without a server (the passes themselves run in
`make bench`): its summary reads vLLM's own results per pass over the loading servers, the
verdicts can fail, and the workload's options mix with the preset as given."""
import pytest

from testbed.bench.serve.vllm_busy import BUSY, PASSES, ROUNDS, TARGETS, busy_summary


def _row(mode, loads, fault, server, ttfts, itls, failed=0, texts=("a", "b"), rnd=0):
    return {"workload": "busy", "mode": mode, "loads": loads, "fault": fault, "server": server,
            "round": rnd,
            "vllm": {"ttfts": ttfts, "itls": [itls], "failed": failed,
                     "completed": len(ttfts), "mean_tpot_ms": 30.0,
                     "generated_texts": list(texts)},
            "connector_loads": {"failed": 0}}


def _rows(switch_ttft, switch_itl, failed=0, texts=("a", "b"), stall=1.0, stalls="pool-kill",
          local_ttft=(1.0, 1.0)):
    """Every pass's rows: vLLM alone's TTFT ``local_ttft[round]``, the switch's asynchronous
    loads ``switch_ttft`` times it (or ``switch_ttft[round]``; a fault pass: ``stall`` times
    more if it ``stalls``)."""
    rows = []
    for p in PASSES:
        fast = p.mode == "switch" and p.loads == "async"
        slow = stall if p.fault == stalls else 1.0   # that fault pass's stall, if any
        base = local_ttft[p.round]
        ratio = switch_ttft[p.round] if isinstance(switch_ttft, tuple) else switch_ttft
        for server in (0, 1):
            ttft = [base * ratio * slow] * 4 if fast and server else [base] * 4
            itl = [switch_itl] * 10 if fast and server else [0.05] * 10
            rows.append(_row(p.mode, p.loads, p.fault, server, ttft, itl,
                             failed if p.fault else 0, texts if p.fault else ("a", "b"),
                             p.round))
    return rows


def test_a_pass_that_loads_fast_without_stalling_meets_the_targets():
    s = busy_summary(_rows(switch_ttft=0.3, switch_itl=0.05))
    assert set(s["passes"]) == {"local", "pool-async", "switch-sync", "switch-async",
                                "switch-async-pool-kill", "switch-async-pool-hang"}
    assert s["ttft_p50_switch_over_local"] == 0.3 and s["itl_p99_switch_over_local"] == 1.0
    assert all(s["met"].values()) and s["targets"] == TARGETS
    assert [r["round"] for r in s["rounds"]] == [0, 1]


def test_vllm_alone_and_the_switch_alternate_and_each_round_is_its_own_ratio():
    """vLLM alone runs first and last, the switch's asynchronous loads second of the pair at the
    start and first at the end (A B ... B A); a round compares its own two passes: a box twice
    as slow in the second round gives the same ratio in each."""
    pairs = [(p.name, p.round) for p in PASSES if p.name in ("local", "switch-async")]
    assert pairs == [("local", 0), ("switch-async", 0), ("switch-async", 1), ("local", 1)]
    assert PASSES[0].name == "local" and PASSES[-1].name == "local" and ROUNDS == 2
    s = busy_summary(_rows(switch_ttft=0.45, switch_itl=0.05, local_ttft=(1.0, 2.0)))
    assert [r["ttft_p50_switch_over_local"] for r in s["rounds"]] == [0.45, 0.45]
    assert s["ttft_p50_switch_over_local"] == 0.45 and s["met"]["ttft_p50_switch_over_local"]
    assert [(r["local"]["ttft_p50_s"], r["switch-async"]["ttft_p50_s"]) for r in s["rounds"]] \
        == [(1.0, 0.45), (2.0, 0.9)]
    # the verdict is the rounds' median: one round at 0.45 and one at 0.65 miss 0.5 together
    s = busy_summary(_rows(switch_ttft=(0.45, 0.65), switch_itl=0.05))
    assert s["ttft_p50_switch_over_local"] == 0.55 and not s["met"]["ttft_p50_switch_over_local"]


@pytest.mark.parametrize("kw, unmet", [
    ({"switch_ttft": 0.8, "switch_itl": 0.05}, "ttft_p50_switch_over_local"),
    ({"switch_ttft": 0.3, "switch_itl": 0.07}, "itl_p99_switch_over_local"),
    ({"switch_ttft": 0.3, "switch_itl": 0.05, "failed": 1}, "no_failed_request"),
    ({"switch_ttft": 0.3, "switch_itl": 0.05, "texts": ("a", "c")}, "outputs_match"),
    ({"switch_ttft": 0.3, "switch_itl": 0.05, "stall": 3.0}, "ttft_p99_fault_over_no_fault"),
    ({"switch_ttft": 0.3, "switch_itl": 0.05, "stall": 3.0, "stalls": "pool-hang"},
     "ttft_p99_hang_over_no_fault"),
])
def test_every_verdict_can_fail(kw, unmet):
    s = busy_summary(_rows(**kw))
    assert [k for k, ok in s["met"].items() if not ok] == [unmet]


def test_busy_options_given_win_over_the_preset():
    from click.testing import CliRunner
    from testbed.cli import main
    r = CliRunner().invoke(main, ["bench", "vllm", "--workload", "busy", "--prompts", "4",
                                  "--servers", "1", "--json", ""])
    assert r.exit_code != 0                      # 4 prompts < the preset's 8 prefixes
    assert "--prompts (4) must be at least --prefixes (8)" in r.output
    assert BUSY.output_len > 8 and BUSY.rate > 0.25          # busier than the light workload
