"""A clone of the repository alone is the product: no tracked file (code, Makefile, docs, tests)
sends a reader or a default outside it, and the data the defaults use ships inside it.
bench/results/ is left out: a result records the command line of the run that made it."""
import re
from pathlib import Path

from conftest import ROOT, repo_files

RELATIVE = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-]+(?:/[\w.-]+)*)")   # ../x/y
UP_ARGS = re.compile(r"""(?:["']\.\.["']\s*,\s*)+""")                   # "..", "..",
PARENTS = re.compile(r"\.parents\[(\d+)\]")


def tracked() -> list[Path]:
    return [p for p in repo_files()
            if not str(p.relative_to(ROOT)).startswith("bench/results/")]


def outside(path: Path) -> bool:
    return not path.resolve().is_relative_to(ROOT)


def escapes(path: Path, text: str) -> list[str]:
    """The path expressions in ``text`` (the content of ``path``) that lead out of the repo."""
    found = [rel for rel in RELATIVE.findall(text)
             if outside(path.parent / rel) and outside(ROOT / rel)]
    if path.suffix == ".py":
        depth = len(path.relative_to(ROOT).parts) - 1      # directories between it and ROOT
        found += [m.group(0) for m in UP_ARGS.finditer(text)
                  if m.group(0).count("..") > depth]
        found += [m.group(0) for m in PARENTS.finditer(text) if int(m.group(1)) > depth]
    return found


def test_no_tracked_file_points_outside_the_repository():
    bad = {}
    for path in tracked():
        if path == Path(__file__).resolve():            # its own examples, below
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        if found := escapes(path, text):
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"paths leading outside the repository: {bad}"


def test_the_checker_sees_each_way_out(tmp_path):
    # made-up ways out (none names a real directory beside the repository)
    assert escapes(ROOT / "Makefile", "TRACE ?= ../elsewhere/traces/t.jsonl")
    assert escapes(ROOT / "tests" / "x.py", 'os.path.join(here, "..", "..", "elsewhere")')
    assert escapes(ROOT / "tests" / "x.py", "Path(__file__).parents[2] / 'elsewhere'")
    assert not escapes(ROOT / "docs" / "x.md", "[fetch](../hostagent/inference/fetch)")
    assert not escapes(ROOT / "testbed" / "sim" / "x.py", "Path(__file__).parents[1]")


def test_the_default_trace_ships_in_the_repository():
    from testbed.sim.trace import DEFAULT_TRACE, load_trace
    path = Path(DEFAULT_TRACE)
    assert path.is_relative_to(ROOT) and str(path.relative_to(ROOT)) in \
        {str(p.relative_to(ROOT)) for p in tracked()}
    assert load_trace(DEFAULT_TRACE).n_requests == 3993
    notes = (path.parent / "README.md").read_text()
    assert "Apache-2.0" in notes and "kvcache-ai/Mooncake" in notes
