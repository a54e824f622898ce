"""The shape of ``tailnet_agent.forward``: the http package's public names, and no class or
function grown past what one reader holds at once (issue 23: one concept a module)."""

from __future__ import annotations

import ast
from pathlib import Path

import tailnet_agent.forward.http as http

FORWARD = Path(__file__).resolve().parents[2] / "tailnet_agent" / "forward"
MAX_CLASS, MAX_FUNCTION = 250, 60


def test_the_http_package_exports_what_its_users_import() -> None:
    assert http.__all__ == sorted(http.__all__)
    assert all(hasattr(http, name) for name in http.__all__)


def test_no_class_or_function_in_forward_is_too_long() -> None:
    too_long = []
    for path in sorted(FORWARD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > limit:
                    too_long.append(f"{path.relative_to(FORWARD)}:{node.lineno} {node.name}: {size} > {limit}")
    assert too_long == []
