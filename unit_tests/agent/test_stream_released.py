"""A connection the data plane released before the Python side heard of it (a readable event
dispatched for a handle that is gone) ends that connection only, never the agent."""

from __future__ import annotations

import asyncio
from typing import Any

from tailnet_agent.streams import StreamTable, TailnetTransport


class GoneDataPlane:
    """Answers every read as the native side does for a handle it no longer holds."""

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def tcp_recv(self, handle: int, limit: int) -> bytes:
        raise ValueError(f"unknown TCP handle {handle} (closed or never opened)")

    def tcp_abort(self, handle: int) -> None:
        self.aborted.append(handle)


class Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost: list[Exception | None] = []

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)


async def test_a_read_of_a_released_handle_ends_the_connection_not_the_agent() -> None:
    dataplane: Any = GoneDataPlane()
    table = StreamTable(dataplane, wake=lambda: None, spawn=lambda coro, name: None,
                        loop=asyncio.get_running_loop())
    protocol = Recorder()
    transport = TailnetTransport(table, 5, protocol, extra={})
    table.transports[5] = transport

    transport.on_readable()  # raised ValueError out of the pump before, ending the agent's TaskGroup

    assert len(protocol.lost) == 1 and isinstance(protocol.lost[0], ConnectionResetError)
    assert "unknown TCP handle 5" in str(protocol.lost[0])
    assert 5 not in table.transports and dataplane.aborted == [], "the handle is gone: nothing to abort"
