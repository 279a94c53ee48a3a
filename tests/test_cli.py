"""Bad command-line input gets one clear line on stderr and a non-zero exit, before anything is
loaded or attached: option values, config files, addresses, paths."""
import subprocess

import pytest

from testbed.lab.topology import python_argv


def _one_line_error(prog: str, *args: str, code: int | None = None) -> str:
    r = subprocess.run(python_argv(prog, *args), capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and (code is None or r.returncode == code), (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:"), r.stderr
    return lines[0]


@pytest.mark.parametrize("config, message", [
    ('chunk_size = "big"', "chunk_size: 'big' is not a valid integer"),
    ("chunk_size = 0", "chunk size must be a multiple of 8"),
    ("cache_entries = 0", "cache entries must be between"),
    ('coalesce = "maybe"', "coalesce: 'maybe' is not a valid boolean"),
    ("bogus = 1", "unknown key 'bogus'"),
    ("quotas = [1]", "quotas must be a table"),
    ('quotas = {3 = "lots"}', "is not a size"),
    ("port_namespaces = {h1 = [99999999999]}", "give namespaces 0..4294967295"),
])
def test_switchd_config_errors(tmp_path, config, message):
    path = tmp_path / "switchd.toml"
    path.write_text(f'ports = ["h1"]\n{config}\n')
    assert message in _one_line_error("switchd", "run", "--config", str(path))


@pytest.mark.parametrize("args, message", [
    (["--chunk-size", "0"], "chunk size must be a multiple of 8"),
    (["--cache-entries", "0"], "cache entries must be between"),
    (["--port-ns", "h1=99999999999"], "give namespaces 0..4294967295"),
    (["--port-ns", "h9=1"], "is not PORT=NS[,NS...] for one of the ports"),
    (["--port-bind", "h1=zz,1.2.3.4"], "give a MAC and an IPv4 address"),
    (["--policy", "fifo"], "'fifo' is not one of"),
])
def test_switchd_option_errors(args, message):
    assert message in _one_line_error("switchd", "run", "--port", "h1", *args)


@pytest.mark.parametrize("args, message", [
    (["get", "--pool", "999.1.1.1", "--key", "00" * 16], "'999.1.1.1' is not an IPv4 address"),
    (["get", "--pool", "10.0.0.1:99999", "--key", "00" * 16], "bad port"),
    (["get", "--pool", "10.0.0.1", "--key", "zz"], "is not hex"),
    (["serve", "--stats-file", "/nonexistent/dir/stats.json"], "cannot write into"),
    (["serve", "--bind", "192.0.2.77"], "cannot serve on 192.0.2.77"),
    (["serve", "--capacity", "0"], "capacity must be positive"),
])
def test_hostagent_errors(args, message):
    assert message in _one_line_error("hostagent", *args)
