"""The import boundaries between the operator and the agent, read from the source with ``ast``.

* the agent (``tailnet_agent``) never imports the operator (``tailnet_operator``): it ships in its
  own image, and what both sides share is the contract (``tailnet_agent.contract``);
* the operator imports nothing of the agent but the contract;
* the contract imports nothing of either package but itself, so importing it does not load the
  agent (its native extension, its control client);
* no import cycle among the modules of either package.

Every import counts, wherever it stands: at the top, inside a function (an import moved into a
function hides a cycle, it does not remove it) and under ``if TYPE_CHECKING:`` (the type checker
follows it, and a type named across the boundary is a piece of the contract spelled on the wrong
side).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tailnet_operator", "tailnet_agent")
CONTRACT = "tailnet_agent.contract"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imported(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every name ``module`` imports, with its line: ``from a import b`` yields ``a.b`` (b may be a
    module or a name in ``a``; callers trim it to the module); relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    base = module.split(".") if _is_package(path) else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                source = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                source = node.module or ""
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _edges(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (a name that is not a module, such as a
    class, counts as its module; a package's own ``__init__`` counts too)."""
    modules = _modules(package, root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, _ in _imported(module, path):
            if not _within(name, package):
                continue
            target = name
            while target and target not in modules:  # a class, or an extension module (.so)
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _crossings(package: str, allowed: set[str] | None = None, root: Path = ROOT) -> list[str]:
    other = next(p for p in PACKAGES if p != package)
    out = []
    for module, path in _modules(package, root).items():
        for name, line in _imported(module, path):
            if _within(name, other) and not (allowed and any(_within(name, a) for a in allowed)):
                out.append(f"{path.relative_to(root)}:{line}: {name}")
    return sorted(set(out))


def test_the_agent_never_imports_the_operator() -> None:
    assert _crossings("tailnet_agent") == []


def test_the_operator_imports_only_the_contract_from_the_agent() -> None:
    assert _crossings("tailnet_operator", allowed={CONTRACT}) == []


def test_the_contract_imports_only_itself() -> None:
    contract = {m: p for m, p in _modules("tailnet_agent").items() if _within(m, CONTRACT)}
    assert contract, "tailnet_agent/contract is missing"
    wrong = sorted(f"{p.relative_to(ROOT)}:{line}: {name}" for m, p in contract.items()
                   for name, line in _imported(m, p)
                   if any(_within(name, pkg) for pkg in PACKAGES) and not _within(name, CONTRACT))
    assert wrong == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    assert _cycles(_edges(package)) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_see_imports_inside_functions_and_under_type_checking(tmp_path: Path) -> None:
    """The checks themselves: a cycle closed by an in-function import or a TYPE_CHECKING import,
    relative imports, and a crossing hidden in a function all count."""
    _write(tmp_path, {
        "tailnet_agent/__init__.py": "",
        "tailnet_agent/a.py": "from tailnet_agent.b import B\n",
        "tailnet_agent/b.py": "def f() -> None:\n    from . import a\n",
        "tailnet_agent/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pkg.d import D\n",
        "tailnet_agent/pkg/__init__.py": "",
        "tailnet_agent/pkg/d.py": "from ..c import C\n\ndef g() -> None:\n    import tailnet_operator.clock\n",
        "tailnet_operator/__init__.py": "",
        "tailnet_operator/x.py": "from tailnet_agent.contract.clock import Clock\nfrom tailnet_agent import status\n",
    })
    assert _cycles(_edges("tailnet_agent", tmp_path)) == [
        ["tailnet_agent.a", "tailnet_agent.b"], ["tailnet_agent.c", "tailnet_agent.pkg.d"]]
    assert _crossings("tailnet_agent", root=tmp_path) == ["tailnet_agent/pkg/d.py:4: tailnet_operator.clock"]
    assert _crossings("tailnet_operator", {CONTRACT}, tmp_path) == ["tailnet_operator/x.py:2: tailnet_agent.status"]
