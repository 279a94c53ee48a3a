"""No source file of the repository (Python, C, headers; tests included) is over 500 lines:
the project's rule for code a reader can hold. A C program longer than that is split into parts
the loader pastes in place (xdp/loader.py; the switch: tests/test_program_parts.py)."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def test_no_source_file_is_over_500_lines():
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard",
                            "*.py", "*.c", "*.h"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert len(names) > 100                                  # the listing found the sources
    over = {n: lines for n in names if (p := ROOT / n).exists()
            and (lines := len(p.read_text().splitlines())) > LIMIT}
    assert not over, f"over {LIMIT} lines: {over}"
