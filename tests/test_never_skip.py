"""The project's rule: a test never skips. One that cannot run here fails and says what it needs
(conftest.py does so for the bpf and e2e tiers; tests/test_slots.py for its two CPUs)."""
from conftest import ROOT, repo_files

SKIPS = ["pytest." + "skip(", "mark." + "skip", "skip" + "if(", "import" + "orskip"]


def test_no_test_skips():
    found = {str(p.relative_to(ROOT)): word for p in repo_files()
             if p.suffix == ".py" and p.is_relative_to(ROOT / "tests") and p.exists()
             for word in SKIPS if word in p.read_text()}
    assert not found, f"skips, against the project's rule (fail and say what is needed): {found}"
