"""What changed in the code a result measures: the code an entry runs (``depends``) at the
commit the result was made on against the same at HEAD, each as one multiset of code lines —
Python as its syntax tree without docstrings and imports, C without comments and includes — so
code moved between files or modules and reworded comments change nothing, while any changed
statement counts. Commits whose message ends with a ``Results-unaffected: <evidence>`` trailer
(git's trailers: the message's last paragraph; code moved or renamed, say "compiled programs
identical; tests unchanged") are taken at their word: what each changed (the code at it against
the code at its first parent) is not counted."""
from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from .depends import Selection, dependencies
from .entries import Entry
from .gitread import Marked, Repo


def code_lines(text: str, path: str, statements: Selection = None) -> Counter:
    """The statements of a source file as a multiset of lines, without what cannot change
    behaviour: Python's docstrings, comments, imports and layout; C's comments and includes.
    ``statements``: only these top-level statements of a Python file (None: all)."""
    if not path.endswith(".py"):
        return Counter(_c_lines(text))
    each = _python_lines(text)
    total: Counter = Counter()
    for i, lines in enumerate(each):
        if statements is None or i in statements:
            total.update(lines)
    return total


@lru_cache(maxsize=None)
def _c_lines(text: str) -> Counter:
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
    return _normal(ln for ln in text.splitlines() if not ln.lstrip().startswith("#include"))


@lru_cache(maxsize=None)
def _python_lines(text: str) -> list[Counter]:
    """The code lines of each top-level statement, docstrings left out (one multiset of all
    lines if the file does not parse: compared as text)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [_normal(text.splitlines())]
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and _is_docstring(body[0]):
            node.body = body[1:] or [ast.Pass()]
    return [Counter() if i == 0 and _is_docstring(stmt)
            else _normal(ln for ln in ast.unparse(stmt).splitlines()
                         if not ln.lstrip().startswith(("import ", "from ")))
            for i, stmt in enumerate(tree.body)]


def _is_docstring(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str))


def _normal(lines) -> Counter:
    return Counter(" ".join(ln.split()) for ln in lines if ln.strip())


@dataclass
class Change:
    """How the code a result measures differs now from when it was made."""
    lines: int = 0                                  # code lines added or removed, net
    files: list[str] = field(default_factory=list)  # where those lines are now or were then
    skipped: list[Marked] = field(default_factory=list)  # Results-unaffected commits that
    #                                                     changed its code, not counted


class Code:
    """The code entries run at the commits of one repository, cached per commit and entry."""

    def __init__(self, repo: Repo):
        self.repo = repo
        self._files: dict[tuple[str, Entry], dict[str, Counter]] = {}

    def files(self, commit: str, entry: Entry) -> dict[str, Counter]:
        """Each file ``entry`` runs at ``commit`` -> the code lines of it that count."""
        key = (commit, entry)
        if key not in self._files:
            tree = self.repo.tree(commit)
            self._files[key] = {path: code_lines(tree.read(path), path, part)
                                for path, part in dependencies(tree, entry).items()}
        return self._files[key]

    def lines(self, commit: str, entry: Entry) -> Counter:
        total: Counter = Counter()
        for lines in self.files(commit, entry).values():
            total.update(lines)
        return total

    def since(self, commit: str, head: str, entry: Entry,
              marked: list[Marked] | None = None) -> Change:
        """What changed in the code ``entry`` runs from ``commit`` to ``head``, less what the
        Results-unaffected commits among ``commit..head`` changed (``marked``; looked up when
        None). With those commits in a line, this is the sum of the changes between them; in
        general, head's lines less commit's, less each marked commit's less its parent's."""
        if marked is None:
            marked = self.repo.marked(commit, head)
        net = Counter(self.lines(head, entry))
        net.subtract(self.lines(commit, entry))
        skipped = []
        for m in marked:
            if m.parent is None:
                continue
            own = Counter(self.lines(m.commit, entry))
            own.subtract(self.lines(m.parent, entry))
            if any(own.values()):
                net.subtract(own)
                skipped.append(m)
        added = {ln for ln, n in net.items() if n > 0}
        removed = {ln for ln, n in net.items() if n < 0}
        now, then = self.files(head, entry), self.files(commit, entry)
        where = ({f for f, c in now.items() if added & c.keys()}
                 | {f for f, c in then.items() if removed & c.keys()})
        return Change(sum(abs(n) for n in net.values()), sorted(where), skipped)
