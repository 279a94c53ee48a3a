"""Every result file says what made it: testbed.results.write_json stamps it with the commit,
whether the checkout was as committed, the kernel and the command (``measured``)."""
import json

import pytest

from testbed.results import is_stamp, measured, write_json


def test_a_result_is_stamped_with_what_made_it(tmp_path):
    write_json(tmp_path / "r.json", {"rate": 1})
    data = json.loads((tmp_path / "r.json").read_text())
    assert list(data) == ["measured", "rate"] and is_stamp(data["measured"])
    assert set(data["measured"]) == {"commit", "clean", "kernel", "command"}
    # rewritten from another result: its stamp is kept
    stamp = {**measured(["testbed", "bench", "fetch"]), "commit": "abc"}
    write_json(tmp_path / "s.json", {"rate": 2, "measured": stamp})
    assert json.loads((tmp_path / "s.json").read_text())["measured"] == stamp
    assert measured(["/x/testbed/__main__.py", "bench"])["command"] == "testbed bench"


def test_measured_is_the_stamps_key_alone(tmp_path):
    """A result that used ``measured`` for its data would lose it or its stamp."""
    with pytest.raises(ValueError, match="another key"):
        write_json(tmp_path / "r.json", {"measured": [{"ttft": 1.0}]})
    assert not (tmp_path / "r.json").exists()
