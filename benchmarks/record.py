"""Where a benchmark run's results go: the commit it measured, and the section of
docs/benchmarks.md it writes between its markers."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["commit", "load_average", "write_section"]


def commit() -> str:
    """The short HEAD of this checkout, marked when tracked files differ from it."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return f"{head}{' (with uncommitted changes)' if dirty else ''}"


def write_section(doc: Path, begin: str, end: str, text: str) -> None:
    """Replace the text between the markers in ``doc`` (appending the section when absent)."""
    current = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in current and end in current:
        head, _, rest = current.partition(begin)
        _, _, tail = rest.partition(end)
        doc.write_text(head + block + tail)
    else:
        doc.write_text(current.rstrip() + "\n\n" + block + "\n")


def load_average(before: Sequence[float], after: Sequence[float]) -> str:
    """How busy the machine was around a run, for the sentence of a section that states it."""
    start, end = (", ".join(f"{x:.1f}" for x in loads) for loads in (before, after))
    return f"Load average (1, 5, 15 min) {start} at the start, {end} at the end"
