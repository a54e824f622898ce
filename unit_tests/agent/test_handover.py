"""An ingress told to stop keeps accepting while its node holds the name (tailnet_agent/handover.py)."""

from __future__ import annotations

import asyncio

import pytest

from tailnet_agent.contract.clock import FakeClock
from tailnet_agent.control import ControlOptions
from tailnet_agent.control.netmap import NetMap, Node
from tailnet_agent.handover import MIN_HOLD, QUIET, holds_name, serve_until_handed_over, still_sought
from tailnet_agent.node import Node as AgentNode
from tailnet_agent.node import NodeOptions


def netmap(name: str) -> NetMap:
    return NetMap(self_node=Node(id=1, name=name))


def test_the_node_holds_the_name_its_magicdns_name_begins_with() -> None:
    assert holds_name(netmap("shop.tailnet.example."), "shop")
    assert holds_name(netmap("Shop.tailnet.example."), "shop")
    assert not holds_name(netmap("shop-old7.tailnet.example."), "shop"), "renamed: its successor has it"
    assert not holds_name(netmap("shop-x1y2.tailnet.example."), "shop"), "never had it"
    assert not holds_name(None, "shop")


async def test_the_wait_ends_when_control_renames_the_node() -> None:
    clock, names = FakeClock(), ["shop.tailnet.example."]
    waiting = asyncio.create_task(serve_until_handed_over(lambda: holds_name(netmap(names[0]), "shop"), clock, 20))
    for _ in range(6):
        await _parked(clock, waiting)
        clock.advance(0.5)
    await _parked(clock, waiting)
    assert not waiting.done(), "still named after 3 s: still accepting"
    names[0] = "shop-old7.tailnet.example."
    clock.advance(0.5)
    assert await waiting == 3.5


async def test_the_wait_ends_at_its_budget_when_the_name_never_moves() -> None:
    clock = FakeClock()
    waiting = asyncio.create_task(serve_until_handed_over(lambda: True, clock, 2.2))
    while not waiting.done():
        await _parked(clock, waiting)
        clock.advance(0.1)
    assert waiting.result() == pytest.approx(2.2)


async def test_a_node_without_the_name_does_not_wait() -> None:
    assert await serve_until_handed_over(lambda: False, FakeClock(), 20) == 0


async def _parked(clock: FakeClock, task: asyncio.Task[float]) -> None:
    for _ in range(100):
        if clock.sleepers or task.done():
            return
        await asyncio.sleep(0)
    raise AssertionError("nothing went to sleep on the clock")


def shared_node() -> AgentNode:
    return AgentNode(NodeOptions(control=ControlOptions(url="https://control.invalid", auth_key="k", hostname="web"),
                                 udp_port=None, shared_addresses=("198.18.5.10",)))


def test_a_replica_advertises_its_shared_address_from_its_first_registration() -> None:
    node = shared_node()
    assert node.shared_routes == ("198.18.5.10/32",)
    assert node.control.routes == ("198.18.5.10/32",)
    assert node.shared_quiet_for() == float("inf"), "not running: nothing accepted"


def test_a_replica_holds_the_shared_address_for_the_minimum_then_until_it_is_quiet() -> None:
    """The primary keeps getting new connections until its peers have the move; one that was not
    the primary gets none. Neither is told by control which it was."""
    assert still_sought(100.0, 101.0, quiet_for=60.0), "within the minimum, however quiet"
    assert not still_sought(100.0, 100.0 + MIN_HOLD, quiet_for=60.0), "not the primary: done"
    assert still_sought(100.0, 110.0, quiet_for=QUIET / 2), "peers still arriving"
    assert not still_sought(100.0, 110.0, quiet_for=QUIET), "quiet: they moved"
