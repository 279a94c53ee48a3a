"""`testbed results-check` (testbed.provenance): what counts as a change to the code a result
measures, on throwaway git repositories: stamps, the table for results without one, the
Results-unaffected trailer."""
import json
import subprocess
from pathlib import Path

from click.testing import CliRunner

from testbed.provenance import check, render
from testbed.provenance.compare import Counter, code_lines

BENCH = "python -m app.bench"          # the command that makes the test repositories' results
TABLE = [("fetch*", BENCH), ("throughput*", BENCH), ("sim-*", BENCH)]


def test_docstrings_comments_imports_and_layout_are_not_code():
    a = '"""Doc."""\nimport os\n\ndef f(x):\n    """Say."""\n    # why\n    return x + 1\n'
    b = 'from os import path\n\n\ndef f(x):\n    return (x +\n            1)   # reworded\n'
    assert code_lines(a, "m.py") == code_lines(b, "m.py") == Counter({"def f(x):": 1,
                                                                     "return x + 1": 1})
    c1 = "#include <a.h>\n/* one */ int f(void) { return 1; } // two\n"
    assert code_lines(c1, "p.c") == code_lines("int f(void) {  return 1; }\n", "p.h")
    assert code_lines("int f(void) { return 2; }", "p.c") != code_lines(c1, "p.c")
    # a file's chosen top-level statements alone (the module docstring is statement 0)
    assert code_lines(a + "X = 2\n", "m.py", frozenset({3})) == Counter({"X = 2": 1})


def run(repo: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    if not (repo / ".git").exists():
        run(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    run(repo, "add", "-A")
    run(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return run(repo, "rev-parse", "HEAD").strip()


def statuses(repo: Path, **kw) -> dict[str, str]:
    return {f.name: f.status for f in check(repo, table=TABLE, **kw)}


BENCH_PY = "from app.server import serve, helper\n\n\ndef main():\n" \
           "    print(serve(helper()))\n\n\nif __name__ == '__main__':\n    main()\n"
SERVER = "def serve(x):\n    return x * 2\n\n\ndef helper():\n    return 3\n\n\n" \
         "def unused():\n    return 0\n"


def test_a_result_is_stale_only_when_a_statement_it_runs_changed(tmp_path):
    commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY, "app/server.py": SERVER,
                      "docs/a.md": "see fetch.json\n",
                      "README.md": "[t](bench/results/throughput.json), gone.json\n"}, "code")
    commit(tmp_path, {"bench/results/fetch.json": "{}", "bench/results/throughput.json": "{}"},
           "results")
    by_name = {f.name: f for f in check(tmp_path, table=TABLE)}
    assert set(by_name) == {"fetch.json", "throughput.json"}        # gone.json: not a result
    f = by_name["fetch.json"]
    assert (f.status, f.basis, f.command) == ("fresh", "written", BENCH)
    # a function the benchmark never calls is not what it measures
    commit(tmp_path, {"app/server.py": SERVER.replace("return 0", "return 1")}, "unused")
    assert statuses(tmp_path)["fetch.json"] == "fresh"
    # moved into other modules, with a new docstring: still fresh
    run(tmp_path, "mv", "app/server.py", "app/serving.py")
    commit(tmp_path, {"app/serving.py": '"""Moved."""\ndef serve(x):\n    return x * 2\n',
                      "app/util.py": "def helper():\n    return 3\n",
                      "app/bench.py": BENCH_PY.replace("from app.server import serve, helper",
                                                       "from .serving import serve\n"
                                                       "from .util import helper")}, "move")
    assert statuses(tmp_path)["fetch.json"] == "fresh"
    commit(tmp_path, {"app/util.py": "def helper():\n    return 4\n"}, "change")
    f = {f.name: f for f in check(tmp_path, table=TABLE)}["fetch.json"]
    assert (f.status, f.changed_lines) == ("stale", 2)       # 'return 3' out, 'return 4' in
    assert f.changed_files == ["app/server.py", "app/util.py"]
    (tmp_path / "docs/a.md").write_text("see fetch.json and bench/results/missing.json\n")
    assert statuses(tmp_path)["missing.json"] == "missing"
    # a before/after kept as history is dated, whatever changed since
    commit(tmp_path, {"bench/results/serve-burst-ab.json": "{}",
                      "docs/a.md": "see fetch.json and serve-burst-ab.json\n"}, "dated")
    commit(tmp_path, {"app/util.py": "def helper():\n    return 5\n"}, "again")
    assert statuses(tmp_path)["serve-burst-ab.json"] == "dated"
    # a result no command is known for
    commit(tmp_path, {"bench/results/other.json": "{}", "docs/b.md": "other.json\n"}, "other")
    f = {f.name: f for f in check(tmp_path, table=TABLE)}["other.json"]
    assert f.status == "unmapped" and "MADE_BY" in f.problem


def test_a_plot_drawn_again_byte_for_byte_is_as_fresh_as_its_json(tmp_path):
    """A rerun whose plot comes out the same bytes leaves git nothing to record in the PNG:
    it counts as written with the JSON its Makefile command writes beside it."""
    commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY, "app/server.py": SERVER,
                      "Makefile": "sim:\n\ttestbed sim sweep --json bench/results/sim-sweep.json"
                                  " \\\n\t  --plot bench/results/sim-breakeven.png\n",
                      "docs/a.md": "see sim-breakeven.png\n", "README.md": "r\n",
                      "bench/results/sim-sweep.json": '{"wall": 1}',
                      "bench/results/sim-breakeven.png": "png"}, "first run")
    commit(tmp_path, {"app/server.py": SERVER.replace("x * 2", "x * 3")}, "change")
    assert statuses(tmp_path)["sim-breakeven.png"] == "stale"
    commit(tmp_path, {"bench/results/sim-sweep.json": '{"wall": 2}'}, "rerun, same plot")
    assert statuses(tmp_path)["sim-breakeven.png"] == "fresh"


def stamped(commit_sha: str | None, command: str = BENCH, clean: bool = True) -> str:
    return json.dumps({"measured": {"commit": commit_sha, "clean": clean, "kernel": "6.1",
                                    "command": command}, "rate": 1})


def test_a_stamp_says_which_commit_and_command_made_a_result(tmp_path):
    """The stamp's commit, not the commit that wrote the file, is what the code is compared
    from; its command, not the table, says what code that is."""
    made = commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY,
                             "app/server.py": SERVER, "README.md": "fetch.json, sim-x.json\n"},
                  "code")
    commit(tmp_path, {"app/server.py": SERVER.replace("x * 2", "x * 3")}, "after the run")
    commit(tmp_path, {"bench/results/fetch.json": stamped(made),
                      "bench/results/sim-x.json": stamped(made, clean=False)}, "results")
    f = {f.name: f for f in check(tmp_path, table=[])}
    assert (f["fetch.json"].status, f["fetch.json"].basis) == ("stale", "stamp")
    assert f["fetch.json"].made_on == made[:len(f["fetch.json"].made_on)]
    assert f["fetch.json"].changed_files == ["app/server.py"]
    # made with uncommitted changes: the code it ran is taken as the code committed with it
    assert f["sim-x.json"].status == "fresh" and f["sim-x.json"].basis.startswith("written")
    # a command naming what is not there
    commit(tmp_path, {"bench/results/fetch.json": stamped(made, "python -m app.gone")}, "gone")
    f = {f.name: f for f in check(tmp_path, table=[])}["fetch.json"]
    assert (f.status, f.problem) == ("unmapped", "python -m app.gone: no module app.gone now")


def test_unstamped_results_fail_once_stamps_are_required(tmp_path):
    made = commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY,
                             "app/server.py": SERVER,
                             "README.md": "fetch.json throughput.json serve-burst-ab.json\n"},
                  "code")
    commit(tmp_path, {"bench/results/fetch.json": stamped(made),
                      "bench/results/throughput.json": "{}",
                      "bench/results/serve-burst-ab.json": "{}"}, "results")
    assert statuses(tmp_path) == {"fetch.json": "fresh", "throughput.json": "fresh",
                                  "serve-burst-ab.json": "dated"}
    findings = check(tmp_path, table=TABLE, require_stamps=True)
    assert {f.name: f.status for f in findings} == {
        "fetch.json": "fresh", "throughput.json": "unstamped", "serve-burst-ab.json": "dated"}
    lines, ok = render(findings)
    assert not ok and lines[-1].startswith("1 of 2 cited result files are fresh (1 dated")
    assert any(ln.startswith("unstamped throughput.json") for ln in lines)
    from testbed.cli import main
    r = CliRunner().invoke(main, ["results-check", "--root", str(tmp_path), "--require-stamps"])
    assert r.exit_code == 1 and "unstamped throughput.json" in r.output


TRAILER = "Results-unaffected: compiled programs identical; tests unchanged"


def test_a_commit_marked_results_unaffected_is_not_counted(tmp_path):
    """Only what unmarked commits changed makes a result stale; the report names the marked
    commits it did not count."""
    commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY, "app/server.py": SERVER,
                      "README.md": "fetch.json\n"}, "code")
    commit(tmp_path, {"bench/results/fetch.json": "{}"}, "results")
    # a rename that, say, rewrites one expression the compiler folds: taken at its word
    marked = commit(tmp_path, {"app/server.py": SERVER.replace("x * 2", "x * (1 + 1)")},
                    f"Spell the factor out\n\n{TRAILER}\n")
    f = {f.name: f for f in check(tmp_path, table=TABLE)}["fetch.json"]
    assert (f.status, [m.commit for m in f.change.skipped]) == ("fresh", [marked])
    lines, ok = render([f])
    assert ok and f"not counted: {marked[:7]}" in lines[0]
    assert f"Results-unaffected {marked[:7]}: compiled programs identical; tests unchanged" \
        in lines
    # an unmarked change after it: stale by that change alone
    commit(tmp_path, {"app/server.py": SERVER.replace("x * 2", "x * (1 + 1)")
                      .replace("return 3", "return 4")}, "change")
    f = {f.name: f for f in check(tmp_path, table=TABLE)}["fetch.json"]
    assert (f.status, f.changed_lines, f.changed_files) == ("stale", 2, ["app/server.py"])
    assert [m.commit for m in f.change.skipped] == [marked]
    # a marked commit that touches none of its code is not listed
    commit(tmp_path, {"app/other.py": "X = 1\n"}, f"Other\n\n{TRAILER}\n")
    assert [m.commit for m in check(tmp_path, table=TABLE)[0].change.skipped] == [marked]


def test_an_unmarked_change_in_between_marked_ones_is_counted(tmp_path):
    commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY, "app/server.py": SERVER,
                      "README.md": "fetch.json\n"}, "code")
    commit(tmp_path, {"bench/results/fetch.json": "{}"}, "results")
    run(tmp_path, "mv", "app/server.py", "app/serving.py")
    commit(tmp_path, {"app/bench.py": BENCH_PY.replace("app.server", "app.serving")},
           f"Rename\n\n{TRAILER}\n")
    commit(tmp_path, {"app/serving.py": SERVER.replace("return 3", "return 9")}, "change")
    commit(tmp_path, {"app/serving.py": "def serve(x):\n    return x + x\n\n\n"
                      "def helper():\n    return 9\n"}, f"Same\n\n{TRAILER}\n")
    f = check(tmp_path, table=TABLE)[0]
    assert (f.status, f.changed_lines, len(f.change.skipped)) == ("stale", 2, 1)


def test_a_command_whose_code_moved_is_compared_with_where_it_was(monkeypatch, tmp_path):
    """A result made before its command's code moved to another module is compared with the
    code at its old place (entries.MOVED): the move, marked, changes nothing; what changed
    before the move still counts."""
    from testbed.provenance import entries
    commit(tmp_path, {"app/__init__.py": "", "app/bench.py": BENCH_PY, "app/server.py": SERVER,
                      "README.md": "fetch.json\n"}, "code")
    commit(tmp_path, {"bench/results/fetch.json": "{}"}, "results")
    commit(tmp_path, {"app/server.py": SERVER.replace("return 3", "return 4")}, "change")
    run(tmp_path, "mv", "app/bench.py", "app/tool.py")
    commit(tmp_path, {}, f"Move\n\n{TRAILER}\n")
    table = [("fetch*", "python -m app.tool")]
    monkeypatch.setattr(entries, "MOVED", {"app.tool": "app.bench"})
    f = check(tmp_path, table=table)[0]
    assert (f.status, f.changed_lines, f.changed_files) == ("stale", 2, ["app/server.py"])
    # without the table the code before the move is not found: the change would be lost
    monkeypatch.setattr(entries, "MOVED", {})
    assert check(tmp_path, table=table)[0].status == "fresh"
    # a chain of moves, a function among them
    monkeypatch.setattr(entries, "MOVED", {"app.tool:main": "app.mid:main", "app.mid:main":
                                           "app.bench"})
    assert entries.places(entries.Entry("app.tool", "main")) == [
        entries.Entry("app.tool", "main"), entries.Entry("app.mid", "main"),
        entries.Entry("app.bench")]
