"""One asyncio DERP connection to one region node: TLS, HTTP upgrade, handshake, then a byte pump.

After :meth:`DerpConnection.open` the connection is a byte pump for the data plane's frame
codec: :meth:`read_chunk` returns stream bytes as they arrive and :meth:`write` queues whole
frames; ``await drain()`` applies backpressure. :meth:`note_preferred` and :meth:`send_ping`
send the two control frames the agent builds in Python. (Tests that need to parse frames in
Python use ``hack/derp_codec.py`` over the same methods.)
Connecting follows ``derphttp_client.go``: dial ``IPv4`` (else ``IPv6``, else ``HostName`` via
DNS) on ``DERPPort`` (0 means 443), TLS with SNI ``HostName``, ``GET /derp`` with ``Upgrade: DERP``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

import structlog

from . import frames as f
from .errors import (
    ConnectionLost,
    DerpConnectError,
    DerpTLSError,
    HandshakeRejected,
)
from .handshake import ClientHandshake, HandshakeState

log = structlog.get_logger("agent.derp")

DEFAULT_PORT = 443
READ_SIZE = 64 << 10
"""Bytes asked for per socket read: 64 KiB."""
TLS_READ_SIZE = 120 << 10
"""The most asyncio's TLS layer decrypts per read (see :func:`cap_tls_reads`): below the agent's
128 KiB mmap threshold. The read size shapes the bursts a DERP relay queues and drops; with 64 KiB
a download from a tailscale 1.80 peer once stalled, because the stack kept data past only 4 holes
(native/src/stack.rs ``RECEIVE_HOLES`` is 32 since)."""


class DerpNodeLike(Protocol):
    """The fields of a ``tailcfg.DERPNode`` needed to dial it (``control.netmap.DERPNode`` fits)."""

    @property
    def host_name(self) -> str: ...

    @property
    def ipv4(self) -> str: ...

    @property
    def ipv6(self) -> str: ...

    @property
    def derp_port(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class DerpNode:
    """A DERP node from the DERPMap (``tailcfg.DERPNode``)."""

    host_name: str
    """TLS SNI and Host header; also dialled through DNS when no usable IP is given."""
    ipv4: str = ""
    """IPv4 to dial instead of resolving ``host_name``. "" resolves; a non-IPv4 value ("none") skips IPv4."""
    ipv6: str = ""
    """Same as ``ipv4`` for IPv6."""
    derp_port: int = 0
    """TCP port; 0 means 443."""
    name: str = ""
    region_id: int = 0
    stun_only: bool = False
    """A STUN-only node is never dialled for DERP."""

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DerpNode:
        """From DERPMap JSON: ``Name``, ``RegionID``, ``HostName``, ``IPv4``, ``IPv6``, ``DERPPort``, ``STUNOnly``."""
        return cls(host_name=str(doc.get("HostName") or ""), ipv4=str(doc.get("IPv4") or ""),
                   ipv6=str(doc.get("IPv6") or ""), derp_port=int(doc.get("DERPPort") or 0),
                   name=str(doc.get("Name") or ""), region_id=int(doc.get("RegionID") or 0),
                   stun_only=bool(doc.get("STUNOnly")))


def addresses_by_family(node: DerpNodeLike) -> list[tuple[int, str]]:
    """(IP version, address or host name) for each family the node may be reached over: IPv4
    first, then IPv6; an empty field means "resolve HostName" in that family, a field that is no
    address of its family ("none") leaves the family out."""
    out: list[tuple[int, str]] = []
    for value, version in ((node.ipv4, 4), (node.ipv6, 6)):
        if not value:
            out.append((version, node.host_name))
            continue
        try:
            ip = ipaddress.ip_address(value)
        except ValueError:
            continue
        if ip.version == version:
            out.append((version, str(ip)))
    return out


def dial_addresses(node: DerpNodeLike) -> list[str]:
    """Addresses to try in order: IPv4 first, then IPv6; an empty field means "resolve HostName"."""
    return list(dict.fromkeys(candidate for _, candidate in addresses_by_family(node)))


def cap_tls_reads(writer: asyncio.StreamWriter, size: int = TLS_READ_SIZE) -> bool:
    """Make asyncio's TLS layer read at most ``size`` decrypted bytes at a time on ``writer``'s
    connection; False where the transport has no such layer (plain TCP, another event loop).

    CPython's ``SSLProtocol`` reads each TLS record into a new bytes object of ``max_size``
    (256 KiB) and shrinks it to what arrived. Above the agent's fixed 128 KiB mmap threshold
    (tailnet_agent/memory.py) every such object is its own mapping: an ``mmap``, a page fault, an
    ``mremap`` and a ``munmap`` per read, about two thirds of the agent's system calls on a DERP
    download (docs/benchmarks.md, "Where the agent's time goes"). Below the threshold the
    buffer comes from the heap. ``max_size`` is the class attribute the protocol reads per call;
    it is set on this one instance.
    """
    protocol = getattr(writer.transport, "_ssl_protocol", None)
    if protocol is None or not isinstance(getattr(protocol, "max_size", None), int):
        return False
    protocol.max_size = size
    return True


def tls_context(ca_bundle: Path | str | None = None) -> ssl.SSLContext:
    """A verifying client context; ``ca_bundle`` is a PEM file of trusted CAs (None: system store)."""
    return ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle is not None else None)


def short_key(key: bytes) -> str:
    """``[abcde]``, the way Tailscale logs a key (``ShortString``)."""
    return f"[{key.hex()[:5]}]"


class DerpConnection:
    """An established DERP connection. Create with :meth:`open`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handshake: ClientHandshake,
                 *, read_timeout: float, label: str) -> None:
        assert handshake.state is HandshakeState.ESTABLISHED
        assert handshake.server_key is not None and handshake.server_info is not None
        self._reader = reader
        self._writer = writer
        self.public_key: bytes = handshake.public_key
        """Our node public key (32 bytes)."""
        self.server_key: bytes = handshake.server_key
        """The DERP server's public key (32 bytes)."""
        self.server_info: f.ServerInfo = handshake.server_info
        self.response_headers = handshake.response_headers
        """Headers of the 101 response, lower-cased (Headscale sends ``derp-version``, ``derp-public-key``)."""
        self.read_timeout = read_timeout
        self.label = label
        self._pending = handshake.trailing_data()
        self._log = log.bind(derp=label, node_key=short_key(self.public_key))

    # -- connecting ---------------------------------------------------------------------------------

    @classmethod
    async def open(cls, node: DerpNodeLike, private_key: bytes, *, tls: ssl.SSLContext | None = None,
                   plaintext: bool = False, connect_timeout: float = 10.0, read_timeout: float = 120.0,
                   client_info: f.ClientInfo | None = None) -> DerpConnection:
        """Dial ``node``, upgrade to DERP and complete the handshake (ServerInfo received).

        ``private_key`` is the raw 32-byte node private key; it never leaves this process or the logs.
        ``tls`` defaults to a context trusting the system store (see :func:`tls_context`);
        ``plaintext=True`` skips TLS (only for tests, like ``TS_DEBUG_USE_DERP_HTTP``).
        ``connect_timeout`` (seconds, default 10, the server's own handshake deadline) bounds the
        TCP+TLS dial of each address, and then the upgrade and handshake. ``read_timeout`` (seconds,
        default 120 as Go's ``Client.Recv``; the server sends a KeepAlive every 60 s) bounds each
        later read. Raises :class:`DerpConnectError` subclasses (dial, TLS, refused upgrade, rejected
        key, timeout) or :class:`ProtocolError` (the server broke the protocol).
        """
        port = node.derp_port or DEFAULT_PORT
        label = f"{node.host_name}:{port}"
        context = None if plaintext else (tls or tls_context())
        reader, writer, address = await cls._dial(node, port, context, connect_timeout)
        try:
            handshake = ClientHandshake(private_key, host=node.host_name, client_info=client_info)
            async with asyncio.timeout(connect_timeout):
                await cls._handshake(reader, writer, handshake, label)
        except TimeoutError:
            writer.close()
            raise DerpConnectError(f"DERP handshake with {label} timed out after {connect_timeout:g}s") from None
        except BaseException:
            writer.close()
            raise
        conn = cls(reader, writer, handshake, read_timeout=read_timeout, label=label)
        conn._log.info("derp connected", address=address, server_key=short_key(conn.server_key),
                       server_version=conn.server_info.version)
        return conn

    @staticmethod
    async def _dial(node: DerpNodeLike, port: int, context: ssl.SSLContext | None,
                    timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        """TCP (+TLS) to the first address that answers; TLS failures are not retried elsewhere."""
        addresses = dial_addresses(node)
        if not addresses:
            raise DerpConnectError(f"DERP node {node.host_name!r} has no usable address")
        last: DerpConnectError | None = None
        for address in addresses:
            try:
                async with asyncio.timeout(timeout):
                    reader, writer = await asyncio.open_connection(
                        address, port, ssl=context, server_hostname=node.host_name if context else None,
                        limit=READ_SIZE)
                cap_tls_reads(writer)
                return reader, writer, address
            except TimeoutError:
                last = DerpConnectError(f"DERP connect to {address}:{port} timed out after {timeout:g}s")
            except ssl.SSLCertVerificationError as exc:
                raise DerpTLSError(f"TLS certificate of {address}:{port} (SNI {node.host_name!r}) not trusted: "
                                   f"{exc.verify_message or exc}") from exc
            except ssl.SSLError as exc:
                raise DerpTLSError(f"TLS handshake with {address}:{port} (SNI {node.host_name!r}) failed: "
                                   f"{exc}") from exc
            except OSError as exc:
                last = DerpConnectError(f"DERP connect to {address}:{port} failed: {exc}")
                last.__cause__ = exc
        assert last is not None
        raise last

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hs: ClientHandshake,
                         label: str) -> None:
        try:
            while hs.state is not HandshakeState.ESTABLISHED:
                if out := hs.data_to_send():
                    writer.write(out)
                    await writer.drain()
                data = await reader.read(READ_SIZE)
                if not data:
                    raise EOFError
                hs.receive_data(data)
        except (EOFError, ConnectionError) as exc:
            if hs.state is HandshakeState.AWAITING_SERVER_INFO:
                raise HandshakeRejected(
                    f"DERP server {label} closed the connection after ClientInfo: node key "
                    f"{short_key(hs.public_key)} was not admitted (with verify_clients the key must belong "
                    "to a registered node)") from exc
            raise ConnectionLost(f"DERP server {label} closed the connection while {hs.state.value}") from exc
        except ssl.SSLError as exc:
            raise DerpTLSError(f"TLS error with {label} during the DERP handshake: {exc}") from exc

    # -- raw mode -----------------------------------------------------------------------------------

    async def read_chunk(self) -> bytes:
        """The next bytes of the frame stream (never empty). Raises :class:`ConnectionLost` at EOF,
        on errors, or when nothing arrives for ``read_timeout`` seconds."""
        return await self._read()

    def write(self, data: bytes) -> None:
        """Queue bytes (whole frames) for sending; follow with ``await drain()`` for backpressure."""
        if self._writer.is_closing():
            raise ConnectionLost(f"DERP connection {self.label} is closed")
        self._writer.write(data)

    def buffered(self) -> int:
        """Bytes written but not yet handed to the socket."""
        return self._writer.transport.get_write_buffer_size()

    async def drain(self) -> None:
        """Wait until the write buffer is below its high-water mark (64 KiB by default)."""
        try:
            await self._writer.drain()
        except (ConnectionError, ssl.SSLError) as exc:
            raise ConnectionLost(f"DERP connection {self.label} failed while writing: {exc}") from exc

    # -- control frames -----------------------------------------------------------------------------

    async def note_preferred(self, preferred: bool) -> None:
        """Tell the server whether this is our home region (server statistics only)."""
        self.write(f.encode_note_preferred(preferred))
        await self.drain()

    async def send_ping(self, data: bytes) -> None:
        """Send an 8-byte Ping; the server answers with a Pong carrying the same bytes."""
        self.write(f.encode_ping(data))
        await self.drain()

    # -- lifecycle ----------------------------------------------------------------------------------

    def is_closing(self) -> bool:
        return self._writer.is_closing()

    async def close(self) -> None:
        """Close the connection; errors while closing are ignored."""
        if not self._writer.is_closing():
            self._log.debug("derp connection closing")
        self._writer.close()
        with contextlib.suppress(OSError, ssl.SSLError, asyncio.TimeoutError):
            async with asyncio.timeout(2.0):
                await self._writer.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- internals ----------------------------------------------------------------------------------

    async def _read(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        try:
            async with asyncio.timeout(self.read_timeout):
                data = await self._reader.read(READ_SIZE)
        except TimeoutError:
            raise ConnectionLost(f"no data from DERP server {self.label} for {self.read_timeout:g}s") from None
        except (ConnectionError, ssl.SSLError) as exc:
            raise ConnectionLost(f"DERP connection {self.label} failed: {exc}") from exc
        if not data:
            raise ConnectionLost(f"DERP server {self.label} closed the connection")
        return data
