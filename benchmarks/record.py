"""Where a benchmark run's results go: the commit it measured, and the section of
docs/benchmarks.md it writes between its markers."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["commit", "conditions", "load_average", "publish", "write_section"]


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


def conditions(load_before: Sequence[float]) -> str:
    """The sentence of a section that says what was measured and how busy the machine was, from
    the load average at the start of the run to now."""
    return f"Commit {commit()}. {load_average(load_before, os.getloadavg())}."


def publish(text: str, doc: dict[str, Any], *, json_path: Path | None, doc_path: Path | None, name: str) -> None:
    """Print a run's section, write its document as JSON to ``json_path`` and the section between
    the ``bench:<name>`` markers of ``doc_path`` (each when given)."""
    print(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    if doc_path:
        write_section(doc_path, f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->", text)
