"""The local node's host side: a run killed before its teardown does not block the next one.

Runs in the node part (``--tiers node``), before the session's cluster starts: it takes the host's
node lock and its bridge itself, which that cluster holds until the session ends."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import pytest

from hack.localenv import hostnet
from hack.localenv.node import reclaim_killed_run

from .conftest import require_local_node

pytestmark = [pytest.mark.integration, pytest.mark.before_cluster]

SETUP_WAIT = 120.0
"""Seconds the stand-in node may wait for the host's node lock (another run's node ending)."""

_KILLED_NODE = """
import sys, time
from hack.localenv import hostnet
hostnet.HostNetwork().setup(run_id=sys.argv[1])
print("up", flush=True)
time.sleep(600)
"""


@pytest.fixture
def killed_node(tmp_path: Path) -> str:
    """The host network of a node whose process was killed before its teardown: its bridge,
    route, guard table and record stay, its lock is gone with it."""
    require_local_node()
    run_id = f"killed-{tmp_path.name}"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_NODE, run_id], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parent.parent)
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], SETUP_WAIT)
        assert ready, (f"the stand-in node did not take the host within {SETUP_WAIT:.0f}s: another local node "
                       f"holds {hostnet.LOCK}")
        assert child.stdout.readline().strip() == "up", "the stand-in node did not set up the host network"
    finally:
        child.kill()
        child.wait(timeout=30)
    assert hostnet.link_exists(hostnet.NODE_BRIDGE)
    assert hostnet.RECORD.exists()
    return run_id


def test_a_node_started_after_a_killed_one_reclaims_the_host(killed_node: str) -> None:
    host = hostnet.HostNetwork().setup(run_id="after-a-killed-run", reclaim=reclaim_killed_run)
    try:
        assert hostnet.link_exists(hostnet.NODE_BRIDGE)
        assert "after-a-killed-run" in hostnet.RECORD.read_text()
        assert hostnet.unreachable_route_present(hostnet.CLUSTER_RANGE)
    finally:
        left = host.restore()
    assert left == []
    assert not hostnet.link_exists(hostnet.NODE_BRIDGE)
    assert not hostnet.RECORD.exists()


def test_without_a_reclaim_the_killed_run_s_leftovers_are_named(killed_node: str) -> None:
    with pytest.raises(hostnet.HostNetworkError, match=f"link {hostnet.NODE_BRIDGE}"):
        hostnet.HostNetwork().setup(run_id="refused")
    assert reclaim_killed_run() == []
    assert not hostnet.link_exists(hostnet.NODE_BRIDGE)
