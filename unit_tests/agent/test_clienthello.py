"""The ClientHello reader (:mod:`tailnet_agent.forward.clienthello`): real hellos of Python's
OpenSSL, the same split over records and cut short, and hand-made ones that break each rule."""

from __future__ import annotations

import ssl

import pytest

from tailnet_agent.forward.clienthello import (
    MAX_HELLO,
    MAX_RECORDS,
    READ_LIMIT,
    ClientHello,
    ClientHelloError,
    read_client_hello,
)


def openssl_hello(server_name: str | None, *, alpn: tuple[str, ...] = ()) -> bytes:
    """The first flight of Python's TLS client (one record with the ClientHello)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def records(message: bytes, sizes: list[int], *, version: bytes = b"\x03\x01") -> bytes:
    """``message`` (handshake bytes) in records of these fragment sizes, the rest in a last one."""
    out, at = b"", 0
    for size in [*sizes, len(message)]:
        fragment = message[at:at + size]
        if fragment:
            out += bytes([22]) + version + len(fragment).to_bytes(2) + fragment
        at += len(fragment)
    return out


def hello_message(*, extensions: bytes | None = b"", session: bytes = b"", suites: bytes = b"\x13\x01",
                  compression: bytes = b"\x00", version: bytes = b"\x03\x03") -> bytes:
    """A ClientHello handshake message with these fields (``extensions`` None: no extensions field)."""
    body = (version + bytes(32) + bytes([len(session)]) + session + len(suites).to_bytes(2) + suites
            + bytes([len(compression)]) + compression)
    if extensions is not None:
        body += len(extensions).to_bytes(2) + extensions
    return b"\x01" + len(body).to_bytes(3) + body


FIXED = 2 + 32 + 1 + 2 + 2 + 1 + 1 + 2
"""Bytes of :func:`hello_message`'s body before its extensions (one suite, one compression method)."""


def extension(kind: int, data: bytes) -> bytes:
    return kind.to_bytes(2) + len(data).to_bytes(2) + data


def sni(*names: bytes, kind: int = 0) -> bytes:
    entries = b"".join(bytes([kind]) + len(n).to_bytes(2) + n for n in names)
    return extension(0, len(entries).to_bytes(2) + entries)


def hello(*exts: bytes, **kw: object) -> bytes:
    return records(hello_message(extensions=b"".join(exts), **kw), [])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["shop.example.test", "Shop.Example.TEST", "a", "x-1.y_2.example"])
def test_openssl_hello_gives_its_server_name(name: str) -> None:
    data = openssl_hello(name, alpn=("h2", "http/1.1"))
    assert read_client_hello(data) == ClientHello(server_name=name.lower(), size=len(data))


def test_openssl_hello_without_sni() -> None:
    data = openssl_hello(None)
    assert read_client_hello(data) == ClientHello(server_name=None, size=len(data))


def test_every_prefix_needs_more_and_what_follows_is_not_read() -> None:
    data = openssl_hello("shop.example.test")
    for end in range(len(data)):
        assert read_client_hello(data[:end]) is None, end
    after = data + b"\x17\x03\x03\x00\x05early" + b"junk"
    assert read_client_hello(after) == ClientHello(server_name="shop.example.test", size=len(data))


@pytest.mark.parametrize("sizes", [[1], [3], [4], [100], [1] * (MAX_RECORDS - 1), [7, 200, 13]])
def test_a_hello_split_over_records(sizes: list[int]) -> None:
    message = openssl_hello("blog.example.test")[5:]
    data = records(message, sizes)
    for end in range(0, len(data), 7):
        assert read_client_hello(data[:end]) is None
    assert read_client_hello(data + b"more") == ClientHello(server_name="blog.example.test", size=len(data))


def test_too_many_records_are_refused() -> None:
    message = openssl_hello("blog.example.test")[5:]
    with pytest.raises(ClientHelloError, match="more than 16 records"):
        read_client_hello(records(message, [1] * MAX_RECORDS))


def test_a_hello_of_the_largest_size_in_the_most_records_is_read_within_the_limit() -> None:
    padding = extension(21, bytes(MAX_HELLO - FIXED - 4 - len(sni(b"big.example.test"))))
    message = hello_message(extensions=padding + sni(b"big.example.test"))
    assert len(message) == 4 + MAX_HELLO
    data = records(message, [1] * (MAX_RECORDS - 2) + [MAX_HELLO - 100])
    assert len(data) == MAX_RECORDS * 5 + 4 + MAX_HELLO < READ_LIMIT
    assert read_client_hello(data) == ClientHello(server_name="big.example.test", size=len(data))
    assert read_client_hello(data[:-1]) is None
    bigger = hello_message(extensions=padding + sni(b"big.example.test") + extension(22, b""))
    with pytest.raises(ClientHelloError, match="of 16388 bytes"):
        read_client_hello(records(bigger, [4]))


def test_one_record_header_past_the_most_records_decides_at_the_limit() -> None:
    message = hello_message(extensions=extension(21, bytes(MAX_HELLO - FIXED - 4)))
    data = records(message[:-1], [1] * (MAX_RECORDS - 1)) + b"\x16\x03\x01\x00\x01"
    assert len(data) == READ_LIMIT
    with pytest.raises(ClientHelloError, match="more than 16 records"):
        read_client_hello(data)
    assert read_client_hello(data[:-1]) is None


@pytest.mark.parametrize(("data", "why"), [
    (b"GET / HTTP/1.1\r\n", "content type 71"),
    (b"\x80\x2e\x01\x03\x01", "content type 128"),  # SSL 2.0's hello
    (b"\x15\x03\x03\x00\x02\x02\x28", "content type 21"),
    (b"\x16\x02\x00\x00\x10", "version 2.0"),
    (b"\x16\x03\x01\x00\x00", "of 0 bytes"),
    (b"\x16\x03\x01\x40\x01", "of 16385 bytes"),
    (b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", "type 2, not a ClientHello"),
    (b"\x16\x03\x01\x00\x04\x01\x00\x40\x01", "of 16385 bytes"),
])
def test_what_is_not_a_client_hello_is_refused_at_once(data: bytes, why: str) -> None:
    with pytest.raises(ClientHelloError, match=why):
        read_client_hello(data)


@pytest.mark.parametrize(("message", "why"), [
    (hello_message(version=b"\x02\x00"), "legacy_version"),
    (hello_message(session=bytes(33)), "legacy_session_id of 33 bytes"),
    (hello_message(suites=b""), "cipher_suites of 0 bytes"),
    (hello_message(suites=b"\x13\x01\x13"), "odd number"),
    (hello_message(compression=b""), "legacy_compression_methods of 0 bytes"),
    (hello_message(extensions=extension(0, b"")[:3]), "runs past its end"),
    (b"\x01\x00\x00\x10\x03\x03" + bytes(14), "runs past its end"),
    (hello_message(extensions=extension(16, b"h2") + extension(16, b"h2")), "extension 16 appears twice"),
    (hello_message(extensions=extension(0, b"\x00")), "runs past its end"),
    (hello_message(extensions=sni(b"a.test") + b"\x00"), "runs past its end"),
    (hello_message(extensions=sni(b"a.test", b"b.test")), "after its last field"),
    (hello_message(extensions=sni(b"a.test", kind=1)), "not host_name"),
    (hello_message(extensions=sni(b"")), "host_name of 0 bytes"),
    (hello_message(extensions=extension(0, b"\x00\x00")), "server_name_list of 0 bytes"),
    (hello_message(extensions=extension(0, sni(b"a.test")[4:] + b"x")), "after its last field"),
    (hello_message(extensions=sni(b"a..test")), "not a host name"),
    (hello_message(extensions=sni(b".")), "not a host name"),
    (hello_message(extensions=sni(b"a\x00.test")), "not a host name"),
    (hello_message(extensions=sni(b"*.example.test")), "not a host name"),
    (hello_message(extensions=sni("\u00e9.test".encode())), "not a host name"),
    (hello_message(extensions=sni(b"a" * 64 + b".test")), "not a host name"),
    (hello_message(extensions=sni(b".".join([b"a" * 63] * 4))), "not a host name"),
])
def test_malformed_client_hellos_are_refused(message: bytes, why: str) -> None:
    with pytest.raises(ClientHelloError, match=why):
        read_client_hello(records(message, []))


def test_extensions_are_optional_and_a_trailing_dot_is_dropped() -> None:
    assert read_client_hello(records(hello_message(extensions=None), [])) == ClientHello(
        server_name=None, size=5 + 4 + FIXED - 2)
    assert read_client_hello(hello(extension(16, b"\x00\x03\x02h2"), sni(b"Shop.Example.Test."))) == ClientHello(
        server_name="shop.example.test", size=5 + 4 + FIXED + (4 + 5) + (4 + 2 + 3 + 18))
    assert read_client_hello(hello(sni(b".".join([b"a" * 63] * 3) + b".b" * 31))) is not None
