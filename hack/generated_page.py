"""The command line of a generator of one committed page (``hack.api_doc``, ``hack.metrics_doc``):
write the page, or with ``--check`` exit 1 when the committed page differs from what it renders."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(module: str, page: Path, render: Callable[[], str], description: str,
         argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not page.is_file() or page.read_text() != text:
            print(f"{page.relative_to(REPO)} is out of date: run python -m {module}", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    print(f"wrote {page.relative_to(REPO)}", file=sys.stderr)
    return 0
