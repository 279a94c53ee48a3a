"""testbed.provenance.depends: what a result depends on is derived from what its command's code
imports and loads — Python modules followed through imports (lazy, relative, packages), the
modules it runs as tasks or with -m, the C programs it names and what those include."""
from pathlib import Path

from conftest import ROOT

from testbed.provenance.depends import dependencies, why
from testbed.provenance.entries import Entry, entry_of
from testbed.provenance.gitread import Tree

FILES = {
    "pkg/__init__.py": '"""Pkg."""\nfrom .heavy import Heavy\n',
    "pkg/heavy.py": "class Heavy:\n    SOURCE = 'heavy.c'\n",
    "pkg/heavy.c": "int heavy;\n",
    "pkg/cli.py": "import click\nfrom .util import helper, other\n\n\n@click.command()\n"
                  "def run():\n    from .bench import measure\n    measure(helper())\n\n\n"
                  "@click.command()\ndef unrelated():\n    other()\n",
    "pkg/util.py": "def helper():\n    return 1\n\n\ndef other():\n    from .heavy import Heavy\n"
                   "    return Heavy\n",
    "pkg/bench.py": "from . import engine\nfrom .registry import register\n\n\n"
                    "def measure(x):\n    task(f'{__name__}:node')\n    return engine.go(x)\n\n\n"
                    "def node():\n    return python_argv('tool', 'serve')\n\n\n"
                    "@register\ndef extra():\n    pass\n",
    "pkg/registry.py": "KNOWN = []\n\n\ndef register(f):\n    KNOWN.append(f)\n    return f\n",
    "pkg/engine.py": "import os\nfrom .sub.ring import Ring\n\n\ndef go(x):\n    return Ring(x)\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/ring.py": "from ..prog import Program\n\n\nclass Ring(Program, source='ring.c'):\n"
                       "    pass\n",
    "pkg/prog.py": "class Program:\n    pass\n",
    "xdp/ring.c": '#include "ring.h"\nint x;\n',
    "xdp/ring.h": '#include "proto.h"\n',
    "xdp/proto.h": "#define A 1\n",
    "xdp/unused.c": "int y;\n",
    "tool/__init__.py": "", "tool/__main__.py": "from .cli import main\nmain()\n",
    "tool/cli.py": "def main():\n    pass\n",
}


def test_the_code_a_command_runs_not_all_its_module_imports():
    deps = dependencies(Tree.of_files(FILES), Entry("pkg.cli", "run"))
    assert set(deps) == {
        "pkg/__init__.py", "pkg/cli.py", "pkg/util.py", "pkg/bench.py", "pkg/registry.py",
        "pkg/engine.py", "pkg/sub/__init__.py", "pkg/sub/ring.py", "pkg/prog.py",
        "xdp/ring.c", "xdp/ring.h", "xdp/proto.h",       # named as a program source, included
        "tool/__init__.py", "tool/__main__.py", "tool/cli.py"}      # run with python -m
    # of the command line module: the command alone, its decorator's names and what it uses;
    # `unrelated` (which would reach pkg/heavy.py and its program) does not count
    assert deps["pkg/cli.py"] == {2} and deps["pkg/util.py"] == {0}
    # the package's __init__ runs, but what it imports for others does not count
    assert deps["pkg/__init__.py"] == set()
    # measure, the task it starts (node) and the registration that runs on import (extra)
    assert deps["pkg/bench.py"] == {2, 3, 4}
    assert deps["pkg/engine.py"] is None            # imported as a module object: whole
    assert deps["xdp/ring.c"] is None
    assert why(Tree.of_files(FILES), Entry("pkg.cli", "run"), "xdp/proto.h") == [
        "pkg/cli.py:6", "pkg/bench.py:5", "pkg/engine.py:5", "pkg/sub/ring.py:4", "xdp/ring.c",
        "xdp/ring.h", "xdp/proto.h"]
    # module by module (every module reached counts whole): unrelated's heavy program too
    coarse = dependencies(Tree.of_files(FILES), Entry("pkg.cli", "run"), whole_modules=True)
    assert {"pkg/heavy.py", "pkg/heavy.c"} <= set(coarse) and "xdp/unused.c" not in coarse
    # a whole module run as a script, and a module that is not there (then)
    assert "xdp/ring.c" in dependencies(Tree.of_files(FILES), Entry("pkg.engine"))
    assert dependencies(Tree.of_files(FILES), Entry("pkg.gone")) == {}


def test_bench_fetch_depends_on_what_its_engine_imports_and_the_switch_loads():
    """The repository's own: `testbed bench fetch` reaches the packet ring only through the
    modules it imports, and the switch's program part kvswitch_rounds.c only through
    switchd.dataplane naming kvswitch.c, which includes it."""
    tree = Tree.of_dir(ROOT)
    entry = entry_of("testbed bench fetch --json bench/results/fetch.json", ROOT)
    assert entry == Entry("testbed.bench.fetch.cli", "fetch")
    deps = dependencies(tree, entry)
    assert "packet_ring" not in (ROOT / "testbed/bench/fetch/fetch.py").read_text()
    assert {"testbed/bench/fetch/fetch.py", "hostagent/inference/fetch/engine.py",
            "hostagent/common/packet_ring.py", "switchd/dataplane.py", "xdp/kvswitch.c",
            "xdp/kvswitch_rounds.c", "xdp/kvfetch.c", "xdp/kvproto.h"} <= set(deps)
    assert why(tree, Entry("hostagent.inference.fetch.engine"),
               "hostagent/common/packet_ring.py")[-1] == "hostagent/common/packet_ring.py"
    chain = why(tree, Entry("switchd.dataplane", "DataPlane"), "xdp/kvswitch_rounds.c")
    assert chain[0].startswith("switchd/dataplane.py:") and chain[1:] == [
        "xdp/kvswitch.c", "xdp/kvswitch_rounds.c"]
    # the policy evaluator's command line imports the data plane for a constant: not its program
    policy = dependencies(tree, entry_of("testbed policy-eval", ROOT))
    assert "testbed/sim/evaluate.py" in policy and "xdp/kvswitch.c" not in policy


def test_commands_name_their_entries():
    assert entry_of("testbed bench compress --json x", ROOT) == Entry(
        "testbed.bench.quality.cli", "compress")
    assert entry_of("OMP_NUM_THREADS=1 testbed sim run --nodes 4", ROOT) == Entry(
        "testbed.sim.cli", "sim_run")
    assert entry_of("python -m testbed.bench.fetch.fetch_auth out.json", ROOT) == Entry(
        "testbed.bench.fetch.fetch_auth")
    assert entry_of("/elsewhere/testbed/bench/fetch/fetch_auth.py", ROOT) == Entry(
        "testbed.bench.fetch.fetch_auth")
    # another checkout's path, which exists (a worktree): still the module, not the path
    here = str(Path(ROOT).resolve() / "testbed/bench/fetch/fetch_auth.py")
    assert entry_of(f"{here} out.json", ROOT) == Entry("testbed.bench.fetch.fetch_auth")
    assert entry_of("python -m testbed bench fetch", ROOT) == Entry("testbed.bench.fetch.cli",
                                                                    "fetch")


def test_a_package_that_imports_its_own_submodules_and_import_cycles():
    tree = Tree.of_files({
        "p/__init__.py": "from . import sub\nfrom .sub import f as g\n",
        "p/sub.py": "from p import g\n\n\ndef f():\n    return g\n",
        "m.py": "from p import sub\nfrom a import x\nsub.f(x)\n",
        "a.py": "from b import y as x\n", "b.py": "from a import x as y\n"})
    assert dependencies(tree, Entry("m")) == {
        "m.py": None, "p/__init__.py": frozenset(), "p/sub.py": None,
        "a.py": frozenset(), "b.py": frozenset()}
