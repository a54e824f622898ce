"""The ``--tiers`` option, a plugin loaded from pyproject's ``addopts`` so that it is known before
any conftest is: ``hack.suite`` runs the suite as two processes side by side, one per part."""

from __future__ import annotations

import hypothesis  # noqa: F401
import pytest

# Imported here, at start-up: hypothesis's plugin imports it only when printing the summary, and
# by then Python 3.11.7's AST validator can fail the assertion rewrite of its modules with
# "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905), failing a run whose
# tests all passed.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tiers", choices=["local", "node"], default=None,
        help="run one part of the suite: 'local' (the unit tests and tiers 1-2: Headscale, tailscaled, "
             "the control plane) or 'node' (tier 3: the local node and whatever starts its own "
             "binaries); without it, everything runs.")
