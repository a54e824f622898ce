"""The name a TLS client asks for, read from its ClientHello without terminating TLS (sans-IO).

:func:`read_client_hello` takes the bytes a client has sent so far and answers one of three
things: the ClientHello is whole (a :class:`ClientHello`, with the SNI name if any), more bytes
are needed (None), or these bytes do not begin a ClientHello this module accepts
(:class:`ClientHelloError`). It is total: on any input it returns or raises that error, nothing
else (``unit_tests/agent/fuzz``). The answer for a prefix never contradicts the answer for the
whole: None means no error was found yet, and at :data:`READ_LIMIT` bytes it is never None.

What is read, and refused when it is not so (RFC 8446 §5.1 and §4.1.2, RFC 6066 §3):

1. TLS records of type handshake (22), version 3.x, each of 1 to 16384 bytes; the ClientHello may
   span up to :data:`MAX_RECORDS` of them (SSL 2.0's hello, or anything else first, is refused).
2. One handshake message of type client_hello (1) whose body is at most :data:`MAX_HELLO` bytes.
3. Its body: legacy_version 3.x, the random, a session id of at most 32 bytes, cipher suites (an
   even number of bytes, at least 2), compression methods (at least 1), then extensions, absent
   only when nothing follows the compression methods (TLS 1.2 allows that), else filling the body
   exactly, with no extension type twice.
4. server_name (type 0): a list holding exactly one entry, of type host_name (RFC 6066 defines no
   other and forbids two of one type; OpenSSL accepts nothing else either): 1 to 253 bytes of
   letters, digits, ``-`` and ``_``, in labels of 1 to 63 separated by ``.``. It is returned
   lower-case, a trailing dot removed (RFC 6066 says to send none; the http mode strips it too).

What follows the ClientHello (in its last record, or a TLS 1.3 client's early data after it) is
not looked at: it is the caller's to pass on with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_HELLO", "MAX_RECORDS", "READ_LIMIT", "ClientHello", "ClientHelloError", "read_client_hello"]

HANDSHAKE = 22
"""The record content type of handshake messages."""
CLIENT_HELLO = 1
"""The handshake message type of the ClientHello."""
SERVER_NAME = 0
"""The extension type of server_name (RFC 6066 §3)."""
HOST_NAME = 0
"""The only server name type, host_name."""
RECORD_HEADER = 5
MAX_RECORD = 1 << 14
"""Bytes of one record's fragment (RFC 8446 §5.1: 2^14)."""
MAX_HELLO = 1 << 14
"""Bytes of the ClientHello's body the agent reads (16 KiB). A hello with many post-quantum key
shares is a few KiB; a larger one is refused rather than buffered."""
MAX_RECORDS = 16
"""Records the ClientHello may be split into."""
READ_LIMIT = (MAX_RECORDS + 1) * RECORD_HEADER + 4 + MAX_HELLO - 1
"""Bytes after which :func:`read_client_hello` always decides (16,472): the most it may still
need is the largest hello accepted but its last byte, in the most records accepted, and then one
record header more, which is refused."""
MAX_NAME = 253


class ClientHelloError(ValueError):
    """The bytes are not the beginning of a ClientHello this module accepts; ``str()`` says why."""


@dataclass(frozen=True, kw_only=True)
class ClientHello:
    """What the agent reads from a whole ClientHello."""

    server_name: str | None
    """The SNI host name (lower-case, no trailing dot); None when the client sent no server_name."""
    size: int
    """Bytes from the first record's start to the ClientHello's end (record headers included)."""


def read_client_hello(data: bytes | bytearray | memoryview) -> ClientHello | None:
    """The ClientHello at the start of ``data``; None while it is not whole yet (shape and limits
    in the module docstring). Raises :class:`ClientHelloError` only."""
    data = bytes(data)
    message = bytearray()
    at = records = 0
    while len(data) - at >= RECORD_HEADER:
        kind, major, length = data[at], data[at + 1], int.from_bytes(data[at + 3:at + 5])
        if kind != HANDSHAKE:
            raise ClientHelloError(f"not a TLS handshake record (content type {kind})")
        if major != 3:
            raise ClientHelloError(f"not a TLS record (version {major}.{data[at + 2]})")
        if not 0 < length <= MAX_RECORD:
            raise ClientHelloError(f"a handshake record of {length} bytes (1 to {MAX_RECORD})")
        records += 1
        if records > MAX_RECORDS:
            raise ClientHelloError(f"the ClientHello spans more than {MAX_RECORDS} records")
        fragment = data[at + RECORD_HEADER:at + RECORD_HEADER + length]
        message += fragment
        if len(message) >= 4:
            if message[0] != CLIENT_HELLO:
                raise ClientHelloError(f"the first handshake message is of type {message[0]}, not a ClientHello")
            body = int.from_bytes(message[1:4])
            if body > MAX_HELLO:
                raise ClientHelloError(f"a ClientHello of {body} bytes (at most {MAX_HELLO})")
            if len(message) >= 4 + body:
                used = len(fragment) - (len(message) - 4 - body)
                return ClientHello(server_name=_server_name(bytes(message[4:4 + body])),
                                   size=at + RECORD_HEADER + used)
        if len(fragment) < length:
            return None  # the record is not whole yet
        at += RECORD_HEADER + length
    return None


class _Reader:
    """Reads a ClientHello's fields front to back; a field that does not fit is the error."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.at, self.what = data, 0, what

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int, field: str) -> bytes:
        if n > self.left:
            raise ClientHelloError(f"{self.what}: {field} runs past its end")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def number(self, size: int, field: str) -> int:
        return int.from_bytes(self.take(size, field))

    def vector(self, size: int, field: str, low: int, high: int) -> bytes:
        """A vector with a ``size``-byte length of ``low`` to ``high`` bytes."""
        length = self.number(size, f"the length of {field}")
        if not low <= length <= high:
            raise ClientHelloError(f"{self.what}: {field} of {length} bytes ({low} to {high})")
        return self.take(length, field)

    def end(self) -> None:
        if self.left:
            raise ClientHelloError(f"{self.what}: {self.left} bytes after its last field")


def _server_name(body: bytes) -> str | None:
    hello = _Reader(body, "ClientHello")
    if hello.number(1, "legacy_version") != 3:
        raise ClientHelloError("ClientHello: legacy_version is not 3.x")
    hello.take(1 + 32, "random")
    hello.vector(1, "legacy_session_id", 0, 32)
    if len(hello.vector(2, "cipher_suites", 2, 0xFFFE)) % 2:
        raise ClientHelloError("ClientHello: cipher_suites of an odd number of bytes")
    hello.vector(1, "legacy_compression_methods", 1, 0xFF)
    if not hello.left:
        return None  # no extensions (TLS 1.2 and older)
    extensions = _Reader(hello.vector(2, "extensions", 0, 0xFFFF), "extensions")
    hello.end()
    seen: set[int] = set()
    name: str | None = None
    while extensions.left:
        kind = extensions.number(2, "an extension's type")
        data = extensions.vector(2, f"extension {kind}", 0, 0xFFFF)
        if kind in seen:
            raise ClientHelloError(f"extensions: extension {kind} appears twice")
        seen.add(kind)
        if kind == SERVER_NAME:
            name = _host_name(data)
    return name


def _host_name(data: bytes) -> str:
    extension = _Reader(data, "server_name")
    names = _Reader(extension.vector(2, "server_name_list", 1, 0xFFFF), "server_name_list")
    extension.end()
    if (kind := names.number(1, "name_type")) != HOST_NAME:
        raise ClientHelloError(f"server_name_list: a name of type {kind}, not host_name")
    raw = names.vector(2, "host_name", 1, 0xFFFF)
    names.end()  # one name only
    name = raw[:-1] if raw.endswith(b".") else raw
    labels = name.split(b".")
    if not 0 < len(name) <= MAX_NAME or not all(0 < len(label) <= 63 and label.replace(b"-", b"").replace(
            b"_", b"").isalnum() and label.isascii() for label in labels):
        raise ClientHelloError(f"server_name: {raw[:80]!r} is not a host name")
    return name.decode("ascii").lower()
