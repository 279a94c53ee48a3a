"""Are the figures the README and docs cite still true? Every result file they name must exist,
and the code it measures must be the code that produced it.

`MEASURES` says which code each result file measures (its benchmark and the parts of the system
it exercises). The code is compared as it is now and as it was at the commit that last wrote the
result, following renames: Python as its syntax tree without docstrings and imports, C without
comments and includes, each as a multiset of lines, so moving code between files or modules
and rewording comments change nothing, while any changed statement makes the result stale."""
from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

RESULTS = "bench/results"
CITED = re.compile(r"([\w.-]+\.(?:json|png))")

# the parts of the system, as the paths that make them
SWITCH = ["xdp/kvswitch.c", "xdp/kvswitch_cache.c", "xdp/kvswitch_rounds.c",
          "xdp/kvswitch_ports.c", "xdp/kvswitch.h", "xdp/kvmaps.h", "xdp/kvslot.h",
          "xdp/kvwrite.c", "xdp/parse.h", "xdp/reply.h", "xdp/kvproto.h", "switchd/dataplane.py",
          "switchd/slots.py", "switchd/ports.py"]
FETCH = ["xdp/kvfetch.c", "xdp/kvfetch.h", "xdp/kvfetch_maps.h", "hostagent/inference/fetch"]
# the Mooncake-backed store runs only where a result's pool nodes are on Mooncake (MOONCAKE)
POOL = ["xdp/kvserve.c", "xdp/kvserve.h", "xdp/kvserve_maps.h", "hostagent/pool",
        "!hostagent/pool/mooncake_store.py"]
MOONCAKE = ["hostagent/pool/mooncake_store.py"]
POLICY = ["switchd/policy.py", "switchd/sketch.py", "testbed/sim/evaluate.py",
          "testbed/sim/baselines.py"]
LINKS = ["testbed/lab/links.py"]
# the serve-level replay and its validations run in `sim validate --serve [--racks]` alone:
# the cluster model, its sweeps and the trace's validation never call them
SERVE_REPLAY = ["!testbed/sim/serve_model.py", "!testbed/sim/validate_serve.py",
                "!testbed/sim/validate_fabric.py"]
VLLM = ["hostagent/inference/vllm_connector.py", "hostagent/inference/vllm_connector_blocks.py",
        "hostagent/inference/vllm_connector_pool.py", "hostagent/inference/paged_kv.py",
        "hostagent/inference/client.py", "hostagent/common/transfer.py"]   # probes and saves
TIERS = ["hostagent/common/tier_policy.py", "hostagent/inference/node_tier.py",
         "hostagent/pool/disk_tier.py", "testbed/sim/tiers.py"]

# result file (a glob) -> the code it measures; the first match wins
MEASURES: list[tuple[str, list[str]]] = [
    ("throughput.*", SWITCH + POOL + ["testbed/bench/throughput.py", "testbed/bench/generator.py",
                                      "testbed/bench/trafficgen.c"]),
    ("fetch-auth*", SWITCH + FETCH + POOL + ["hostagent/common/auth.py",
                                             "testbed/bench/fetch_auth.py"]),
    ("fetch*", SWITCH + FETCH + POOL + ["testbed/bench/fetch.py"]),
    ("incast-mooncake*", SWITCH + FETCH + POOL + MOONCAKE + LINKS + ["testbed/bench/incast.py"]),
    ("incast*", SWITCH + FETCH + POOL + LINKS + ["testbed/bench/incast.py"]),
    ("serve-tiers*", SWITCH + FETCH + POOL + LINKS + TIERS + [
        "testbed/bench/serve_tiers.py", "testbed/bench/serve_tiers_node.py",
        "testbed/bench/serve_tiers_pool.py", "testbed/bench/serve_tiers_switch.py"]),
    # a fabric: every switch runs switchd (its policy and trunk ports) over bench serve's loops
    ("serve-fabric*", SWITCH + FETCH + POOL + LINKS + ["switchd", "testbed/lab/fabric.py",
                                                       "testbed/bench/serve_fabric.py",
                                                       "testbed/bench/serve.py",
                                                       "testbed/bench/serve_node.py",
                                                       "testbed/bench/serve_workloads.py"]),
    ("serve*", SWITCH + FETCH + POOL + LINKS + ["switchd/policy.py", "testbed/bench/serve.py",
                                                "testbed/bench/serve_node.py",
                                                "testbed/bench/serve_workloads.py"]),
    ("soak-faults*", SWITCH + FETCH + POOL + LINKS + ["switchd", "testbed/bench/serve.py",
                                                      "testbed/bench/serve_node.py",
                                                      "testbed/bench/serve_workloads.py",
                                                      "testbed/bench/faults.py",
                                                      "testbed/bench/fault_kinds.py",
                                                      "testbed/bench/fault_soak.py",
                                                      "hostagent/common/netif.py"]),
    # restarts load programs from the bytecode cache: how fast a restarted daemon serves
    ("faults*", SWITCH + FETCH + POOL + MOONCAKE + LINKS + [
        "xdp/loader.py", "xdp/cache.py", "switchd", "testbed/bench/serve.py",
        "testbed/bench/serve_node.py", "testbed/bench/serve_workloads.py",
        "testbed/bench/faults.py", "testbed/bench/fault_kinds.py",
        "hostagent/common/netif.py"]),
    ("loss.*", SWITCH + FETCH + POOL + ["testbed/bench/loss.py"]),
    ("soak.*", SWITCH + POOL + ["switchd", "testbed/bench/soak.py"]),
    ("fuzz.*", SWITCH + ["testbed/fuzz.py"]),
    ("security-stall.*", SWITCH + FETCH + ["testbed/security.py"]),
    ("pool-put-abuse.*", POOL + ["tests/pool_abuse.py"]),
    ("policy-*", POLICY), ("replay-*", POLICY + ["testbed/sim/replay.py"]),
    # the validations run the model against a live testbed: its switch, policy and nodes
    ("sim-validate-fabric*", SWITCH + FETCH + POOL + LINKS + ["switchd", "testbed/sim",
                                                              "testbed/lab/fabric.py",
                                                              "testbed/bench/serve_fabric.py",
                                                              "testbed/bench/serve.py",
                                                              "testbed/bench/serve_node.py",
                                                              "testbed/bench/serve_workloads.py"]),
    ("sim-validate-serve*", SWITCH + FETCH + POOL + LINKS + ["switchd", "testbed/sim",
                                                             "testbed/bench/serve.py",
                                                             "testbed/bench/serve_node.py",
                                                             "testbed/bench/serve_workloads.py"]),
    ("sim-validate*", SWITCH + FETCH + POOL + ["switchd", "testbed/sim"] + SERVE_REPLAY),
    ("sim-*", ["testbed/sim"] + SERVE_REPLAY),
    ("compress.*", ["hostagent/inference/codec.py", "hostagent/inference/codec_kernels.py",
                    "testbed/bench/compress.py"]),
    # the demos' and blend's TTFTs include fetches through the testbed's switch and pool node
    ("blend*", SWITCH + FETCH + POOL + ["hostagent/inference/blend.py",
                                        "hostagent/inference/blend_store.py",
                                        "testbed/bench/blend.py"]),
    ("inference.*", SWITCH + FETCH + POOL + ["hostagent/inference/hf_connector.py",
                                             "hostagent/inference/codec.py",
                                             "testbed/demos/inference.py"]),
    ("lmcache*", SWITCH + FETCH + POOL + MOONCAKE + LINKS + [
        "hostagent/inference/lmcache_connector.py", "hostagent/inference/store_io.py",
        "hostagent/inference/client.py", "hostagent/inference/vllm_connector_pool.py",
        "testbed/lmcache_engine.py", "testbed/bench/lmcache_bench.py",
        "testbed/bench/lmcache_node.py"]),
    ("vllm-serve*", SWITCH + FETCH + POOL + LINKS + VLLM + ["testbed/bench/serve_vllm.py",
                                                            "testbed/bench/vllm_server.py"]),
    ("vllm*", SWITCH + FETCH + POOL + VLLM + ["testbed/demos/vllm.py"]),
]

# result files that record a comparison with code that no longer exists, or one run kept beside
# the current one: history, cited as such, never expected to match today's code
DATED = {
    "fetch-auth.json": "a fetch run with authentication, before `bench fetch` measured it too",
    "fetch-dataplane.json": "the fetch engine at load 10-12 after a data-plane change, kept "
                            "beside fetch.json",
    "serve-burst-ab.json": "the fetch engine before and after 9cfb6cc on the serve burst",
    "serve-tiers-repeat.json": "an earlier serve-tiers run of the same code, for the spread",
    "serve-fabric-1pool-repeat.json": "a second run of bench serve --racks 2 --pools 1 on the "
                                      "same code, for the spread",
    "sim-validate-fabric-repeat.json": "a second run of sim validate --serve --racks 2 on the "
                                       "same code, for the spread",
    "blend-variants.json": "blending recipes compared on six prompts (docs/cacheblend.md)",
    "security-stall.json": "the issue-26 stall before the fixes (a snapshot of the code) and "
                           "after",
    "pool-put-abuse.json": "the issue-26 PUT abuse before the fixes (a snapshot) and after",
    "faults-detach.json": "the detach fault alone before restarts loaded from the bytecode "
                          "cache, kept beside faults.json",
    "fetch-slow-cores.json": "bench fetch on the trunk-port data plane, on the cores of "
                             "throughput-slow-cores.json",
    "throughput-2026-11-28.json": "bench throughput on the trunk-port data plane, on cores at "
                                  "throughput.json's pace (the model prices at that one's until "
                                  "the sim results are repriced)",
    "throughput-slow-cores.json": "bench throughput on the trunk-port data plane, on cores "
                                  "that ran the bare reflector 3.2x slower than "
                                  "throughput.json's run (the model prices at that one's)",
}


@dataclass
class Finding:
    """One cited result file: where it is cited, its commit and what changed in its code since."""
    name: str
    cited_in: list[str]
    measures: list[str] | None = None
    result_commit: str | None = None        # None: missing or never committed
    changed_lines: int = 0                  # code lines added or removed since that commit
    changed_files: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.result_commit is None:
            return "missing"
        if self.name in DATED:
            return "dated"
        if self.measures is None:
            return "unmapped"
        return "stale" if self.changed_lines else "fresh"


class NotACheckout(ValueError):
    """The root given is not a git checkout with a commit to compare against."""


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout


def code_lines(text: str, path: str) -> Counter:
    """The statements of a source file as a multiset of lines, without what cannot change
    behaviour: Python's docstrings, comments, imports and layout; C's comments and includes."""
    if path.endswith(".py"):
        tree = ast.parse(text)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or ([] if isinstance(node, ast.Module) else [ast.Pass()])
        lines = [ln for ln in ast.unparse(tree).splitlines()
                 if not ln.lstrip().startswith(("import ", "from "))]
    else:
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
        lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#include")]
    return Counter(" ".join(ln.split()) for ln in lines if ln.strip())


def source_files(root: Path, commit: str, paths: list[str]) -> list[str]:
    """The Python and C files under ``paths`` in ``commit``'s tree, less those a ``!path``
    entry names."""
    left_out = {p[1:] for p in paths if p.startswith("!")}
    listed = git(root, "ls-tree", "-r", "--name-only", commit, "--",
                 *(p for p in paths if not p.startswith("!"))).split()
    return [p for p in listed if p.endswith((".py", ".c", ".h")) and p not in left_out]


@lru_cache(maxsize=None)
def renamed_from(root: Path, commit: str, head: str) -> dict[str, str]:
    """Path at ``head`` -> its path at ``commit``, for files git sees as renamed since."""
    out = git(root, "diff", "-M", "--name-status", "--diff-filter=R", commit, head)
    return {parts[2]: parts[1] for parts in (ln.split("\t") for ln in out.splitlines())}


@lru_cache(maxsize=None)
def lines_at(root: Path, commit: str, path: str) -> Counter:
    """The code lines of ``path`` at ``commit`` (empty where it did not exist)."""
    try:
        return code_lines(git(root, "show", f"{commit}:{path}"), path)
    except subprocess.CalledProcessError:
        return Counter()


def changes_since(root: Path, commit: str, head: str,
                  paths: list[str]) -> tuple[int, list[str]]:
    """How many code lines under ``paths`` differ between ``commit`` and ``head`` (lines moved
    between the files count nothing), and the files the added lines are in now or the removed
    ones were in then. The code then is the files under ``paths`` at ``commit`` and wherever
    today's files were then (renames followed)."""
    files = source_files(root, head, paths)
    then = renamed_from(root, commit, head)
    were = {then.get(f, f) for f in files} | set(source_files(root, commit, paths))
    now = {f: lines_at(root, head, f) for f in files}
    before = {f: lines_at(root, commit, f) for f in were}
    new, old = sum(now.values(), Counter()), sum(before.values(), Counter())
    added, removed = new - old, old - new
    where = sorted({f for f in files if any(ln in added for ln in now[f])}
                   | {f for f in were if any(ln in removed for ln in before[f])})
    return sum((added + removed).values()), where


def cited(root: Path) -> dict[str, list[str]]:
    """Result file name -> the documents citing it (README.md and docs/*.md)."""
    found: dict[str, list[str]] = {}
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        for name in CITED.findall(text):
            if (root / RESULTS / name).exists() or f"{RESULTS}/{name}" in text:
                docs = found.setdefault(name, [])
                if str(doc.relative_to(root)) not in docs:
                    docs.append(str(doc.relative_to(root)))
    return found


def plot_partners(root: Path) -> dict[str, str]:
    """PNG name -> the JSON name one Makefile command writes beside it (``--json X ... --plot
    Y``): a rerun that draws the same bytes leaves nothing for git to record in the PNG, so it
    was written when its JSON last was."""
    makefile = root / "Makefile"
    text = makefile.read_text().replace("\\\n", " ") if makefile.exists() else ""
    out = {}
    for line in text.splitlines():
        j = re.search(r"--json\s+\S*?([\w.-]+\.json)", line)
        p = re.search(r"--plot\s+\S*?([\w.-]+\.png)", line)
        if j and p:
            out[p.group(1)] = j.group(1)
    return out


def measured_by(name: str) -> list[str] | None:
    return next((paths for pattern, paths in MEASURES if fnmatch.fnmatch(name, pattern)), None)


def check(root: str | Path = ".") -> list[Finding]:
    """Every result file the README and docs cite, with its status."""
    root = Path(root)
    try:
        head = git(root, "rev-parse", "HEAD").strip()      # a commit, not a name: lines_at caches
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or "").strip().splitlines()
        raise NotACheckout(f"{root} is not a git checkout with a commit"
                           + (f": {said[-1]}" if said else "")) from None
    findings, partners = [], plot_partners(root)
    for name, docs in sorted(cited(root).items()):
        f = Finding(name, docs, measures=measured_by(name))
        written = [f"{RESULTS}/{name}"]
        if name in partners and (root / RESULTS / name).exists():
            written.append(f"{RESULTS}/{partners[name]}")     # the later of the two commits
        f.result_commit = git(root, "log", "-1", "--format=%h", "--", *written).strip() or None
        if f.result_commit and f.measures:
            f.changed_lines, f.changed_files = changes_since(root, f.result_commit, head,
                                                             f.measures)
        findings.append(f)
    return findings
