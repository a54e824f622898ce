"""Entry point of the agent. AGENT_MODE selects the direction and has no default."""

from __future__ import annotations

import os
import sys

MODES = ("egress", "ingress")


def main() -> int:
    mode = os.environ.get("AGENT_MODE", "")
    if mode not in MODES:
        shown = repr(mode) if mode else "unset"
        print(f"tailnet-agent: AGENT_MODE is {shown}; set it to one of: {', '.join(MODES)}", file=sys.stderr)
        return 2
    print(f"tailnet-agent: mode {mode} is not implemented in this release", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
