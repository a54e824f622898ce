"""Every relative link in the docs and the chart's README names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md",
                REPO / "manifests/chart/tailnet-operator/README.md"])
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"`[^`\n]*`", "", page.read_text())  # code spans (regular expressions) are not links
    broken = [target for target, _ in LINK.findall(text)
              if not re.match(r"^[a-z]+:", target) and not (page.parent / target).exists()]
    assert not broken, broken


def test_the_docs_index_reaches_every_diataxis_quadrant() -> None:
    index = (REPO / "docs" / "README.md").read_text()
    for quadrant in ("Tutorial", "How-to", "Reference", "Explanation"):
        assert f"**{quadrant}**" in index
