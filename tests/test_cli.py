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
    ('chunk_size = "big"', "chunk_size: 'big' is not a number of bytes"),
    ("chunk_size = 0", "chunk size 0 is not a multiple of 8 from 8 to 3424"),
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
    (["--chunk-size", "0"], "chunk size 0 is not a multiple of 8 from 8 to 3424"),
    (["--cache-entries", "0"], "cache entries must be between"),
    (["--port-ns", "h1=99999999999"], "give namespaces 0..4294967295"),
    (["--port-ns", "h9=1"], "is not PORT=NS[,NS...] for one of the ports"),
    (["--port-bind", "h1=zz,1.2.3.4"], "give [MAC,]IPv4"),
    (["--policy", "fifo"], "'fifo' is not one of"),
    (["--uplink", "u1", "--pool-port", "u1"], "is given as --uplink and --pool-port"),
    (["--uplink", "u1", "--downlink", "u1"], "is given as --uplink and --downlink"),
    (["--uplink", "h1"], "is given as --port and --uplink"),
    (["--downlink", "h1"], "is given as --port and --downlink"),
    (["--uplink", "u1=pool-3"], "is not IF or IF=IP[,IP...]"),
    (["--uplink", "u1", "--port-security"], "give those behind uplink u1, --uplink u1=IP"),
    (["--downlink", "r1", "--port-bind", "r1=198.18.0.1"], "cannot be bound to one source"),
    (["--cache-share", "2/2"], "is not K/N with 0 <= K < N"),
    (["--cache-share", "half"], "is not K/N with 0 <= K < N"),
])
def test_switchd_option_errors(args, message):
    assert message in _one_line_error("switchd", "run", "--port", "h1", *args)


@pytest.mark.parametrize("args, message", [
    (["up", "--racks", "0"], "--racks must be at least 1"),
    (["up", "--racks", "2", "--hosts-per-rack", "64"], "a switch has at most 64 ports"),
    (["up", "--racks", "2", "--oversub", "0"], "--oversub must be > 0"),
    (["bench", "serve", "--racks", "0"], "--racks must be at least 1"),
    (["bench", "serve", "--racks", "2", "--oversub", "-1"], "--oversub must be > 0"),
    (["bench", "serve", "--racks", "2", "--modes", "spine"], "mode 'spine': choose from"),
])
def test_testbed_fabric_shape_errors(args, message):
    assert message in _one_line_error("testbed", *args)


def test_switchd_stats_refresh_must_be_positive():
    assert "not in the range x>0" in _one_line_error("switchd", "stats", "--watch", "-1", code=2)


@pytest.mark.parametrize("args, message", [
    (["--chunk-sizes", "99999"], "give numbers in [8, 3424]"),
    (["--chunk-sizes", "1001"], "give multiples of 8"),
    (["--scaling-chunk", "12"], "give multiples of 8"),
    (["--scaling", "0"], "'--scaling': give numbers in [1, inf]"),
    (["--sweep-chunk", "-1"], "-1 is not one of --chunk-sizes 256,1024,3072"),
    (["--chunk-sizes", "3072", "--sweep-chunk", "1024"], "1024 is not one of --chunk-sizes 3072"),
])
def test_testbed_bench_throughput_option_errors(tmp_path, args, message):
    """Refused before any testbed is made (a bench runs for minutes, then writes its result)."""
    out = tmp_path / "t.json"
    assert message in _one_line_error("testbed", "bench", "throughput", *args, "--json", str(out),
                                      code=2)
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--prompts", "2", "--prefixes", "4"], "--prompts (2) must be at least --prefixes (4)"),
    (["--modes", "local,bridge"], "modes are local, pool, switch, not local, bridge"),
    (["--kv-blocks", "2"], "cannot hold one request of 640 tokens"),
    (["--link-gbit", "0"], "0<x<=100"),
    (["--servers", "0"], "1<=x<=16"),
])
def test_testbed_bench_vllm_option_errors(tmp_path, args, message):
    """Refused before any testbed or vLLM server starts."""
    out = tmp_path / "v.json"
    assert message in _one_line_error("testbed", "bench", "vllm", *args, "--json", str(out),
                                      code=2)
    assert not out.exists()


def test_testbed_bench_fetch_chunk_sizes_are_the_switchs():
    assert "give multiples of 8" in _one_line_error("testbed", "bench", "fetch", "--chunk-sizes",
                                                    "1001", "--json", "/dev/null", code=2)


@pytest.mark.parametrize("args", [
    ["soak", "--minutes", "nan"],                   # nan passes every bound: a soak without end
    ["bench", "serve", "--scale", "nan", "--json", ""],
    ["bench", "serve", "--racks", "2", "--oversub", "inf", "--json", ""],
    ["bench", "serve", "--tiers", "--fill", "inf", "--json", ""],
    ["bench", "faults", "--fault-seconds", "inf", "--json", ""],
    ["bench", "throughput", "--rate", "nan", "--json", ""],
    ["replay", "--interval", "nan"],
    ["up", "--link-gbit", "nan"],
], ids=lambda a: " ".join(a[:3]))
def test_testbed_numbers_must_be_finite(args):
    assert "is not a finite number" in _one_line_error("testbed", *args, code=2)


@pytest.mark.parametrize("args, message", [
    (["bench", "fetch", "--json", "{tmp}"], "{tmp} is a directory"),
    (["bench", "serve", "--plot", "{tmp}"], "{tmp} is a directory"),
    (["bench", "incast", "--json", "/dev/null/x.json"], "/dev/null is not a directory"),
    (["bench", "faults", "--json", "/proc/x.json"], "cannot write /proc/x.json"),
    (["soak", "--json", "/proc/1/x/y.json"], "cannot write /proc/1/x/y.json"),
], ids=["json dir", "plot dir", "under a device", "proc", "proc deep"])
def test_a_result_path_the_run_cannot_write_is_refused_before_it_starts(tmp_path, args, message):
    """A benchmark of minutes wrote its JSON only at its end: a path it cannot write lost it."""
    args = [a.format(tmp=tmp_path) for a in args]
    assert message.format(tmp=tmp_path) in _one_line_error("testbed", *args, code=2)


@pytest.mark.parametrize("args, message", [
    (["bench", "serve", "--workloads", "", "--json", ""], "'--workloads': give at least one"),
    (["bench", "serve", "--racks", "2", "--modes", " , ", "--json", ""], "'--modes': give at"),
    (["bench", "serve", "--tiers", "--demote", "", "--json", ""], "'--demote': give at least"),
    (["bench", "lmcache", "--stores", "", "--json", ""], "'--stores': give at least one"),
    (["bench", "faults", "--faults", "", "--json", ""], "'--faults': give at least one"),
    (["policy-eval", "--policies", ""], "'--policies': give at least one"),
], ids=["serve workloads", "fabric modes", "tiers demote", "lmcache stores", "faults",
        "policies"])
def test_an_empty_list_is_refused(args, message):
    """An empty list of workloads, modes or stores ran nothing and exited 0 (or ended in a
    traceback)."""
    assert message in _one_line_error("testbed", *args, code=2)


def test_a_size_the_machine_cannot_hold_is_one_line():
    r = subprocess.run(python_argv("testbed", "sim", "fabric", "--racks", "1000000",
                                   "--hosts-per-rack", "1000000"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "testbed: error: not enough memory" in r.stderr


def test_results_check_outside_a_checkout_is_one_line(tmp_path):
    assert "is not a git checkout" in _one_line_error("testbed", "results-check", "--root",
                                                      str(tmp_path), code=1)


def test_a_plot_goes_beside_the_json_or_nowhere():
    import click

    from testbed.cli import main
    from testbed.options import plot_path_for
    assert plot_path_for("bench/results/x.json", None) == "bench/results/x.png"
    assert plot_path_for("", None) is None and plot_path_for(None, None) is None
    assert plot_path_for("", "y.png") == "y.png"

    # no command's --plot names a file of its own: a run with --json elsewhere never
    # overwrites a committed plot (bench incast's, sim sweep's and sim fabric's did)
    def commands(group, path):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, path + [name])
            else:
                yield " ".join(path + [name]), cmd
    fixed = {name: p.default for name, cmd in commands(main, []) for p in cmd.params
             if p.name == "plot_path" and isinstance(p.default, str)}
    assert fixed == {}


@pytest.mark.parametrize("args, message", [
    (["get", "--pool", "999.1.1.1", "--key", "00" * 16], "'999.1.1.1' is not an IPv4 address"),
    (["get", "--pool", "10.0.0.1:99999", "--key", "00" * 16], "bad port"),
    (["get", "--pool", "10.0.0.1", "--key", "zz"], "is not hex"),
    (["get", "--pool", "0.0.0.0", "--key", "00" * 16],
     "pool address '0.0.0.0' cannot be a pool node: the unspecified address"),
    (["put", "--pool", "10.0.0.1", "--pool", "224.0.0.1", "--key", "00" * 16, "--file",
      "/etc/hostname"], "pool address '224.0.0.1' cannot be a pool node: a multicast address"),
    (["serve", "--stats-file", "/nonexistent/dir/stats.json"], "cannot write into"),
    (["serve", "--bind", "192.0.2.77"], "cannot serve on 192.0.2.77"),
    (["serve", "--capacity", "0"], "capacity must be positive"),
])
def test_hostagent_errors(args, message):
    assert message in _one_line_error("hostagent", *args)


KEY0 = "00" * 16


@pytest.mark.parametrize("args, message", [
    (["get", "--pool", "127.0.0.1", "--key", KEY0, "--chunk-size", "3444"], "from 8 to 3424"),
    (["get", "--pool", "127.0.0.1", "--key", KEY0, "--chunk-size", "1001"], "not a multiple of 8"),
    (["put", "--pool", "127.0.0.1", "--key", KEY0, "--file", "/etc/hostname", "--chunk-size",
      "1001"], "not a multiple of 8"),
    (["get", "--pool", "127.0.0.1", "--key", KEY0, "--out", "/nonexistent/dir/x"],
     "cannot write into /nonexistent/dir"),
    (["get", "--pool", "127.0.0.1", "--key", KEY0, "--deadline", "1e308"], "is not in the range"),
    (["get", "--pool", "127.0.0.1", "--key", KEY0, "--start-at", "nan"], "is not a finite"),
    (["hash", "--", "-1", "2", "3"], "-1 is not in the range 0<=x<=4294967295"),
    (["hash", "4294967296", "1"], "4294967296 is not in the range 0<=x<=4294967295"),
    (["hash", "1", "2", "3"], "3 token(s) make no full block of 16 (--block-tokens)"),
    (["serve", "--bind", "127.0.0.1", "--port", "19999", "--capacity", "100000GiB"],
     "cannot allocate 107374182400000 bytes of staging memory"),
], ids=["chunk 3444", "chunk 1001", "put chunk 1001", "out dir", "deadline", "start-at nan",
        "negative token", "token too large", "short of a block", "capacity too large"])
def test_hostagent_bad_values_give_one_line(args, message):
    assert message in _one_line_error("hostagent", *args)


@pytest.mark.parametrize("op", ["get", "put"])
def test_a_key_file_without_the_namespace_is_one_line(tmp_path, op):
    """``--auth-key-file`` (or $KVSWITCH_AUTH_KEY_FILE) without a key for ``--ns``: refused
    before anything is sent, not a transfer neither sealed nor checked."""
    key_file = tmp_path / "ns.key"
    key_file.write_text(f"4 {'5a' * 32}\n")
    key_file.chmod(0o600)
    extra = ["--file", "/etc/hostname"] if op == "put" else []
    line = _one_line_error("hostagent", op, "--pool", "127.0.0.1:9", "--key", KEY0, "--ns", "5",
                           "--auth-key-file", str(key_file), *extra)
    assert f"key file {key_file} has no key for namespace 5 (no '5 <hex key>' line" in line
    assert "--auth-key-file" in line


@pytest.mark.parametrize("op", ["get", "put"])
def test_an_unreachable_pool_is_one_line(op):
    """In a fresh network namespace (loopback down, no route at all) the kernel refuses the first
    datagram at once (ENETUNREACH): one error line, no traceback, exit 1; nothing leaves the box."""
    extra = ["--file", "/etc/hostname"] if op == "put" else []
    argv = ["unshare", "--net", *python_argv("hostagent", op, "--pool", "10.9.9.9", "--key",
                                             KEY0, "--deadline", "2", *extra)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hostagent: error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors == ["hostagent: error: cannot reach 10.9.9.9:19286: Network is unreachable"], \
        r.stderr


def test_get_asks_again_while_refused_unavailable_and_only_until_its_deadline():
    import asyncio
    import time
    from hostagent.cli import _until_available
    from hostagent.common.transfer import Refused, TransferTimeout
    from kvproto import Status

    def fetcher(refusals, status=Status.UNAVAILABLE):
        calls = []

        async def fetch():
            calls.append(1)
            if len(calls) <= refusals:
                raise Refused(status, "GET of block 00")
            return b"block"
        return fetch, calls

    fetch, calls = fetcher(2)         # a dead replica still listed: served on the third ask
    assert asyncio.run(_until_available(fetch, 5.0, pause_s=0.01)) == b"block"
    assert len(calls) == 3
    fetch, calls = fetcher(1, Status.NOT_FOUND)          # anything else is final at once
    with pytest.raises(Refused, match="NOT_FOUND"):
        asyncio.run(_until_available(fetch, 5.0, pause_s=0.01))
    assert len(calls) == 1
    fetch, calls = fetcher(10 ** 6)   # a master that stays down: the deadline ends it
    with pytest.raises(Refused, match="UNAVAILABLE"):
        asyncio.run(_until_available(fetch, 0.2, pause_s=0.05))
    assert 2 <= len(calls) <= 5

    async def refused_then_slow():    # an ask again that would outlast the deadline
        calls.append(1)
        if len(calls) == 1:
            raise Refused(Status.UNAVAILABLE, "GET of block 00")
        await asyncio.sleep(30)
    calls = []
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="0.3 s deadline passed"):
        asyncio.run(_until_available(refused_then_slow, 0.3, pause_s=0.05))
    assert len(calls) == 2 and time.monotonic() - t0 < 5.0   # the old code: 30 s
