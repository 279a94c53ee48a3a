"""``testbed results-check``: are the figures the README and docs cite still true? Every result
file they name must exist, and the code it measures must be the code that made it.

What made a result is its ``measured`` stamp (``testbed.results.write_json``): the commit it
was made on and the command. The command's entry and what it imports and loads give the code it
measures (``depends``); that code at the stamp's commit is compared with the same at HEAD
(``compare``). A result without a stamp (made before stamps) is taken as made on the last
commit that wrote it, by the command ``MADE_BY`` names; ``require_stamps`` makes such a result
fail as ``unstamped`` instead."""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .compare import Change, Code
from .depends import module_file
from .entries import Entry, UnknownCommand, entry_of
from .gitread import Repo

RESULTS = "bench/results"
CITED = re.compile(r"([\w.-]+\.(?:json|png))")

# results without a stamp (first match wins) -> the command that made them (its options do not
# matter: every path the command's code can take counts)
MADE_BY: list[tuple[str, str]] = [
    ("throughput*", "testbed bench throughput"),
    ("fetch-auth*", "python -m testbed.bench.fetch.fetch_auth"),
    ("fetch*", "testbed bench fetch"),
    ("incast*", "testbed bench incast"),
    ("serve*", "testbed bench serve"),           # serve, serve-tiers, serve-fabric
    ("soak*", "testbed soak"),                   # soak, soak-faults
    ("faults*", "testbed bench faults"),
    ("loss*", "testbed bench loss"),
    ("fuzz*", "testbed fuzz"),
    ("policy-*", "testbed policy-eval"),
    ("replay*", "testbed replay"),
    ("sim-run*", "testbed sim run"),
    ("sim-sweep*", "testbed sim sweep"), ("sim-breakeven*", "testbed sim sweep"),
    ("sim-validate*", "testbed sim validate"),
    ("sim-fabric*", "testbed sim fabric"),
    ("compress*", "testbed bench compress"),
    ("blend*", "testbed bench blend"),           # blend, blend-detail
    ("inference*", "testbed demo-inference"),
    ("lmcache*", "testbed bench lmcache"),
    ("vllm-serve*", "testbed bench vllm"), ("vllm-busy*", "testbed bench vllm"),
    ("vllm*", "testbed demo-vllm"),
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
    """One cited result file: where it is cited, what made it and on which commit, and what
    changed in the code it measures since."""
    name: str
    cited_in: list[str]
    result_commit: str | None = None    # the last commit that wrote it (None: missing)
    stamp: dict | None = None           # its measured stamp (a plot: its JSON's)
    made_on: str | None = None          # the commit its code is compared from
    basis: str = "written"              # where made_on comes from: stamp, written, ...
    command: str | None = None          # the command that made it (stamp or MADE_BY)
    entry: Entry | None = None          # the code that command runs (None: unmapped)
    problem: str | None = None          # why there is no entry
    change: Change = field(default_factory=Change)
    require_stamps: bool = False

    @property
    def status(self) -> str:
        if self.result_commit is None:
            return "missing"
        if self.name in DATED:
            return "dated"
        if self.require_stamps and self.stamp is None:
            return "unstamped"
        if self.entry is None:
            return "unmapped"
        return "stale" if self.change.lines else "fresh"

    @property
    def changed_lines(self) -> int:
        return self.change.lines

    @property
    def changed_files(self) -> list[str]:
        return self.change.files


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
    was written when its JSON last was, by the same command."""
    makefile = root / "Makefile"
    text = makefile.read_text().replace("\\\n", " ") if makefile.exists() else ""
    out = {}
    for line in text.splitlines():
        j = re.search(r"--json\s+\S*?([\w.-]+\.json)", line)
        p = re.search(r"--plot\s+\S*?([\w.-]+\.png)", line)
        if j and p:
            out[p.group(1)] = j.group(1)
    return out


def stamp_of(path: Path) -> dict | None:
    """A result file's ``measured`` stamp (a mapping with a commit), if it has one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    stamp = data.get("measured") if isinstance(data, dict) else None
    return stamp if isinstance(stamp, dict) and "commit" in stamp else None


def made_by(name: str, table: list[tuple[str, str]] = MADE_BY) -> str | None:
    return next((cmd for pattern, cmd in table if fnmatch.fnmatch(name, pattern)), None)


def check(root: str | Path = ".", require_stamps: bool = False,
          table: list[tuple[str, str]] = MADE_BY) -> list[Finding]:
    """Every result file the README and docs cite, with its status (``table``: the commands
    that made results without a stamp)."""
    root = Path(root)
    with Repo(root) as repo:
        judge = _Judge(repo, root, table)
        findings, partners = [], plot_partners(root)
        for name, docs in sorted(cited(root).items()):
            f = Finding(name, docs, require_stamps=require_stamps)
            findings.append(f)
            json_name = partners.get(name) or (name.removesuffix(".png") + ".json"
                                               if name.endswith(".png") else name)
            if not (root / RESULTS / name).exists():
                continue
            # a plot was written when its JSON last was, if not since (the later commit)
            f.result_commit = repo.last_wrote([f"{RESULTS}/{name}", f"{RESULTS}/{json_name}"])
            if f.result_commit and name not in DATED:
                f.stamp = stamp_of(root / RESULTS / json_name)
                judge(f)
        for f in findings:
            f.result_commit = f.result_commit and repo.short(f.result_commit)
            f.made_on = f.made_on and repo.short(f.made_on)
    return findings


class _Judge:
    """Finds what made a result and what changed in its code since, sharing the work (commands'
    entries, trailer-marked commits, code at each commit) between results."""

    def __init__(self, repo: Repo, root: Path, table: list[tuple[str, str]]):
        self.repo, self.root, self.table = repo, root, table
        self.head = repo.head()
        self.code = Code(repo)
        self.entries: dict[str, Entry | str] = {}          # command -> entry, or why none
        self.marked: dict[str, list] = {}                  # commit -> marked since it

    def __call__(self, f: Finding) -> None:
        _made_on(self.repo, f)
        f.command = f.stamp.get("command") if f.stamp else made_by(f.name, self.table)
        if not f.command:
            f.problem = "no stamp, and MADE_BY names no command for it"
            return
        entry = self.entry(f.command)
        if isinstance(entry, str):
            f.problem = entry
            return
        f.entry = entry
        if f.made_on not in self.marked:
            self.marked[f.made_on] = self.repo.marked(f.made_on, self.head)
        f.change = self.code.since(f.made_on, self.head, entry, self.marked[f.made_on])

    def entry(self, command: str) -> Entry | str:
        if command not in self.entries:
            try:
                entry = entry_of(command, self.root)
            except UnknownCommand as exc:
                entry = str(exc)
            else:
                if module_file(self.repo.tree(self.head), entry.module) is None:
                    entry = f"{command}: no module {entry.module} now"
            self.entries[command] = entry
        return self.entries[command]


def _made_on(repo: Repo, f: Finding) -> None:
    """The commit a result's code is compared from: its stamp's, if the stamp names a commit of
    this repository whose files were as committed; else the last commit that wrote it."""
    f.made_on, f.basis = f.result_commit, "written"
    if f.stamp is None:
        return
    commit = repo.commit(f.stamp["commit"]) if f.stamp.get("commit") else None
    if commit is None:
        f.basis = "written (stamp unknown)"
    elif f.stamp.get("clean") is not True:
        f.basis = "written (stamp dirty)"
    else:
        f.made_on, f.basis = commit, "stamp"


def render(findings: list[Finding]) -> tuple[list[str], bool]:
    """The report's lines, one per cited result (its state, the commit it was made on and how
    that is known, what changed in its code since and the Results-unaffected commits not
    counted), then a summary; and whether every cited result is fresh or dated."""
    lines = []
    skipped: dict[str, str] = {}
    for f in findings:
        made = f"{f.made_on or f.result_commit or '-'} {f.basis if f.made_on else ''}".strip()
        if f.status == "dated":
            what = DATED[f.name]
        elif f.problem:
            what = f.problem
        elif f.change.lines:
            what = f"{f.change.lines} lines in {', '.join(f.change.files)}"
        else:
            what = ""
        if f.change.skipped:
            shas = [m.commit[:7] for m in f.change.skipped]
            what += ("; " if what else "") + f"not counted: {', '.join(shas)}"
            skipped.update({m.commit[:7]: m.evidence for m in f.change.skipped})
        lines.append(f"{f.status:9} {f.name:34} {made:18} {what}".rstrip())
    for sha, evidence in skipped.items():
        lines.append(f"Results-unaffected {sha}: {evidence}")
    bad = [f for f in findings if f.status not in ("fresh", "dated")]
    dated = sum(f.status == "dated" for f in findings)
    stamped = sum(f.stamp is not None for f in findings)
    lines.append(f"{len(findings) - len(bad) - dated} of {len(findings) - dated} cited result "
                 f"files are fresh ({dated} dated: history; {stamped} stamped)"
                 + (f"; not: {', '.join(f.name for f in bad)}" if bad else ""))
    return lines, not bad
