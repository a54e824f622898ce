"""The node's DERP relays: one :class:`~tailnet_agent.derp.DerpSupervisor` per region in use.

A region is in use when it is the node's home region or the home region of a peer (a peer must
be sent to through *its* region). :meth:`Relays.run` keeps the set of supervisors in step with
the last :meth:`Relays.update` and reports the home region to control (so peers send to us
there) and to the relays (NotePreferred). Each connected relay's bytes are fed to the data
plane, which parses them with its frame codec; the pump writes what the data plane produced
through :attr:`Relays.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import structlog

from tailnet_agent import _native as nat
from tailnet_agent.contract.backoff import Backoff, derp_backoff
from tailnet_agent.control import NetMap
from tailnet_agent.derp import ConnectionHandler, DerpConnection, DerpError, DerpSupervisor

log = structlog.get_logger("agent.node")


@dataclass
class _Region:
    supervisor: DerpSupervisor
    task: asyncio.Task[None]


class Relays:
    """The DERP side of one node. ``run(group)`` blocks until cancelled; supervisors are tasks of ``group``.

    ``wake`` asks the node's pump for a poll; ``notify`` tells the node's waiters that readiness
    may have changed; ``report_home`` tells control the home region.
    """

    def __init__(self, dataplane: nat.DataPlane, *, tls: ssl.SSLContext, read_timeout: float, backoff: Backoff | None,
                 wake: Callable[[], None], notify: Callable[[], None],
                 report_home: Callable[[int], Awaitable[object]]) -> None:
        self._dataplane = dataplane
        self._tls = tls
        self._read_timeout = read_timeout
        self._backoff = backoff
        self._wake = wake
        self._notify = notify
        self._report_home = report_home
        self.connections: dict[int, DerpConnection] = {}
        """The connected relay of each region."""
        self._regions: dict[int, _Region] = {}
        self._reported_home = 0
        """The home region last reported; 0 when it must be reported (again)."""
        self._netmap: NetMap | None = None
        self._home = 0
        self._node_key = b""
        self._changed = asyncio.Event()

    def update(self, netmap: NetMap, *, home: int, node_key: bytes) -> None:
        """The regions to use follow this netmap and home region (``run`` acts on it)."""
        self._netmap, self._home, self._node_key = netmap, home, node_key
        self._changed.set()

    def rekey(self) -> None:
        """The node key changed: every relay is re-made (a relay knows a client by its key)."""
        for region in self._regions.values():
            region.task.cancel()
        self._regions.clear()
        self._reported_home = 0

    async def run(self, group: asyncio.TaskGroup) -> None:
        """Keep one supervisor per region in use and report the home region."""
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                if self._netmap is not None:
                    await self._follow(group, self._netmap, self._home)
        finally:
            for region in self._regions.values():
                region.task.cancel()
            self._regions.clear()

    async def _follow(self, group: asyncio.TaskGroup, netmap: NetMap, home: int) -> None:
        if not home:
            log.warning("the DERP map has no usable home region; the node cannot relay")
            return
        wanted = {home} | {p.home_derp for p in netmap.peers.values() if p.home_derp in netmap.derp_map.regions}
        for region_id in sorted(wanted):
            nodes = netmap.derp_map.regions[region_id].nodes
            if region_id in self._regions:
                self._regions[region_id].supervisor.set_nodes(nodes)
                continue
            supervisor = DerpSupervisor(
                nodes, self._node_key, self._handler(region_id), preferred=region_id == home,
                tls=self._tls, read_timeout=self._read_timeout,
                backoff=replace(self._backoff) if self._backoff else derp_backoff())
            task = group.create_task(supervisor.run(), name=f"derp-{region_id}")
            self._regions[region_id] = _Region(supervisor, task)
            log.info("DERP region in use", region=region_id, home=region_id == home)
        for region_id in set(self._regions) - wanted:
            self._regions.pop(region_id).task.cancel()
            log.info("DERP region no longer in use", region=region_id)
        if home != self._reported_home:
            for region_id, region in self._regions.items():
                with contextlib.suppress(DerpError, OSError):
                    await region.supervisor.set_preferred(region_id == home)
            await self._report_home(home)
            self._reported_home = home

    def _handler(self, region: int) -> ConnectionHandler:
        async def handle(conn: DerpConnection) -> None:
            self._dataplane.derp_reset(region)
            self.connections[region] = conn
            self._notify()
            self._wake()
            try:
                while True:
                    chunk = await conn.read_chunk()
                    self._dataplane.derp_feed(region, chunk)
                    self._wake()
                    # Let the pump poll before reading on, so input does not pile up unprocessed.
                    await asyncio.sleep(0)
            finally:
                if self.connections.get(region) is conn:
                    del self.connections[region]
                self._notify()

        return handle
