"""What a result depends on, derived from the code that made it rather than listed by hand.

A result is made by a command whose *entry* (``entries.entry_of``) is the function a click
command runs or a module run as a script. ``dependencies`` follows, in one version of the
repository's files, everything that entry imports and loads within the repository:

* Python modules, statically (``ast``): ``import`` and ``from ... import`` statements anywhere in
  the code reached, lazy ones inside functions included (not those under ``if TYPE_CHECKING:``),
  relative ones resolved, with the parent packages' ``__init__`` files Python runs on the way;
  a ``from pkg import name`` naming a submodule is that submodule. Modules outside the
  repository are left out.
* Modules run in another interpreter: a string naming a repository module in dotted form, a
  task's ``"testbed.bench.serve.serve_node:serve"`` or ``f"{__name__}:probe"``, and the module of
  ``python_argv("switchd", ...)`` or of a ``"-m", "name"`` pair (with its ``__main__``).
* C sources: a string that is a ``.c``/``.h`` file name (``xdp.source("kvswitch.c")``,
  ``class P(Program, source="kvfetch.c")``, ``HERE / "lossy.c"``, ``... / "trafficgen.c"``),
  found beside the module, in ``xdp/`` or from the repository's root, and, whole, the files
  those ``#include "..."`` (beside the C file or in ``xdp/``, where the loader's ``-I`` looks).

What counts of a Python module is its top-level statements the entry reaches (``whole_modules``
False, the default): the one defining an imported name, and from each statement reached the
module-level names it uses, transitively (a class counts whole, methods and all); plus, for
every module imported, the statements that act when it is imported (calls, registrations
through a decorator of the repository's own, ``if``/``try`` blocks, a star import) — not its
plain definitions and imports, which only make names for others. So the policy evaluator, whose
command line module also imports the data plane for one constant, depends on that constant and
not on the data plane's program. A module imported as an object (``import xdp``, ``from pkg
import submodule``) or run with -m counts whole. ``whole_modules=True`` gives the coarser
module-level closure: every module reached counts whole (with all its imports followed)."""
from __future__ import annotations

import ast
import posixpath
import re
from dataclasses import dataclass
from functools import lru_cache

from .entries import Entry, places
from .gitread import Tree

Selection = frozenset[int] | None   # a Python file's top-level statements that count (None: all)

C_FILE = re.compile(r"[\w][\w./-]*\.[ch]")
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.\w+)+)(?::(\w+))?")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
C_DIRS = ("xdp",)                   # where xdp.source() and the loader's -I look
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
IMPORTS = (ast.Import, ast.ImportFrom)


def dependencies(tree: Tree, entry: Entry, whole_modules: bool = False) -> dict[str, Selection]:
    """The repository files ``entry`` runs in ``tree`` (one version of the repository), each
    with the top-level statements that count (None: the whole file, as every C file is), as the
    module docstring describes. The entry's code is looked for where it was in ``tree``
    (``located``: code that moved since is found where it was then). Empty when the entry's
    module is not in ``tree`` (its code did not exist then). An entry that is a function starts
    from the statement defining it alone; one its module does not define starts from the whole
    module."""
    walk = _Walk(tree, whole_modules)
    entry, start = located(tree, entry)
    if start is None:
        return {}
    walk.start(entry, start)
    return {path: None if chosen is None else frozenset(chosen)
            for path, chosen in walk.chosen.items()}


def why(tree: Tree, entry: Entry, path: str, whole_modules: bool = False) -> list[str]:
    """How ``entry`` reaches ``path``: the ``file:line`` of each step from the entry's module,
    ``path`` last (empty when it does not reach it)."""
    walk = _Walk(tree, whole_modules)
    entry, start = located(tree, entry)
    if start is None:
        return []
    walk.start(entry, start)
    if path not in walk.chosen:
        return []
    chain, node = [path], path
    while node in walk.via and len(chain) < 200:
        node, line = walk.via[node]
        chain.append(f"{node}:{line}" if line else node)
    return chain[::-1]


def located(tree: Tree, entry: Entry) -> tuple[Entry, str | None]:
    """Where ``entry``'s code is in ``tree``, and its module's file: the first of its places
    (``entries.places``: where it is now, then where it moved from) whose module is there and
    defines its function; else ``entry`` itself (its file None when not there)."""
    for place in places(entry):
        path = module_file(tree, place.module)
        if path and (place.function is None
                     or _defining(tree.read(path), place.function) is not None):
            return place, path
    return entry, module_file(tree, entry.module)


def module_file(tree: Tree, name: str) -> str | None:
    """The file of a dotted module name in ``tree`` (a package: its __init__), if there."""
    base = name.replace(".", "/")
    return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in tree.paths), None)


class _Walk:
    """The statements and files reached so far, and those still to look into."""

    def __init__(self, tree: Tree, whole_modules: bool):
        self.tree, self.coarse = tree, whole_modules
        self.chosen: dict[str, set[int] | None] = {}
        self.todo: list[tuple[str, int | None]] = []
        self.imported: set[str] = set()
        self.names: set[tuple[str, str]] = set()          # (module, name) followed
        self.via: dict[str, tuple[str, int | None]] = {}     # file -> (file, line) that reached it
        self.at: tuple[str, int | None] | None = None       # the statement being looked into

    def start(self, entry: Entry, path: str) -> None:
        self.parents(entry.module)
        top = _defining(self.tree.read(path), entry.function) if entry.function else None
        if top is None:
            self.whole(path)
        else:
            self.statement(path, top)
        self.run()

    def _reached(self, path: str) -> None:
        if path not in self.chosen and self.at and self.at[0] != path:
            self.via[path] = self.at

    def whole(self, path: str) -> None:
        if path in self.chosen and self.chosen[path] is None:
            return
        self._reached(path)
        before = self.chosen.get(path) or set()
        self.chosen[path] = None
        if path.endswith(".py"):
            self.todo += [(path, i) for i in range(len(_body(self.tree.read(path))))
                          if i not in before]
        else:
            self.todo.append((path, None))

    def statement(self, path: str, i: int) -> None:
        self._reached(path)
        chosen = self.chosen.setdefault(path, set())
        if chosen is not None and i not in chosen:
            chosen.add(i)
            self.todo.append((path, i))

    def module(self, name: str) -> str | None:
        """Module ``name`` is imported: its parents' and its own acting statements run."""
        self.parents(name)
        path = module_file(self.tree, name)
        if path and path not in self.imported:
            self.imported.add(path)
            self._reached(path)
            self.chosen.setdefault(path, set())
            if self.coarse:
                self.whole(path)
            for i in _acting(self.tree, path):
                self.statement(path, i)
        return path

    def parents(self, name: str) -> None:
        parts = name.split(".")
        for k in range(1, len(parts)):
            self.module(".".join(parts[:k]))

    def module_whole(self, name: str) -> None:
        path = self.module(name)
        if path:
            self.whole(path)

    def name(self, module: str, name: str) -> None:
        """``name`` of ``module`` is used (``from module import name``, a task's target)."""
        if (module, name) in self.names:
            return
        self.names.add((module, name))
        path = self.module(module)
        if module_file(self.tree, f"{module}.{name}"):    # a submodule, as a module object
            self.module_whole(f"{module}.{name}")
        for i, alias in _binders(self.tree.read(path)).get(name, ()) if path else ():
            self.binder(path, i, alias)

    def binder(self, path: str, i: int, alias: int | None) -> None:
        if alias is None:
            self.statement(path, i)
        else:           # one name of an import: follow it, the import's line does not count
            self.follow(path, _body(self.tree.read(path))[i], [alias])

    def follow(self, path: str, node: ast.Import | ast.ImportFrom, aliases=None) -> None:
        names = [node.names[a] for a in aliases] if aliases is not None else node.names
        if isinstance(node, ast.Import):
            for alias in names:
                self.module_whole(alias.name)
            return
        base = _from_base(path, node.level, node.module)
        for alias in names:
            if alias.name == "*":
                self.module_whole(base)
            else:
                self.name(base, alias.name)

    def run(self) -> None:
        while self.todo:
            path, i = self.todo.pop()
            text = self.tree.read(path)
            self.at = (path, None if i is None else _body(text)[i].lineno)
            if i is None:
                for name in INCLUDE.findall(text):
                    self.c_file(path, name)
                continue
            stmt = _body(text)[i]
            if isinstance(stmt, IMPORTS):   # reached whole: every name it imports
                self.follow(path, stmt)
                continue
            uses = _uses(text, path)[i]
            binders = _binders(text)
            for name in uses.names:
                for j, alias in binders.get(name, ()):
                    self.binder(path, j, alias)
            for node in uses.imports:
                self.follow(path, node)
            for s in uses.strings:
                self.string(path, s)
            for name in uses.tasks:
                self.name(_module_name(path), name)
            for name in uses.runs:
                self.module_whole(name)
                if module_file(self.tree, f"{name}.__main__"):
                    self.module_whole(f"{name}.__main__")

    def string(self, path: str, s: str) -> None:
        if C_FILE.fullmatch(s):
            self.c_file(path, s)
        elif (m := DOTTED.fullmatch(s)) and module_file(self.tree, m.group(1)):
            if m.group(2):
                self.name(m.group(1), m.group(2))
            else:
                self.module_whole(m.group(1))

    def c_file(self, near: str, name: str) -> None:
        candidates = [posixpath.normpath(posixpath.join(posixpath.dirname(near), name)),
                      *(posixpath.normpath(posixpath.join(d, name)) for d in C_DIRS), name]
        found = next((c for c in candidates if c in self.tree.paths), None)
        if found:
            self.whole(found)


@lru_cache(maxsize=None)
def _parse(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _body(text: str) -> list[ast.stmt]:
    return _parse(text).body


def _module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _from_base(path: str, level: int, module: str | None) -> str:
    """The module a ``from`` import in the file ``path`` names (relative ones resolved)."""
    parts = posixpath.dirname(path).split("/") if level else []
    if level > 1:
        parts = parts[:len(parts) - (level - 1)]
    return ".".join([p for p in parts if p] + ([module] if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(nodes):
    """Every node under ``nodes``, less the bodies of ``if TYPE_CHECKING:``."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _string(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _own_task(node: ast.JoinedStr) -> str | None:
    """``f"{__name__}:func"``, a task naming a function of its own module: that function."""
    v = node.values
    if (len(v) == 2 and isinstance(v[0], ast.FormattedValue)
            and isinstance(v[0].value, ast.Name) and v[0].value.id == "__name__"
            and (s := _string(v[1])) and re.fullmatch(r":\w+", s)):
        return s[1:]
    return None


def _run_modules(node) -> list[str]:
    """Modules run in another interpreter: python_argv("name", ...) and "-m", "name"."""
    if isinstance(node, ast.Call):
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if called == "python_argv" and node.args and (s := _string(node.args[0])):
            return [s]
        items = node.args
    elif isinstance(node, (ast.List, ast.Tuple)):
        items = node.elts
    else:
        return []
    return [s for a, b in zip(items, items[1:]) if _string(a) == "-m" and (s := _string(b))]


@dataclass(frozen=True)
class _Uses:
    """What one top-level statement uses: names, the imports inside it, strings, the functions
    of its own module it runs as tasks, the modules it runs with -m."""
    names: frozenset[str]
    imports: tuple[ast.Import | ast.ImportFrom, ...]
    strings: frozenset[str]
    tasks: frozenset[str]
    runs: tuple[str, ...]


@lru_cache(maxsize=None)
def _uses(text: str, path: str) -> list[_Uses]:
    """What each top-level statement of a Python file uses (by index)."""
    out = []
    for stmt in _body(text):
        names, imports, strings, tasks, runs = set(), [], set(), set(), []
        for node in _walk([stmt]):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, IMPORTS):
                imports.append(node)
            elif (s := _string(node)) is not None:
                strings.add(s)
            elif isinstance(node, ast.JoinedStr) and (target := _own_task(node)):
                tasks.add(target)
            runs += _run_modules(node)
        out.append(_Uses(frozenset(names), tuple(imports), frozenset(strings), frozenset(tasks),
                         tuple(runs)))
    return out


@lru_cache(maxsize=None)
def _binders(text: str) -> dict[str, list[tuple[int, int | None]]]:
    """Module-level name -> the top-level statements binding it: (index, None) for a statement
    that counts whole, (index, alias index) for one name of an import statement."""
    found: dict[str, list[tuple[int, int | None]]] = {}
    for i, stmt in enumerate(_body(text)):
        if isinstance(stmt, IMPORTS):
            for a, alias in enumerate(stmt.names):
                bound = alias.asname or (alias.name.split(".")[0]
                                         if isinstance(stmt, ast.Import) else alias.name)
                found.setdefault(bound, []).append((i, a))
            continue
        names = {stmt.name} if isinstance(stmt, DEFS) else set()
        for node in ast.walk(stmt) if not isinstance(stmt, DEFS) else ():
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, DEFS):
                names.add(node.name)
            elif isinstance(node, IMPORTS):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for name in names:
            found.setdefault(name, []).append((i, None))
    return found


def _defining(text: str, function: str) -> int | None:
    """The top-level statement defining a function (a qualname: its outermost part)."""
    first = function.split(".")[0]
    return next((i for i, s in enumerate(_body(text)) if isinstance(s, DEFS) and s.name == first),
                None)


def _acting(tree: Tree, path: str) -> list[int]:
    """The top-level statements of a module that act when it is imported, beyond making names:
    all but docstrings, imports (not star ones), assignments to names, and definitions whose
    decorators all come from outside the repository (``dataclass``, ``click.command``)."""
    text = tree.read(path)
    binders = _binders(text)
    body = _body(text)

    def own(decorator: ast.expr) -> bool:
        while isinstance(decorator, (ast.Call, ast.Attribute)):
            decorator = decorator.func if isinstance(decorator, ast.Call) else decorator.value
        if not isinstance(decorator, ast.Name):
            return True
        for i, alias in binders.get(decorator.id, [(None, None)]):
            if i is None:
                return False                            # a builtin
            if alias is None:
                return True                             # defined here
            stmt = body[i]
            name = (stmt.names[alias].name if isinstance(stmt, ast.Import)
                    else _from_base(path, stmt.level, stmt.module))
            if module_file(tree, name.split(".")[0]):
                return True
        return False

    acting = []
    for i, stmt in enumerate(body):
        if isinstance(stmt, DEFS):
            if any(own(d) for d in stmt.decorator_list):
                acting.append(i)
        elif isinstance(stmt, IMPORTS):
            if any(a.name == "*" for a in stmt.names):
                acting.append(i)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if not all(isinstance(t, (ast.Name, ast.Tuple)) and all(
                    isinstance(n, ast.Name) for n in (t.elts if isinstance(t, ast.Tuple) else [t]))
                    for t in targets):
                acting.append(i)
        elif not (isinstance(stmt, ast.Expr) and _string(stmt.value) is not None):
            acting.append(i)
    return acting
