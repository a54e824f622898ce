"""The pump: the one loop that moves the data plane's output to where it goes.

Each poll of the Rust data plane returns DERP frames to write, disco and STUN datagrams,
stream events and the next deadline; the pump hands each to its owner (the DERP relays, the
direct path, the stream table) and schedules the next poll. Anything that gives the data plane
work calls :meth:`Pump.wake`; wakes are coalesced into one poll.

DERP writes never make one relay wait for another: after a poll the pump waits for the relays it
wrote to together, and at most :data:`DRAIN_WAIT`; a relay that holds more than
:data:`DERP_QUEUE_LIMIT` unsent bytes (its server stopped reading) gets no more frames until it
drains, they are dropped as a full UDP queue would drop them (``derp_writes_dropped``), so the
other relays and the direct path keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from tailnet_agent import _native as nat
from tailnet_agent.derp import DerpConnection, DerpError
from tailnet_agent.direct import DirectPath
from tailnet_agent.relays import Relays
from tailnet_agent.streams import StreamTable

log = structlog.get_logger("tailnet-agent")

DERP_QUEUE_LIMIT = 1 << 20
"""Unsent bytes a DERP connection may hold; frames for one that holds more are dropped."""
DRAIN_WAIT = 0.05
"""Seconds the pump waits, after a poll, for the relays it wrote to to drain (backpressure for a
busy relay, bounded so that a stalled one delays the next poll by this much at most)."""


class Pump:
    """Polls ``dataplane`` when woken or when its next deadline comes, and routes the results."""

    def __init__(self, dataplane: nat.DataPlane, relays: Relays, direct: DirectPath,
                 streams: Callable[[], StreamTable | None]) -> None:
        self.dataplane = dataplane
        self.relays = relays
        self.direct = direct
        self._streams = streams
        self.counters: dict[str, int] = {}
        """The data plane's cumulative counters as of the last poll."""
        self.derp_writes_dropped = 0
        """Batches of DERP frames dropped because their region had no connection."""
        self._wakeup = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def wake(self) -> None:
        """Ask for a poll (coalesced)."""
        self._wakeup.set()

    async def run(self) -> None:
        """Poll until cancelled; the timer for the next deadline goes with it."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                if written := self.poll_once(loop):
                    await drain(written)
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def poll_once(self, loop: asyncio.AbstractEventLoop) -> list[DerpConnection]:
        """One poll; returns the DERP connections written to, for the caller to drain."""
        result = self.dataplane.poll(loop.time())
        self.counters = result.counters
        written = self._write_derp(result.derp_writes)
        if written:
            self.direct.note_derp_traffic()
        for event in result.events:
            self._dispatch(event, loop)
        if result.udp_pending:
            self.direct.flush()
        self._schedule(loop, result.next_deadline)
        return written

    def _write_derp(self, writes: list[tuple[int, bytes]]) -> list[DerpConnection]:
        written: list[DerpConnection] = []
        connections = self.relays.connections
        for region, buf in writes:
            conn = connections.get(region)
            if conn is None or conn.buffered() > DERP_QUEUE_LIMIT:
                self.derp_writes_dropped += 1
                continue
            try:
                conn.write(buf)
            except DerpError:
                self.derp_writes_dropped += 1
                continue
            if conn not in written:
                written.append(conn)
        return written

    def _dispatch(self, event: nat.Event, loop: asyncio.AbstractEventLoop) -> None:
        streams = self._streams()
        match event:
            case nat.DerpHealth(region, message) if message:
                log.warning("DERP server reports a problem", region=region, problem=message)
            case nat.DerpRestarting(region, reconnect_in_ms, _try_for):
                log.info("DERP server restarting", region=region, reconnect_in_ms=reconnect_in_ms)
            case nat.DiscoUdp(ip, port, payload):
                self.direct.apply(self.direct.disco.handle_udp((ip, port), payload, loop.time()))
            case nat.DiscoDerp(region, key, payload):
                self.direct.apply(self.direct.disco.handle_derp(region, key, payload, loop.time()))
            case nat.StunUdp(_ip, _port, payload):
                self.direct.on_stun(payload)
            case nat.DerpPeerGone() | nat.DerpPeerPresent() | nat.DerpFrame() | nat.DerpHealth():
                pass
            case _ if streams is not None:
                streams.dispatch(event)

    def _schedule(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        if self._timer is not None:
            if deadline is not None and self._timer.when() == deadline:
                return
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            self._timer = loop.call_at(deadline, self.wake)


async def drain(connections: list[DerpConnection]) -> None:
    """Wait until each of ``connections`` drained, together and at most :data:`DRAIN_WAIT`.

    A failed relay is noticed on its read side (its supervisor reconnects), so errors are ignored."""
    if len(connections) == 1:
        with contextlib.suppress(DerpError, TimeoutError):
            async with asyncio.timeout(DRAIN_WAIT):
                await connections[0].drain()
        return
    tasks = [asyncio.ensure_future(conn.drain()) for conn in connections]
    done, pending = await asyncio.wait(tasks, timeout=DRAIN_WAIT)
    for task in pending:
        task.cancel()
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: a failed relay's error is its supervisor's to see
