"""Run the test suite as two pytest processes side by side: ``make test``'s last step.

The node part (tier 3: the local node, the operator installed in it, chaos, cyclonus) waits on
pods most of the time; the local part (the unit tests and tiers 1-2: Headscale, tailscaled and a
control plane on 127.0.0.1) waits on processes. On two cores they overlap well, and neither
touches what the other uses: ports are picked free, site hosts claim their subnets under a lock
(``hack/localenv/netns.py``), and only the node part changes the host's network.

Tests marked ``quiet`` measure loss under disruption; on two cores, the local part's load
beside them (a load average of 10 and more) stalls the tailscaled peers and Headscale they rely
on for seconds. The node part runs them last and starts them once the local part has ended
(``QUIET_AFTER``, read by ``e2e/conftest.py``).

The local part prints to the terminal as it runs; the node part's output goes to
``_artifacts/node-part.log`` and is printed when both have ended. The exit status is the first
failing part's. ``python -m hack.suite [pytest arguments]``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_LOG = ROOT / "_artifacts" / "node-part.log"
LOCAL_ENDED = ROOT / "_artifacts" / "local-part-ended"
QUIET_AFTER = "TAILNET_SUITE_QUIET_AFTER"
"""The node part's environment variable naming the file whose existence says the local part ended."""


def pytest_command(part: str, args: Sequence[str]) -> list[str]:
    """The pytest command line of one part."""
    return [sys.executable, "-m", "pytest", "--tiers", part, *args]


def main(argv: Sequence[str]) -> int:
    NODE_LOG.parent.mkdir(parents=True, exist_ok=True)
    LOCAL_ENDED.unlink(missing_ok=True)
    started = time.monotonic()
    with NODE_LOG.open("wb") as log:
        node = subprocess.Popen(pytest_command("node", argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, QUIET_AFTER: str(LOCAL_ENDED)})
        print(f"suite: the node part runs beside this one; its output: {NODE_LOG}", flush=True)
        try:
            try:
                local_status = subprocess.call(pytest_command("local", argv), cwd=ROOT)
            finally:
                LOCAL_ENDED.touch()
            local_time = time.monotonic() - started
            print(f"suite: the local part ended ({local_status}) after {local_time:.0f}s; waiting for the node part",
                  flush=True)
            node_status = node.wait()
        except BaseException:
            # The node part's own session teardown stops its processes and the local node.
            os.killpg(node.pid, signal.SIGINT)
            node.wait()
            raise
    print(f"\n===== the node part ({node_status}) after {time.monotonic() - started:.0f}s =====", flush=True)
    sys.stdout.write(NODE_LOG.read_text(errors="replace"))
    sys.stdout.flush()
    return local_status or node_status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
