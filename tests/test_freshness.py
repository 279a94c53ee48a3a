"""`testbed results-check` (testbed.lab.freshness): what counts as a change to the code a result
measures, on a throwaway git repository."""
import subprocess
from pathlib import Path

from testbed.lab.freshness import Counter, check, code_lines


def test_docstrings_comments_imports_and_layout_are_not_code():
    a = '"""Doc."""\nimport os\n\ndef f(x):\n    """Say."""\n    # why\n    return x + 1\n'
    b = 'from os import path\n\n\ndef f(x):\n    return (x +\n            1)   # reworded\n'
    assert code_lines(a, "m.py") == code_lines(b, "m.py") == Counter({"def f(x):": 1,
                                                                     "return x + 1": 1})
    c1 = "#include <a.h>\n/* one */ int f(void) { return 1; } // two\n"
    assert code_lines(c1, "p.c") == code_lines("int f(void) {  return 1; }\n", "p.h")
    assert code_lines("int f(void) { return 2; }", "p.c") != code_lines(c1, "p.c")


def run(repo: Path, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def commit(repo: Path, files: dict[str, str], message: str):
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    run(repo, "add", "-A")
    run(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


def test_a_result_is_stale_only_when_a_statement_it_measures_changed(tmp_path):
    run(tmp_path, "init", "-q")
    body = "def serve(x):\n    return x * 2\n\n\ndef helper():\n    return 3\n"
    commit(tmp_path, {"hostagent/pool/server.py": body, "docs/a.md": "see fetch.json\n",
                      "README.md": "[t](bench/results/throughput.json), gone.json\n"}, "code")
    commit(tmp_path, {"bench/results/fetch.json": "{}", "bench/results/throughput.json": "{}"},
           "results")
    by_name = {f.name: f for f in check(tmp_path)}
    assert set(by_name) == {"fetch.json", "throughput.json"}        # gone.json: not a result
    assert by_name["fetch.json"].status == "fresh"
    # moved into another module of the measured code, with a new docstring: still fresh
    run(tmp_path, "mv", "hostagent/pool/server.py", "hostagent/pool/serving.py")
    commit(tmp_path, {"hostagent/pool/serving.py": '"""Moved."""\ndef serve(x):\n'
                      "    return x * 2\n", "hostagent/pool/util.py": "def helper():\n"
                      "    return 3\n"}, "move")
    assert {f.name: f.status for f in check(tmp_path)}["fetch.json"] == "fresh"
    commit(tmp_path, {"hostagent/pool/util.py": "def helper():\n    return 4\n"}, "change")
    f = {f.name: f for f in check(tmp_path)}["fetch.json"]
    assert (f.status, f.changed_lines) == ("stale", 2)       # 'return 3' out, 'return 4' in
    assert f.changed_files == ["hostagent/pool/server.py", "hostagent/pool/util.py"]
    (tmp_path / "docs/a.md").write_text("see fetch.json and bench/results/missing.json\n")
    assert {f.name: f.status for f in check(tmp_path)}["missing.json"] == "missing"
    # a before/after kept as history is dated, whatever changed since
    commit(tmp_path, {"bench/results/serve-burst-ab.json": "{}",
                      "docs/a.md": "see fetch.json and serve-burst-ab.json\n"}, "dated")
    commit(tmp_path, {"hostagent/pool/util.py": "def helper():\n    return 5\n"}, "again")
    assert {f.name: f.status for f in check(tmp_path)}["serve-burst-ab.json"] == "dated"


def test_a_plot_drawn_again_byte_for_byte_is_as_fresh_as_its_json(tmp_path):
    """A rerun whose plot comes out the same bytes leaves git nothing to record in the PNG:
    it counts as written with the JSON its Makefile command writes beside it."""
    run(tmp_path, "init", "-q")
    commit(tmp_path, {"testbed/sim/model.py": "def f():\n    return 1\n",
                      "Makefile": "sim:\n\ttestbed sim sweep --json bench/results/sim-sweep.json"
                                  " \\\n\t  --plot bench/results/sim-breakeven.png\n",
                      "docs/a.md": "see sim-breakeven.png\n", "README.md": "r\n",
                      "bench/results/sim-sweep.json": '{"wall": 1}',
                      "bench/results/sim-breakeven.png": "png"}, "first run")
    commit(tmp_path, {"testbed/sim/model.py": "def f():\n    return 2\n"}, "change")
    assert {f.name: f.status for f in check(tmp_path)}["sim-breakeven.png"] == "stale"
    commit(tmp_path, {"bench/results/sim-sweep.json": '{"wall": 2}'}, "rerun, same plot")
    assert {f.name: f.status for f in check(tmp_path)}["sim-breakeven.png"] == "fresh"
