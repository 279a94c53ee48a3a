"""No source file of the repository (Python, C, headers; tests included) is over 500 lines:
the project's rule for code a reader can hold. A C program longer than that is split into parts
the loader pastes in place (xdp/loader.py; the switch: tests/test_program_parts.py)."""
from conftest import ROOT, repo_files

LIMIT = 500


def test_no_source_file_is_over_500_lines():
    sources = [p for p in repo_files() if p.suffix in (".py", ".c", ".h")]
    assert len(sources) > 100                                # the listing found the sources
    over = {str(p.relative_to(ROOT)): lines for p in sources
            if p.exists() and (lines := len(p.read_text().splitlines())) > LIMIT}
    assert not over, f"over {LIMIT} lines: {over}"
