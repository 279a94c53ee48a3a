"""A built wheel carries everything the commands need at run time (the C sources they compile
included) and works from outside the source tree: `pip install .` gives working commands."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_works_outside_the_source_tree(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("kvswitch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in ("xdp/kvswitch.c", "xdp/kvswitch_cache.c", "xdp/kvswitch_rounds.c",
                   "xdp/kvswitch_ports.c", "xdp/kvproto.h", "xdp/kvswitch.h", "xdp/kvmaps.h",
                   "xdp/parse.h", "xdp/verifier.h", "xdp/kvfetch.c", "xdp/kvfetch.h",
                   "xdp/kvfetch_maps.h", "xdp/kvserve.c", "xdp/kvserve.h", "xdp/kvserve_maps.h",
                   "testbed/lab/pass.c", "testbed/lab/lossy.c",
                   "testbed/bench/fetch/trafficgen.c",
                   "testbed/demos/models/small-llama/config.json",
                   "testbed/traces/mooncake_synthetic_trace.jsonl"):
        assert source in names, f"{source} is not packaged"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    for module in ("switchd", "hostagent", "testbed"):
        r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                           text=True, cwd=tmp_path, env=env)
        assert r.returncode == 0 and "Usage:" in r.stdout, (module, r.stderr[-500:])
    r = subprocess.run([sys.executable, "-c", "import xdp, kvproto; print(xdp.SOURCE_DIR)"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.stdout.strip() == str(site / "xdp")
