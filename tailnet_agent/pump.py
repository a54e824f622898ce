"""The pump: the one loop that moves the data plane's output to where it goes.

Each poll of the Rust data plane returns DERP frames to write, disco and STUN datagrams,
stream events and the next deadline; the pump hands each to its owner (the DERP relays, the
direct path, the stream table) and schedules the next poll. Anything that gives the data plane
work calls :meth:`Pump.wake`; wakes are coalesced into one poll.
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
                for conn in self.poll_once(loop):
                    # A failed relay is noticed on its read side; its supervisor reconnects.
                    with contextlib.suppress(DerpError):
                        await conn.drain()
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
            if conn is None:
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
