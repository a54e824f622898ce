"""The suite's order: the tests that need fewer binaries run first, so that ``make test`` runs
them while its background build makes the rest."""

from __future__ import annotations

from pathlib import Path

from e2e.conftest import TIER_PARTS, binaries_tier, module_tiers, run_order


def test_a_test_s_fixtures_say_what_it_needs_built() -> None:
    assert binaries_tier(["headscale", "tailscale_nodes", "site_host", "tmp_path"]) == 1
    assert binaries_tier(["admin", "headscale", "operator_namespace"]) == 2
    assert binaries_tier(["control_plane"]) == 2
    assert binaries_tier(["admin", "cluster", "headscale"]) == 3
    assert binaries_tier(["tmp_path", "monkeypatch"]) is None


def test_a_module_runs_with_its_most_demanding_test() -> None:
    a, b, c = Path("e2e/test_a.py"), Path("e2e/test_b.py"), Path("e2e/test_c.py")
    tiers = module_tiers([
        (a, ["tmp_path"]), (a, ["headscale"]), (a, ["control_plane"]),  # pure tests ride along
        (b, ["cluster"]), (b, []),
        (c, ["tmp_path"]), (c, []),  # starts its own binaries: last
    ])
    assert tiers == {a: 2, b: 3, c: 3}


def test_the_two_parts_share_no_tier_and_leave_none_out() -> None:
    """``hack.suite`` runs ``--tiers local`` beside ``--tiers node``: every tier in exactly one."""
    local, node = TIER_PARTS["local"], TIER_PARTS["node"]
    assert not local & node
    assert local | node == {0, 1, 2, 3}
    assert 3 in node, "only the node part may start the local node"


def test_a_module_that_takes_the_node_lock_runs_before_the_cluster_s_modules() -> None:
    """The session's cluster holds the host's node lock from its first test to the session's end:
    a module that takes the lock itself must come first in its tier, or it waits for a lock its
    own session holds."""
    modules = {"test_cluster.py": (3, False), "test_localnode_host.py": (3, True), "test_crds.py": (2, False)}
    ordered = sorted(modules, key=lambda m: run_order(modules[m][0], before_cluster=modules[m][1]))
    assert ordered == ["test_crds.py", "test_localnode_host.py", "test_cluster.py"]


def test_a_quiet_module_runs_last_in_its_tier() -> None:
    """A module that measures loss runs after the rest of its part, when ``hack.suite``'s other part
    has ended and the machine is quieter."""
    modules = {"test_agent_disruption.py": (3, False, True), "test_cluster.py": (3, False, False),
               "test_localnode_host.py": (3, True, False), "test_crds.py": (2, False, False)}
    ordered = sorted(modules, key=lambda m: run_order(modules[m][0], before_cluster=modules[m][1],
                                                      quiet=modules[m][2]))
    assert ordered == ["test_crds.py", "test_localnode_host.py", "test_cluster.py", "test_agent_disruption.py"]
