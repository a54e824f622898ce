"""Every condition reason the operator can set is documented in docs/reference/status.md.

The reasons are found by reading the source, not by running it, so a reason on a path no test
reaches still counts. The search starts at the ``reason`` of ``Cond`` and follows each value
back to its string literals: through local assignments (tuple unpacking, ``:=``, ``a if c else
b``, ``x[0]``), the return values of the function it was called from, the parameters of the
function it sits in (then every call of that function is followed too), and, for ``obj.field``,
every class of the package with a field of that name. A value at a ``Cond`` reason, or at a
parameter that reaches one, that cannot be followed to literals fails the test: the reason would
be unknown to it. Values reached through ``obj.field`` are read leniently (classes with a field of
the same name may hold other things), so only their CamelCase literals count.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tailnet_operator"
STATUS_DOC = ROOT / "docs" / "reference" / "status.md"
REASON = re.compile(r"^[A-Z][A-Za-z0-9]*$")
"""metav1.Condition's reason: one CamelCase word."""


@dataclass(frozen=True)
class Sink:
    """A place a reason is passed: parameter ``param`` of every callable named ``callee``."""

    callee: str
    param: str
    strict: bool


@dataclass
class _Source:
    path: Path
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node

    def enclosing(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.Module:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return node
        return self.tree


Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Module


class ReasonCollector:
    """Walks the package's sources from ``Cond``'s reason to every literal that can reach it."""

    def __init__(self, package: Path = PACKAGE) -> None:
        self.root = package.parent
        self.sources = [_Source(p, ast.parse(p.read_text(encoding="utf-8"), str(p)))
                        for p in sorted(package.rglob("*.py"))]
        self._calls: dict[str, list[tuple[_Source, ast.Call]]] = defaultdict(list)
        self._functions: dict[str, list[tuple[_Source, ast.FunctionDef | ast.AsyncFunctionDef]]] = defaultdict(list)
        self._classes: list[ast.ClassDef] = []
        for source in self.sources:
            for node in ast.walk(source.tree):
                if isinstance(node, ast.Call) and (name := _name(node.func)):
                    self._calls[name].append((source, node))
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self._functions[node.name].append((source, node))
                elif isinstance(node, ast.ClassDef):
                    self._classes.append(node)
        self.reasons: dict[str, set[str]] = {}
        """Reason -> where it is written (``path:line``)."""
        self.unresolved: list[str] = []
        self._seen: set[Sink] = set()
        self._visited: set[tuple[int, int | None, bool]] = set()
        """Values already followed: a function that returns a call of a namesake would loop."""

    def collect(self) -> None:
        pending = [Sink("Cond", "reason", strict=True)]
        while pending:
            sink = pending.pop()
            if sink in self._seen or Sink(sink.callee, sink.param, True) in self._seen:
                continue
            self._seen.add(sink)
            pending.extend(self._follow(sink))

    # -- call sites ---------------------------------------------------------------------------

    def _follow(self, sink: Sink) -> Iterator[Sink]:
        index = self._position(sink)
        for source, call in self._calls[sink.callee]:
            if (found := _argument(call, sink.param, index)) is not None:
                expr, element = found
                yield from self._resolve(source, expr, source.enclosing(call), element, sink.strict)

    def _position(self, sink: Sink) -> int | None:
        """Index of ``sink.param`` among the callee's parameters (``self`` excluded), if one is defined."""
        for cls in self._classes:
            if cls.name == sink.callee and sink.param in (fields := _fields(cls)):
                return fields.index(sink.param)
        for _, func in self._functions[sink.callee]:
            if sink.param in (params := _params(func)):
                return params.index(sink.param)
        return None

    # -- values -------------------------------------------------------------------------------

    def _resolve(self, source: _Source, expr: ast.expr, scope: Scope, element: int | None,
                 strict: bool) -> Iterator[Sink]:
        if (id(expr), element, strict) in self._visited:
            return
        self._visited.add((id(expr), element, strict))
        where = f"{source.path.relative_to(self.root)}:{expr.lineno}"
        if isinstance(expr, ast.Constant) and element is None:
            if isinstance(expr.value, str) and (strict or REASON.match(expr.value)):
                self.reasons.setdefault(expr.value, set()).add(where)
            elif expr.value is not None and strict:
                self.unresolved.append(f"{where}: {ast.unparse(expr)}")
        elif isinstance(expr, ast.Constant) and expr.value is None:
            return
        elif isinstance(expr, ast.Tuple) and element is not None:
            yield from self._resolve(source, expr.elts[element], scope, None, strict)
        elif isinstance(expr, ast.IfExp):
            yield from self._resolve(source, expr.body, scope, element, strict)
            yield from self._resolve(source, expr.orelse, scope, element, strict)
        elif isinstance(expr, ast.Subscript) and element is None and isinstance(expr.slice, ast.Constant) \
                and isinstance(expr.slice.value, int):
            yield from self._resolve(source, expr.value, scope, expr.slice.value, strict)
        elif isinstance(expr, ast.Name):
            yield from self._resolve_name(source, expr, scope, element, strict)
        elif isinstance(expr, ast.Call) and (returns := self._returns(_name(expr.func))):
            for def_source, returned, func in returns:
                yield from self._resolve(def_source, returned, func, element, strict)
        elif isinstance(expr, ast.Attribute) and element is None:
            yield from (Sink(cls, expr.attr, strict=False) for cls in self._classes_with(expr.attr))
        elif strict:
            self.unresolved.append(f"{where}: {ast.unparse(expr)}")

    def _resolve_name(self, source: _Source, name: ast.Name, scope: Scope, element: int | None,
                      strict: bool) -> Iterator[Sink]:
        if not isinstance(scope, ast.Module) and name.id in _params(scope) and element is None:
            yield Sink(scope.name, name.id, strict)
            return
        values = list(_assignments(scope, name.id, element))
        if not values and not isinstance(scope, ast.Module):
            values = list(_assignments(source.tree, name.id, element))
        if not values and strict:
            self.unresolved.append(f"{source.path.relative_to(self.root)}:{name.lineno}: {name.id}")
        for value, index in values:
            yield from self._resolve(source, value, scope, index, strict)

    def _returns(self, callee: str | None) -> list[tuple[_Source, ast.expr, Scope]]:
        """What the functions named ``callee`` return (with where), for a value a call produced."""
        return [(source, r.value, func) for source, func in self._functions[callee or ""]
                for r in _own_returns(func) if r.value is not None]

    def _classes_with(self, attr: str) -> set[str]:
        return {cls.name for cls in self._classes if attr in _fields(cls)}


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = [a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _fields(cls: ast.ClassDef) -> list[str]:
    """A class's constructor parameters: its ``__init__``'s, else its annotated fields (dataclass)."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return _params(node)
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def _argument(call: ast.Call, param: str, index: int | None) -> tuple[ast.expr, int | None] | None:
    """The expression passed as ``param`` (and which element of it, for ``*args``), if any."""
    for keyword in call.keywords:
        if keyword.arg == param:
            return keyword.value, None
    if index is None:
        return None
    for position, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            return (arg.value, index - position) if position <= index else None
        if position == index:
            return arg, None
    return None


def _assignments(scope: Scope, name: str, element: int | None) -> Iterator[tuple[ast.expr, int | None]]:
    """Every value bound to ``name`` in ``scope`` (with the tuple position it takes, if unpacked)."""
    for node in ast.walk(scope):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and target.id == name:
                yield value, element
            elif isinstance(target, ast.Tuple) and element is None:
                for position, item in enumerate(target.elts):
                    if isinstance(item, ast.Name) and item.id == name:
                        yield value, position


def _own_returns(func: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.Return]:
    """The function's return statements, not those of functions nested in it."""
    stack: list[ast.AST] = list(func.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def documented_reasons(text: str) -> set[str]:
    """The reasons in the ``reason`` column of the doc's condition tables (not its prose)."""
    documented: set[str] = set()
    column: int | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            column = cells.index("reason") if "reason" in cells else -1
        elif column >= 0 and column < len(cells):
            documented.update(re.findall(r"`([^`]+)`", cells[column]))
    return documented


@cache
def collected() -> ReasonCollector:
    collector = ReasonCollector()
    collector.collect()
    return collector


def test_collector_follows_every_reason_to_a_literal() -> None:
    collector = collected()
    assert not collector.unresolved, (
        "these condition reasons are not string literals the test can follow; write them as literals "
        "(or teach this test the new shape):\n" + "\n".join(collector.unresolved))
    assert {"Connected", "TagNotOwned", "AgentStatusUnknown", "NamespaceNotTenant"} <= set(collector.reasons)


def test_every_condition_reason_is_documented() -> None:
    collector = collected()
    documented = documented_reasons(STATUS_DOC.read_text(encoding="utf-8"))
    missing = {r: sorted(w) for r, w in collector.reasons.items() if r not in documented}
    assert not missing, (
        "condition reasons set in code but absent from the reason column of docs/reference/status.md:\n"
        + "\n".join(f"  {r} ({', '.join(w)})" for r, w in sorted(missing.items())))
    malformed = sorted(r for r in collector.reasons if not REASON.match(r))
    assert not malformed, f"reasons must be one CamelCase word: {malformed}"


def test_collector_follows_the_shapes_reasons_take(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text('''
from dataclasses import dataclass

@dataclass
class Cond:
    type: str
    status: str
    reason: str
    message: str = ""

@dataclass
class Problem:
    reason: str
    message: str

def problem() -> Problem:
    return Problem("FromAField", "m")

def pair(ok: bool) -> tuple[str, str] | None:
    return ("FromATuple", "m") if ok else None

def not_ready(obj, status, reason, message):
    return Cond("Ready", status, reason, message)

def reconcile(obj, error: Exception) -> None:
    Cond("Ready", "True", "Literal")
    Cond(type="Ready", status="False", reason="Keyword", message="")
    chosen, note = "Unpacked", ""
    Cond("Ready", "True", chosen if obj else "Chosen", note)
    not_ready(obj, "False", "ThroughAParameter", "m")
    if found := pair(True):
        not_ready(obj, "False", *found)
    Cond("Ready", "False", problem().reason, "")
    Cond("Ready", "False", str(error), "")
''')
    collector = ReasonCollector(package)
    collector.collect()
    assert set(collector.reasons) == {"Literal", "Keyword", "Unpacked", "Chosen", "ThroughAParameter", "FromATuple",
                                      "FromAField"}
    assert [u.split(": ", 1)[1] for u in collector.unresolved] == ["str(error)"]


def test_documented_reasons_reads_only_the_reason_column() -> None:
    text = ("| condition | status | reason | when |\n|---|---|---|---|\n"
            "| Ready | False | `A`, `B` / `C` | `NotAReason` in prose |\n\nprose `Prose`\n\n"
            "| route | when |\n|---|---|\n| `Unknown` | x |\n")
    assert documented_reasons(text) == {"A", "B", "C"}
