"""Splice: bytes that arrive before the join are kept and forwarded, in order, by it; a full side
pauses the reading of the other."""

from __future__ import annotations

import asyncio
from typing import Any

from tailnet_agent.forward.splice import Splice


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.eof_written = False
        self.reading = True
        self.closed = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def write_eof(self) -> None:
        self.eof_written = True

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


async def test_bytes_read_before_the_join_reach_the_other_end_and_reading_pauses() -> None:
    # As CPython 3.11.2 does: the reader runs although connection_made paused it.
    splice = Splice()
    client, upstream = FakeTransport(), FakeTransport()
    splice.a.connection_made(client)
    splice.a.data_received(b"GET / HTTP/1.0\r\n")
    splice.a.data_received(b"\r\n")
    splice.a.eof_received()
    assert not client.reading
    splice.b.connection_made(upstream)
    assert upstream.written == []

    splice.join()
    assert upstream.written == [b"GET / HTTP/1.0\r\n", b"\r\n"]
    assert upstream.eof_written
    splice.b.data_received(b"HTTP/1.0 200 OK\r\n")
    assert client.written == [b"HTTP/1.0 200 OK\r\n"]


async def test_the_eof_gate_runs_before_the_clients_eof_goes_upstream() -> None:
    splice = Splice()
    client, upstream = FakeTransport(), FakeTransport()
    opened = asyncio.Event()
    release = asyncio.Event()

    async def gate() -> None:
        opened.set()
        await release.wait()

    splice.eof_gate = gate
    splice.a.connection_made(client)
    splice.b.connection_made(upstream)
    splice.join()
    splice.a.eof_received()
    await asyncio.wait_for(opened.wait(), 5)
    assert not upstream.eof_written, "held while the gate runs"
    release.set()
    for _ in range(100):
        if upstream.eof_written:
            break
        await asyncio.sleep(0.01)
    assert upstream.eof_written


async def test_no_eof_gate_once_upstream_has_ended() -> None:
    splice = Splice()
    client, upstream = FakeTransport(), FakeTransport()

    async def gate() -> None:
        raise AssertionError("not called")

    splice.eof_gate = gate
    splice.a.connection_made(client)
    splice.b.connection_made(upstream)
    splice.join()
    splice.b.eof_received()
    splice.a.eof_received()
    assert upstream.eof_written and client.eof_written


async def test_a_side_over_its_high_water_mark_stops_the_other_sides_reading_until_it_drains() -> None:
    """What bounds a spliced connection's memory: a transport that cannot take more (its protocol
    is told ``pause_writing``) stops the reading of the other, so nothing queues between them."""
    splice = Splice()
    client, upstream = FakeTransport(), FakeTransport()
    splice.a.connection_made(client)
    splice.b.connection_made(upstream)
    splice.join()
    assert client.reading and upstream.reading
    splice.b.pause_writing()  # the tailnet side is full: stop reading the client
    assert (client.reading, upstream.reading) == (False, True)
    splice.b.resume_writing()
    assert client.reading
    splice.a.pause_writing()  # the client reads nothing: stop reading the tailnet side
    assert (client.reading, upstream.reading) == (True, False)
    splice.a.resume_writing()
    assert upstream.reading
