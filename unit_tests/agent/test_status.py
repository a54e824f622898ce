"""The /status document: which peer routes each target, the states, the probe fields."""

from __future__ import annotations

from datetime import UTC, datetime

from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.dns import Lookup
from tailnet_agent.probe import ProbeResult
from tailnet_agent.status import find_router, route_state, status_document

from .test_projection import KEY_A, ROUTER, netmap, node

WIDE = node(3, "wide.tailnet.test.", ["100.64.0.3/32"], Key=KEY_A, HomeDERP=7,
            AllowedIPs=["100.64.0.3/32", "198.18.0.0/16"], PrimaryRoutes=["198.18.0.0/16"])


def t(name: str, address: str, port: int = 5432) -> Target:
    return Target(name=name, address=address, ports=(PortMapping(port=port, listen=15432),))


def static(ip: str | None, error: str | None = None) -> Lookup:
    return Lookup(ip, error, float("inf"))


def test_router_is_the_peer_itself_or_the_most_specific_route() -> None:
    m = netmap([WIDE, ROUTER])
    assert find_router(m, "100.64.0.2") is m.peers[2]
    assert find_router(m, "198.18.5.7") is m.peers[2]  # /24 beats /16
    assert find_router(m, "198.18.6.7") is m.peers[3]
    assert find_router(m, "198.18.6.7", accept_routes=False) is None
    assert find_router(m, "203.0.113.1") is None  # the exit route never counts


def test_states() -> None:
    m = netmap([ROUTER])
    assert route_state(None, t("a", "x"), None).state == "Unknown"
    assert route_state(m, t("a", "ledger.example.internal"), None).state == "Unknown"
    unresolved = route_state(m, t("a", "ledger.example.internal"), static(None, "cannot resolve it"))
    assert (unresolved.state, unresolved.message) == ("Unresolved", "cannot resolve it")
    no_route = route_state(m, t("a", "198.18.9.1"), static("198.18.9.1"))
    assert (no_route.state, no_route.message) == ("NoRoute", "no peer in the netmap carries a route to 198.18.9.1")
    ready = route_state(m, t("a", "ledger.example.internal"), static("198.18.5.9"))
    assert (ready.state, ready.message) == (
        "Ready", "ledger.example.internal (198.18.5.9) routed by router.tailnet.test")
    assert route_state(m, t("a", "100.64.0.2"), static("100.64.0.2")).message == "100.64.0.2 is router.tailnet.test"


def test_document_shape_is_the_interface_the_operator_reads() -> None:
    m = netmap([ROUTER])
    checked = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    doc = status_document(
        netmap=m, hostname="egress-a", addresses=["100.64.0.1", "fd7a:115c:a1e0::1"],
        targets=(t("db", "198.18.5.9"), t("gone", "198.18.9.1", 80)),
        lookups={"198.18.5.9": static("198.18.5.9"), "198.18.9.1": static("198.18.9.1")},
        probes={"db": ProbeResult(True, 12.5, checked),
                "gone": ProbeResult(False, None, checked, "no_route: no route to 198.18.9.1")},
        targets_error="TAILNET_TARGETS_FILE is not valid JSON", loaded_at=checked)
    assert doc == {
        "node": {"id": "1", "name": "agent.tailnet.test", "addresses": ["100.64.0.1", "fd7a:115c:a1e0::1"]},
        "targets": [
            {"name": "db", "address": "198.18.5.9", "ports": [5432], "state": "Ready", "router": "router.tailnet.test",
             "routerId": "2", "message": "198.18.5.9 routed by router.tailnet.test", "reachable": True,
             "latencyMs": 12.5, "checkedAt": "2026-01-01T12:00:00Z"},
            {"name": "gone", "address": "198.18.9.1", "ports": [80], "state": "NoRoute", "router": None,
             "routerId": None, "message": "no peer in the netmap carries a route to 198.18.9.1; last probe failed: "
             "no_route: no route to 198.18.9.1", "reachable": False, "latencyMs": None,
             "checkedAt": "2026-01-01T12:00:00Z"}],
        "targetsFile": {"error": "TAILNET_TARGETS_FILE is not valid JSON", "loadedAt": "2026-01-01T12:00:00Z"},
    }
    before = status_document(netmap=None, hostname="egress-a", addresses=[], targets=(t("db", "198.18.5.9"),),
                             lookups={}, probes={})
    assert before["node"] == {"id": None, "name": "egress-a", "addresses": []}
    assert before["targets"][0]["state"] == "Unknown" and before["targets"][0]["checkedAt"] is None
