"""The control client: register with a pre-auth key, then follow the streaming map poll.

``ControlClient.run`` blocks until cancelled. It (re)connects with exponential backoff, registers
once per node key, and keeps ``netmap`` current from ``/machine/map``. Register and map bodies
follow ``tailcfg.RegisterRequest``/``tailcfg.MapRequest`` and ``controlclient/direct.go``:

* register: ``Version``, ``NodeKey``, ``Auth.AuthKey``, ``Expiry`` (zero time), ``Hostinfo``,
  ``Ephemeral``. ``OldNodeKey`` and ``NLKey`` are omitted (an empty string does not parse as a key).
  Tags come from the pre-auth key; Headscale rejects ``Hostinfo.RequestTags`` with a pre-auth key.
* map: ``Stream`` and ``KeepAlive`` true, ``OmitPeers`` false, ``Compress`` ``""`` (plain JSON),
  plus ``DiscoKey`` and ``Hostinfo``; the body is a sequence of length-prefixed messages.

Re-registration: a 401/403/404 on the map poll (Headscale answers 404 "node not found" for an
unknown node key) re-runs register with the same node key; ``NodeKeyExpired`` in a register
response, or the self node reported ``Expired``, rotates the node key and sends ``OldNodeKey``.
If the server still reports the node expired after that (Headscale keeps an admin's expiry on a
tagged node, whatever key it re-registers with), the client joins as a new node: fresh machine,
node and disco keys, a new connection, and (from the server) new addresses. A restarted agent
would do the same with its pre-auth key; revoking the key is how an admin keeps it out.
A register ``Error`` or an interactive ``AuthURL`` is terminal (:class:`RegistrationError`).

Logout (:meth:`ControlClient.logout`, on shutdown): a register request with an ``Expiry`` in the
past and no ``Auth``, as tailscaled's; Headscale deletes an ephemeral node at once.

Before the first connection the server's version is checked against the capability versions it
accepts (``compat``): a server too old for this agent, or one that requires a newer client, is
:class:`~tailnet_agent.control.compat.UnsupportedServer` (terminal, with what to upgrade), and so
is Headscale's "unsupported client version" answer to register or map.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from tailnet_agent import __version__
from tailnet_agent.contract.backoff import Backoff

from . import compat
from . import netmap as nm
from .controlconn import ControlConnection, ControlEndpoint, Response, fetch_server_version, ssl_context
from .errors import ConnectionLost, ControlError, HTTPStatusError, KeyRefused, ProtocolViolation, RegistrationError
from .keys import NodeKeys, PublicKey
from .mapstream import MapFrameDecoder

log = structlog.get_logger("agent.control.client")

CAPABILITY_VERSION = 138
"""``tailcfg.CurrentCapabilityVersion`` of tailscale v1.98; Headscale 0.26 to 0.30 accept it
(their minimums, 88 to 113, are in ``compat``)."""
ZERO_TIME = "0001-01-01T00:00:00Z"
LOGOUT_EXPIRY = "1970-01-01T00:02:03Z"
"""A register ``Expiry`` in the past means logout (tailscaled sends ``time.Unix(123, 0)``)."""
KEY_POLL = 5.0
"""Seconds between reads of the key file while a refused key waits for its successor."""
LOGOUT_TIMEOUT = 5.0
"""Seconds :meth:`ControlClient.logout` may take (a new connection included)."""
ENDPOINT_LOCAL = 1
"""``tailcfg.EndpointLocal``: an address of a local interface."""
ENDPOINT_STUN = 2
"""``tailcfg.EndpointSTUN``: the address a DERP node's STUN server saw."""
_REAUTH_STATUSES = frozenset({401, 403, 404})


# -- the transport seam ---------------------------------------------------------------------------

class StreamingBody(Protocol):
    status: int

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...


class ControlTransport(Protocol):
    """What the client needs from a connection; :class:`ControlConnection` is the real one."""

    async def request(self, method: str, path: str, json_body: Any = None) -> Response: ...

    def stream(self, method: str, path: str, json_body: Any = None) -> AbstractAsyncContextManager[StreamingBody]:
        ...

    async def run(self) -> None:
        """The connection's reader pump; returns when the connection ends (see ControlConnection.run)."""
        ...

    async def aclose(self) -> None: ...


Connector = Callable[[NodeKeys], Awaitable[ControlTransport]]
"""Opens a connection authenticated with the node's machine key."""


# -- options and backoff --------------------------------------------------------------------------


@dataclass(kw_only=True)
class ControlOptions:
    url: str
    """Control server URL, e.g. ``https://headscale.example.com``."""
    auth_key: str = field(repr=False)
    """Pre-auth key; never logged."""
    hostname: str
    ca_bundle: Path | None = None
    """PEM CA bundle to verify the server's TLS certificate; None uses the system store."""
    ephemeral: bool = True
    """Sent as ``RegisterRequest.Ephemeral`` (Headscale takes ephemerality from the key itself)."""
    request_tags: tuple[str, ...] = ()
    """``Hostinfo.RequestTags``; keep empty with Headscale pre-auth keys, which it rejects."""
    capability_version: int = CAPABILITY_VERSION
    map_watchdog: float = 120.0
    """Seconds without any map message (keep-alives included) before the poll is abandoned;
    Headscale sends a keep-alive every 50-59 s. Default 120 s, as tailscaled."""
    backoff: Backoff = field(default_factory=Backoff)
    auth_key_file: Path | None = None
    """Where ``auth_key`` was read from. When the server refuses the key, the file is read again
    every :data:`KEY_POLL` seconds for up to ``key_wait`` seconds, and registration is retried
    with a new key found there (kubelet refreshes a mounted Secret within about a minute of its
    change, so a container restarted before that recovers). None: a refused key is final."""
    key_wait: float = 180.0
    """Seconds to wait for a new key in ``auth_key_file`` after a refusal. Default 180."""
    routes: tuple[str, ...] = ()
    """Prefixes advertised as subnet routes (``Hostinfo.RoutableIPs``), e.g. an ingress's shared
    ``198.18.5.10/32``; :meth:`ControlClient.set_routes` changes them while the node runs."""


class _Reauthenticate(ControlError):
    """Internal: the server no longer knows our node key; register again."""

    def __init__(self, reason: str, *, rotate_key: bool = False, new_machine: bool = False) -> None:
        super().__init__(reason)
        self.rotate_key = rotate_key
        self.new_machine = new_machine


# -- the client -----------------------------------------------------------------------------------

class ControlClient:
    """Registers one node and keeps its netmap. ``run`` blocks until cancelled."""

    def __init__(self, options: ControlOptions, keys: NodeKeys | None = None, *,
                 on_netmap: Callable[[nm.NetMap], None] | None = None,
                 _connect: Connector | None = None,
                 _server_version: Callable[[], Awaitable[str | None]] | None = None,
                 _sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.options = options
        self.keys = keys or NodeKeys.generate()
        self.netmap: nm.NetMap | None = None
        self.registered = False
        self.map_sessions = 0
        """Map polls that were answered 200; grows by one per (re)connection."""
        self.map_messages = 0
        self._old_node_key: PublicKey | None = None
        self._on_netmap = on_netmap
        self._connect = _connect or self._open_connection
        # An injected connector (tests) has no server to ask unless a version source is given too.
        self._server_version = _server_version or (None if _connect else self._fetch_server_version)
        self.server_version: str | None = None
        """What the server's ``/version`` said ("" for none, None until asked or when unreachable)."""
        self._sleep = _sleep
        self.preferred_derp = 0
        """Home DERP region reported in Hostinfo.NetInfo; 0 until the data plane picks one."""
        self.routes: tuple[str, ...] = options.routes
        """Prefixes advertised in ``Hostinfo.RoutableIPs``."""
        self.endpoints: list[tuple[str, int]] = []
        """UDP endpoints reported in map requests: (``ip:port``, ``tailcfg.EndpointType``: local 1,
        STUN 2); empty: DERP only."""
        self._conn: ControlTransport | None = None
        self.logged_out = False
        self.auth_key = options.auth_key
        """The pre-auth key in use (a new one when the key file changed after a refusal)."""
        self.key_refused: str | None = None
        """Why the server refused the key in use (None: not refused); cleared by a new key."""
        """:meth:`logout` ran: ``run`` connects and registers no more."""

    async def run(self) -> None:
        """Connect, register, poll; reconnect with backoff on any retryable failure.

        Returns only by cancellation; raises :class:`RegistrationError` when the key is refused.
        """
        backoff = self.options.backoff
        while True:
            if self.logged_out:
                await asyncio.get_running_loop().create_future()  # until cancelled
            if self.server_version is None and self._server_version is not None:
                self.server_version = await self._server_version()
                if self.server_version is not None:
                    note = compat.check_server(self.server_version, self.options.capability_version)
                    if note:
                        log.warning("untested control server", note=note)
            try:
                conn = await self._connect(self.keys)
            except (ControlError, OSError, TimeoutError) as exc:
                delay = backoff.next()
                log.warning("control connect failed", error=str(exc) or repr(exc), retry_in=round(delay, 2))
                await self._sleep(delay)
                continue
            self._conn = conn
            try:
                await self._serve(conn, on_first_message=backoff.reset)
            except KeyRefused as exc:
                self.key_refused = str(exc)
                if not await self._new_key():
                    raise
                self.key_refused = None
            except RegistrationError:
                raise
            except _Reauthenticate as exc:
                self.registered = False
                if exc.new_machine:
                    log.warning("joining as a new node", reason=str(exc))
                    self.keys = NodeKeys.generate()
                    self._old_node_key = None
                else:
                    log.info("re-registering", reason=str(exc), rotate_key=exc.rotate_key)
                    if exc.rotate_key:
                        self._rotate_node_key()
                await self._sleep(backoff.next())
            except (ControlError, OSError, TimeoutError) as exc:
                delay = backoff.next()
                log.warning("control connection lost", error=str(exc) or repr(exc), retry_in=round(delay, 2))
                await self._sleep(delay)
            finally:
                self._conn = None

    async def _serve(self, conn: ControlTransport, *, on_first_message: Callable[[], None]) -> None:
        """Register (if needed) and poll on ``conn``, its reader pump a task of this TaskGroup;
        the connection is closed on the way out and the failure re-raised as it was."""
        failure: Exception | None = None
        async with asyncio.TaskGroup() as group:
            group.create_task(conn.run(), name="control-conn-reader")
            try:
                if not self.registered:
                    await self.register(conn)
                await self._poll(conn, on_first_message=on_first_message)
            except Exception as exc:  # out of the group unwrapped, for run()'s except clauses
                failure = exc
            finally:
                await conn.aclose()
        if failure is not None:
            raise failure

    @property
    def connected(self) -> bool:
        """Whether a control connection is open right now (registered or registering)."""
        return self._conn is not None

    # -- register -------------------------------------------------------------------------------

    def hostinfo(self) -> dict[str, Any]:
        info: dict[str, Any] = {"Hostname": self.options.hostname, "OS": "linux",
                                "IPNVersion": f"tailnet-agent-{__version__}"}
        if self.options.request_tags:
            info["RequestTags"] = list(self.options.request_tags)
        if self.preferred_derp:
            info["NetInfo"] = {"PreferredDERP": self.preferred_derp}
        if self.routes:
            info["RoutableIPs"] = list(self.routes)
        return info

    async def set_routes(self, routes: tuple[str, ...]) -> bool:
        """Advertise ``routes`` instead (``()`` withdraws every route), sent like
        :meth:`set_preferred_derp`: control elects another primary for a route withdrawn here."""
        self.routes = routes
        return await self._lite_update("routes", routes=list(routes))

    async def set_preferred_derp(self, region: int) -> bool:
        """Report ``region`` as this node's home DERP, so peers send to it there.

        Sent at once as a "lite" map request (``Stream: false, OmitPeers: true``) when connected,
        and with every later map poll. Returns whether the server took it now.
        """
        self.preferred_derp = region
        return await self._lite_update("home DERP", region=region)

    async def report_endpoints(self) -> bool:
        """Report :attr:`endpoints` now, so peers ping them for a direct path. Sent like
        :meth:`set_preferred_derp`; map polls carry them anyway."""
        return await self._lite_update("endpoints", endpoints=[text for text, _ in self.endpoints])

    async def _lite_update(self, what: str, **context: object) -> bool:
        conn = self._conn
        if conn is None:
            return False
        body = {**self.map_request(), "Stream": False, "OmitPeers": True, "KeepAlive": False}
        try:
            resp = await conn.request("POST", "/machine/map", body)
        except (ControlError, OSError, TimeoutError) as exc:
            log.warning(f"{what} update failed; it goes with the next map poll", error=str(exc) or repr(exc))
            return False
        log.info(f"reported {what}", status=resp.status, **context)
        return resp.status == 200

    def register_request(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "Version": self.options.capability_version,
            "NodeKey": str(self.keys.node.public),
            "Auth": {"AuthKey": self.auth_key},
            "Expiry": ZERO_TIME,
            "Hostinfo": self.hostinfo(),
            "Ephemeral": self.options.ephemeral,
        }
        if self._old_node_key is not None:
            body["OldNodeKey"] = str(self._old_node_key)
        return body

    async def _new_key(self) -> bool:
        """After a refusal: read the key file until it holds another key (True, now in use) or
        ``key_wait`` passed (False)."""
        path = self.options.auth_key_file
        if path is None:
            return False
        log.warning("pre-auth key refused; waiting for a new one in its file", file=str(path),
                    wait=self.options.key_wait)
        for _ in range(max(1, math.ceil(self.options.key_wait / KEY_POLL))):
            try:
                key = path.read_text().strip()
            except OSError as exc:
                log.warning("cannot read the pre-auth key file", file=str(path), error=exc.strerror or str(exc))
                key = ""
            if key and key != self.auth_key:
                self.auth_key = key
                log.info("registering with the new pre-auth key from its file", file=str(path))
                return True
            await self._sleep(KEY_POLL)
        return False

    async def logout(self, *, timeout: float = LOGOUT_TIMEOUT) -> bool:
        """Log the node out: a register request with an ``Expiry`` in the past and no ``Auth``
        (tailscaled's logout). Headscale deletes an ephemeral node at once instead of ageing it
        out, so its name and addresses are free for a successor. Sent on the connection in use,
        else on a new one; the client does not register again afterwards. Returns whether the
        server took it (within ``timeout`` seconds)."""
        self.logged_out = True
        body = {"Version": self.options.capability_version, "NodeKey": str(self.keys.node.public),
                "Expiry": LOGOUT_EXPIRY, "Hostinfo": self.hostinfo(), "Ephemeral": self.options.ephemeral}
        try:
            async with asyncio.timeout(timeout), contextlib.AsyncExitStack() as stack:
                conn = self._conn
                if conn is None:
                    conn = await self._connect(self.keys)
                    stack.push_async_callback(conn.aclose)
                    reader = asyncio.create_task(conn.run(), name="control-logout-reader")
                    stack.callback(reader.cancel)
                resp = await conn.request("POST", "/machine/register", body)
        except (ControlError, OSError, TimeoutError) as exc:
            log.warning("logout failed; the node ages out instead", error=str(exc) or repr(exc))
            return False
        log.info("logged out", node_key=self.keys.node.public.short(), status=resp.status)
        return resp.status == 200

    async def register(self, conn: ControlTransport) -> dict[str, Any]:
        """POST ``/machine/register``; rotates the node key once if the server says it expired, and
        asks for a new machine identity if it still does."""
        for _ in range(2):
            resp = await conn.request("POST", "/machine/register", self.register_request())
            if resp.status in (401, 403):
                raise KeyRefused(f"register refused with HTTP {resp.status}: "
                                 f"{resp.body[:200].decode(errors='replace').strip()}")
            if refused := compat.refusal(resp.status, resp.body, self.options.capability_version,
                                         path="/machine/register"):
                raise refused
            if resp.status != 200:
                raise HTTPStatusError(resp.status, resp.body, path="/machine/register")
            doc: dict[str, Any] = resp.json()
            if doc.get("Error"):
                raise KeyRefused(f"register refused: {doc['Error']}")
            if doc.get("NodeKeyExpired"):
                log.info("node key expired; rotating", node_key=self.keys.node.public.short())
                self._rotate_node_key()
                continue
            if doc.get("AuthURL") or not doc.get("MachineAuthorized"):
                raise RegistrationError("server wants interactive login or machine approval; "
                                        "use a pre-auth key that needs neither")
            self.registered = True
            self._old_node_key = None
            log.info("registered", node_key=self.keys.node.public.short(), user=(doc.get("User") or {}).get(
                "LoginName", ""), ephemeral=self.options.ephemeral)
            return doc
        raise _Reauthenticate("the server still reports the node expired after a node key rotation",
                              new_machine=True)

    def _rotate_node_key(self) -> None:
        self._old_node_key = self.keys.node.public
        self.keys = self.keys.with_new_node_key()
        self.registered = False

    # -- map poll -------------------------------------------------------------------------------

    def map_request(self) -> dict[str, Any]:
        return {
            "Version": self.options.capability_version,
            "NodeKey": str(self.keys.node.public),
            "DiscoKey": str(self.keys.disco.public),
            "Stream": True,
            "KeepAlive": True,
            "OmitPeers": False,
            "Compress": "",
            "Hostinfo": self.hostinfo(),
            **({"Endpoints": [text for text, _ in self.endpoints],
                "EndpointTypes": [kind for _, kind in self.endpoints]} if self.endpoints else {}),
        }

    async def _poll(self, conn: ControlTransport, *, on_first_message: Callable[[], None]) -> None:
        async with conn.stream("POST", "/machine/map", self.map_request()) as resp:
            if resp.status in _REAUTH_STATUSES:
                body = await resp.read()
                raise _Reauthenticate(f"map poll answered {resp.status}: {body[:120]!r}")
            if resp.status != 200:
                body = await resp.read()
                if refused := compat.refusal(resp.status, body, self.options.capability_version,
                                             path="/machine/map"):
                    raise refused
                raise HTTPStatusError(resp.status, body, path="/machine/map")
            self.map_sessions += 1
            log.info("map poll started", session=self.map_sessions)
            decoder = MapFrameDecoder()
            chunks = resp.chunks()
            first = True
            while True:
                try:
                    async with asyncio.timeout(self.options.map_watchdog):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    raise ConnectionLost("map poll ended by the server") from None
                except TimeoutError:
                    raise ConnectionLost(f"no map message for {self.options.map_watchdog:g}s") from None
                for message in decoder.feed(chunk):
                    if first:
                        on_first_message()
                        first = False
                    self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        self.map_messages += 1
        if nm.is_keepalive(message):
            return
        updated = decode_map_message(self.netmap, message)
        if updated is None or updated is self.netmap:
            return
        self.netmap = updated
        log.debug("netmap updated", peers=len(updated.peers), regions=len(updated.derp_map.regions))
        if self._on_netmap is not None:
            self._on_netmap(updated)
        if updated.self_node.expired:
            raise _Reauthenticate("self node key expired", rotate_key=True)

    # -- default connector ----------------------------------------------------------------------

    async def _fetch_server_version(self) -> str | None:
        endpoint = ControlEndpoint.from_url(self.options.url)
        ctx = ssl_context(self.options.ca_bundle) if endpoint.scheme == "https" else None
        return await fetch_server_version(endpoint, ssl_ctx=ctx)

    async def _open_connection(self, keys: NodeKeys) -> ControlTransport:
        return await ControlConnection.open(self.options.url, keys.machine,
                                            capability_version=self.options.capability_version,
                                            ca_bundle=self.options.ca_bundle)


def decode_map_message(current: nm.NetMap | None, message: dict[str, Any]) -> nm.NetMap | None:
    """The netmap after one MapResponse; a message the netmap cannot be built from is a
    :class:`ConnectionLost` (no self node yet) or a :class:`ProtocolViolation` (a field of the
    wrong shape), so the client reconnects with backoff instead of failing."""
    try:
        return nm.apply(current, message)
    except nm.IncompleteMap as exc:
        raise ConnectionLost(str(exc)) from exc
    except nm.MalformedMap as exc:
        raise ProtocolViolation(f"malformed MapResponse: {exc}") from exc
