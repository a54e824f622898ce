"""An ingress whose replicas share an address: the real agent processes (``python -m tailnet_agent``,
ingress, ``TAILNET_SHARED_ADDRESS``) against a real Headscale and a tailscaled laptop that accepts
routes.

Each replica advertises the shared address as a /32 route; Headscale sends it to one of them (the
primary) and moves it when that one goes. A replica told to stop withdraws its route and keeps
accepting until Headscale has moved it, so the laptop's requests to the address, each a new
connection every 20 ms, are never refused while the primary is replaced; the same load by
MagicDNS name over a name hand-over (``test_agent_shutdown.py``) finds no node of the name for
about a second. What the move adds (a connection open at the instant the route moves is cut) is counted,
not failed, and so is a request that hangs (docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from e2e.test_agent_egress import TAG
from e2e.test_agent_ingress import hello
from e2e.test_agent_shutdown import UNANSWERED, IngressProcess, Load, _up, answers, tear_down
from hack.localenv import Headscale, TailscaleNode, free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the shared address is fenced by an unreachable route"),
]

SHARED = "198.18.251.10"
"""Inside the tests' range and outside the site hosts' (198.18.1.0 to 198.18.250.255)."""
ROUTE = f"{SHARED}/32"
REFUSED = "ConnectionError: CONNECT refused"
"""How a request the laptop could not open fails (tailscaled's proxy answers the CONNECT with an
error): what a replica that stopped accepting too early, or no replica holding the route, gives. A
request whose connection was open when the route moved fails otherwise (its packets go to the new
primary, which knows nothing of it): the move's cost, counted, not failed."""


@pytest.fixture
def fenced() -> Iterator[str]:
    """An ``unreachable`` route over the shared address: a laptop that dialled it from the host (the
    route not taken over the tailnet) fails at once, and no packet to it leaves the machine."""
    subprocess.run(["ip", "route", "replace", "unreachable", ROUTE], check=True)
    try:
        yield SHARED
    finally:
        subprocess.run(["ip", "route", "del", "unreachable", ROUTE], check=False)


def primary_of(laptop: TailscaleNode) -> str | None:
    """The hostname of the peer the laptop sends the shared address to, if any."""
    for peer in laptop.peers():
        if ROUTE in (peer.get("PrimaryRoutes") or ()):
            return str(peer.get("HostName"))
    return None


async def test_a_replaced_primary_hands_the_shared_address_over_without_refusing_a_request(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path, fenced: str) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-shared", headscale, authkey=key, accept_routes=True)
    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    backend, listen = server.sockets[0].getsockname()[1], free_port()
    # A connection open across the move is cut (below): its socket on the old replica then waits out
    # the drain deadline, kept short here.
    shared_env = {"TAILNET_SHARED_ADDRESS": fenced, "TAILNET_DRAIN_TIMEOUT": "20"}
    agents: list[IngressProcess] = []
    load: Load | None = None

    async def start(name: str) -> dict[str, object]:
        agent = await IngressProcess.start(tmp_path / name, headscale, key, name, listen, backend, shared_env)
        agents.append(agent)
        await eventually(lambda: _up(agent.process, agent.health), timeout=60, what=f"{name} ready")
        assert agent.process.returncode is None, agent.log.read_text()
        node = headscale.node_by_name(name)
        assert node is not None
        assert ROUTE in node.get("availableRoutes", []), f"{name} does not advertise {ROUTE}: {node}"
        headscale.approve_routes(str(node["id"]), [ROUTE])
        return node

    try:
        await start("ingress-shared-a")
        await eventually(lambda: asyncio.to_thread(primary_of, laptop), timeout=30,
                         what="the laptop routing the shared address to the first replica")
        assert await asyncio.to_thread(primary_of, laptop) == "ingress-shared-a"
        await eventually(lambda: answers(laptop, fenced, listen), timeout=30, what="the shared address answered")
        load = Load(laptop, fenced, listen)
        await eventually(lambda: load.streak() >= 10, timeout=30, what="the load answered at the shared address")

        await start("ingress-shared-b")
        await eventually(lambda: asyncio.to_thread(lambda: laptop.sees("ingress-shared-b")), timeout=30,
                         what="the laptop seeing the second replica")
        assert await asyncio.to_thread(primary_of, laptop) == "ingress-shared-a", "the primary moved on a join"

        agents[0].process.send_signal(signal.SIGTERM)
        await eventually(lambda: asyncio.to_thread(lambda: primary_of(laptop) == "ingress-shared-b"), timeout=30,
                         what="the laptop routing the shared address to the second replica")
        assert await asyncio.wait_for(agents[0].process.wait(), 60) == 0, agents[0].log.read_text()
        assert "served until the shared address moved" in agents[0].log.read_text()
        await eventually(lambda: load.streak() >= 50, timeout=30, what="50 answers in a row after the old replica left")
        outcomes = load.stop()
        refused = {at: why for at, why in outcomes.items() if why.startswith(REFUSED)}
        assert not refused, f"requests to the shared address refused during the hand-over: {refused}"
        cut = {at: why for at, why in outcomes.items() if why != UNANSWERED and at not in refused}
        print(f"\nof {load.sent()} requests to the shared address, none refused; "
              f"{sum(w == UNANSWERED for w in outcomes.values())} went unanswered and {len(cut)} were cut by the "
              f"move {sorted(cut.values())} (docs/decisions.md)")
    finally:
        await tear_down(load, server, agents)
