"""Reading a git repository's commits without a work tree: each commit's files (path -> blob),
blobs through one ``git cat-file --batch`` process, the last commit that wrote some paths, and
the commits of a range with their ``Results-unaffected:`` trailers. Every file is read as it was
committed, so the code compared is the code of commits, never of a checkout's edits."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

TRAILER = "Results-unaffected"


class NotACheckout(ValueError):
    """The root given is not a git checkout with a commit to compare against."""


@dataclass(frozen=True)
class Tree:
    """One version of the repository's files: ``paths`` (repository-relative, '/'-separated)
    and ``read(path)`` giving one's text. A commit's (``Repo.tree``) or any other (tests)."""
    paths: frozenset[str]
    read: Callable[[str], str]

    @classmethod
    def of_files(cls, files: dict[str, str]) -> "Tree":
        return cls(frozenset(files), files.__getitem__)

    @classmethod
    def of_dir(cls, root: str | Path) -> "Tree":
        """The Python and C files under a directory as they are on disk."""
        root = Path(root)
        paths = frozenset(str(p.relative_to(root)) for suffix in ("py", "c", "h")
                          for p in root.rglob(f"*.{suffix}")
                          if not any(part.startswith(".") for part in p.relative_to(root).parts))
        return cls(paths, lambda path: (root / path).read_text())


@dataclass(frozen=True)
class Marked:
    """A commit whose message says, in a ``Results-unaffected: <evidence>`` trailer, that its
    code changes change no measured behaviour (code moved or renamed)."""
    commit: str
    parent: str | None
    evidence: str


class Repo:
    """A git repository read at any of its commits."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._cat: subprocess.Popen | None = None
        self._blobs: dict[str, str] = {}
        self._trees: dict[str, Tree] = {}

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True,
                              text=True, check=True).stdout

    def head(self) -> str:
        try:
            return self.git("rev-parse", "HEAD").strip()
        except subprocess.CalledProcessError as exc:
            said = (exc.stderr or "").strip().splitlines()
            raise NotACheckout(f"{self.root} is not a git checkout with a commit"
                               + (f": {said[-1]}" if said else "")) from None

    def commit(self, name: str) -> str | None:
        """The full id of a commit this repository has (None: it has no such commit)."""
        try:
            return self.git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}").strip()
        except subprocess.CalledProcessError:
            return None

    def short(self, commit: str) -> str:
        return self.git("rev-parse", "--short", commit).strip()

    def last_wrote(self, paths: Iterable[str]) -> str | None:
        """The last commit that changed any of ``paths`` (None: none ever did)."""
        return self.git("log", "-1", "--format=%H", "--", *paths).strip() or None

    def marked(self, since: str, head: str) -> list[Marked]:
        """The commits in ``since..head`` (reachable from head, not from since) whose message
        has a Results-unaffected trailer, oldest first."""
        out = self.git("log", "--reverse", "--format=%H%x1f%P%x1f%(trailers:key=" + TRAILER
                       + ",valueonly,separator=%x3b%x20)%x1e", f"{since}..{head}")
        found = []
        for record in out.split("\x1e"):
            fields = record.strip("\n").split("\x1f")
            if len(fields) == 3 and fields[2].strip():
                parents = fields[1].split()
                found.append(Marked(fields[0], parents[0] if parents else None,
                                    " ".join(fields[2].split())))
        return found

    def tree(self, commit: str) -> Tree:
        """The Python and C files of ``commit``."""
        if commit not in self._trees:
            blobs = {}
            for entry in self.git("ls-tree", "-r", "-z", commit).split("\0"):
                meta, _, path = entry.partition("\t")
                parts = meta.split()
                if len(parts) == 3 and parts[1] == "blob" and path.endswith((".py", ".c", ".h")):
                    blobs[path] = parts[2]
            self._trees[commit] = Tree(frozenset(blobs), lambda p, b=blobs: self.blob(b[p]))
        return self._trees[commit]

    def blob(self, sha: str) -> str:
        if sha not in self._blobs:
            if self._cat is None:
                self._cat = subprocess.Popen(["git", "-C", str(self.root), "cat-file", "--batch"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._cat.stdin.write(sha.encode() + b"\n")
            self._cat.stdin.flush()
            header = self._cat.stdout.readline().split()
            if len(header) != 3:
                raise KeyError(f"no blob {sha} in {self.root}")
            data = self._cat.stdout.read(int(header[2]))
            self._cat.stdout.read(1)
            self._blobs[sha] = data.decode("utf-8", "replace")
        return self._blobs[sha]

    def close(self) -> None:
        if self._cat is not None:
            self._cat.stdin.close()
            self._cat.wait()
            self._cat = None

    def __enter__(self) -> "Repo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

