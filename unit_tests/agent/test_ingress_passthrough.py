"""The tls expose end to end on loopback: the ClientHello's SNI picks the expose among the tls
exposes of a port (exact name, wildcard, ``*``), the client's TLS reaches the backend untouched
(the client verifies the backend's own certificate: the agent holds none), a hello split over
records and writes, refusals by reason (an unknown name and a missing SNI with their alerts, junk,
a client that closes or stalls), the hello and a half-close reaching the backend as sent, and an
expose removed from a shared port ending its connections only."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from hack.localenv import free_port
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.exposes import TLS, Backend, Expose, VirtualHost
from tailnet_agent.forward.passthrough import PassthroughPort
from tailnet_agent.health import AgentMetrics

from .test_clienthello import openssl_hello
from .test_ingress_http import running

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "pki", "passthrough")


@contextlib.asynccontextmanager
async def tls_backend(ca: CertificateAuthority, name: str, *hosts: str) -> AsyncIterator[int]:
    """A TLS server with its own certificate (for ``hosts``) that answers each line with
    ``name: line``."""
    pair = ca.issue(name, common_name=hosts[0], hosts=hosts)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pair.cert, pair.key)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while line := await reader.readline():
                writer.write(f"{name}: ".encode() + line)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def client(ca: CertificateAuthority, *, check_name: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert_path))
    context.check_hostname = check_name
    return context


async def connect(port: int, ca: CertificateAuthority, sni: str, *, check_name: bool = True) -> Stream:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=client(ca, check_name=check_name),
                                                          server_hostname=sni), 10)


async def say(stream: Stream, line: str) -> str:
    reader, writer = stream
    writer.write(line.encode() + b"\n")
    return (await asyncio.wait_for(reader.readline(), 10)).decode().strip()


def peer_names(stream: Stream) -> list[str]:
    der = stream[1].get_extra_info("ssl_object").getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def tls_expose(name: str, port: int, backend: int, *hosts: str) -> Expose:
    return Expose(name=name, port=port, mode=TLS, backend=Backend(host="127.0.0.1", port=backend),
                  hosts=tuple(VirtualHost(name=h) for h in hosts))


def refused(metrics: AgentMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("tailnet_agent_passthrough_refused_total", {"reason": reason}) or 0.0


async def closed_by_agent(reader: asyncio.StreamReader) -> bytes:
    """What the agent sent before it closed (a reset reads as the end too)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(reader.read(1024), 10):
            data += chunk
    return data


async def test_sni_picks_the_expose_and_the_backend_terminates_tls(ca: CertificateAuthority) -> None:
    listen, metrics = free_port(), AgentMetrics()
    async with tls_backend(ca, "db", "db.example.test", "db") as db, \
            tls_backend(ca, "mq", "mq.example.test", "x.mq.example.test", "a.b.mq.example.test") as mq:
        exposes = (tls_expose("db", listen, db, "db.example.test"),
                   Expose(name="mq", port=listen, mode=TLS, backend=Backend(host="127.0.0.1", port=mq),
                          hosts=(VirtualHost(name="mq.example.test", alias="mq"),
                                 VirtualHost(name="*.mq.example.test"))))
        async with running(exposes, metrics=metrics) as ingress:
            assert isinstance(ingress.ports[listen], PassthroughPort) and not ingress.services
            for sni, name, names in (("db.example.test", "db", ["db.example.test", "db"]),
                                     ("DB.example.test", "db", ["db.example.test", "db"]),
                                     ("mq.example.test", "mq", ["mq.example.test", "x.mq.example.test",
                                                                "a.b.mq.example.test"]),
                                     ("x.mq.example.test", "mq", None), ("a.b.mq.example.test", "mq", None)):
                stream = await connect(listen, ca, sni)
                assert await say(stream, sni) == f"{name}: {sni}"
                assert await say(stream, "again") == f"{name}: again"
                assert peer_names(stream) == (names or peer_names(stream)), "the backend's own certificate"
                stream[1].close()
            mq_only = await connect(listen, ca, "mq", check_name=False)  # an alias is a name of its host
            assert await say(mq_only, "alias") == "mq: alias"
            mq_only[1].close()
            sent = metrics.registry.get_sample_value("tailnet_agent_bytes_total", {"target": "db", "direction": "sent"})
            assert sent and sent > 200, "the ClientHello and what followed are counted as the expose's"
            assert metrics.registry.get_sample_value("tailnet_agent_connections_total", {"target": "mq"}) == 4


async def test_unknown_names_and_a_missing_sni_are_refused_with_an_alert(ca: CertificateAuthority) -> None:
    listen, metrics = free_port(), AgentMetrics()
    async with tls_backend(ca, "db", "db.example.test") as db, \
            running((tls_expose("db", listen, db, "db.example.test", "*.db.example.test"),), metrics=metrics):
        for sni in ("elsewhere.test", "db.example.test.evil", "example.test"):
            with pytest.raises(ssl.SSLError, match="UNRECOGNIZED_NAME"):
                await connect(listen, ca, sni)
        assert refused(metrics, "unknown_name") == 3
        with pytest.raises(ssl.SSLError, match="MISSING_EXTENSION"):
            await connect(listen, ca, "", check_name=False)
        assert refused(metrics, "no_server_name") == 1
        assert metrics.registry.get_sample_value("tailnet_agent_connections_total", {"target": "db"}) is None


async def test_any_host_takes_other_names_and_no_sni(ca: CertificateAuthority) -> None:
    listen = free_port()
    async with tls_backend(ca, "db", "db.example.test") as db, tls_backend(ca, "any", "any.example.test") as anyhost:
        exposes = (tls_expose("db", listen, db, "db.example.test"), tls_expose("any", listen, anyhost, "*"))
        async with running(exposes):
            for sni, name in (("db.example.test", "db"), ("other.test", "any"), ("", "any")):
                stream = await connect(listen, ca, sni, check_name=False)
                assert await say(stream, "who") == f"{name}: who"
                stream[1].close()


async def test_a_hello_split_over_records_and_writes_is_routed(ca: CertificateAuthority) -> None:
    listen = free_port()
    async with tls_backend(ca, "db", "db.example.test") as db, \
            running((tls_expose("db", listen, db, "db.example.test"),)):
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = client(ca).wrap_bio(incoming, outgoing, server_hostname="db.example.test")
        with pytest.raises(ssl.SSLWantReadError):
            tls.do_handshake()
        first = outgoing.read()
        message, rest = first[5:5 + int.from_bytes(first[3:5])], first[5 + int.from_bytes(first[3:5]):]
        for at in range(0, len(message), 50):  # a record of 50 bytes each, written one by one
            piece = message[at:at + 50]
            writer.write(b"\x16\x03\x01" + len(piece).to_bytes(2) + piece)
            await writer.drain()
        writer.write(rest)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                writer.write(outgoing.read())
                incoming.write(await asyncio.wait_for(reader.read(65536), 10))
        tls.write(b"pieces\n")
        writer.write(outgoing.read())
        answer = b""
        while not answer.endswith(b"\n"):
            with contextlib.suppress(ssl.SSLWantReadError):
                answer += tls.read(1024)
                continue
            incoming.write(await asyncio.wait_for(reader.read(65536), 10))
        assert answer == b"db: pieces\n"
        writer.close()


async def test_junk_a_client_that_closes_and_one_that_stalls_are_refused(ca: CertificateAuthority) -> None:
    listen, metrics = free_port(), AgentMetrics()
    async with tls_backend(ca, "db", "db.example.test") as db, \
            running((tls_expose("db", listen, db, "db.example.test"),), metrics=metrics) as ingress:
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(b"GET / HTTP/1.1\r\nHost: db.example.test\r\n\r\n")
        assert await closed_by_agent(reader) == b"", "junk is closed without a word"
        assert refused(metrics, "invalid") == 1
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        writer.write_eof()
        assert await closed_by_agent(reader) == b""
        assert refused(metrics, "closed") == 1
        writer.close()

        port = ingress.ports[listen]
        assert isinstance(port, PassthroughPort)
        port.timeout = 0.2
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        assert await closed_by_agent(reader) == b""
        assert refused(metrics, "timeout") == 1
        writer.close()
        assert await say(await connect(listen, ca, "db.example.test"), "still") == "db: still"


async def test_an_expose_removed_from_a_shared_port_ends_its_connections_only(ca: CertificateAuthority) -> None:
    listen = free_port()
    async with tls_backend(ca, "db", "db.example.test") as db, tls_backend(ca, "mq", "mq.example.test") as mq:
        first, second = tls_expose("db", listen, db, "db.example.test"), tls_expose("mq", listen, mq, "mq.example.test")
        async with running((first, second)) as ingress:
            kept, ended = await connect(listen, ca, "db.example.test"), await connect(listen, ca, "mq.example.test")
            assert (await say(kept, "a"), await say(ended, "b")) == ("db: a", "mq: b")
            await ingress.forwarder.apply((first,))
            assert await say(kept, "c") == "db: c", "its sibling's connection stays"
            assert await closed_by_agent(ended[0]) == b"", "the removed expose's connection ended"
            with pytest.raises(ssl.SSLError, match="UNRECOGNIZED_NAME"):
                await connect(listen, ca, "mq.example.test")
            kept[1].close()
            ended[1].close()


async def test_the_hello_and_the_clients_half_close_reach_the_backend_as_sent() -> None:
    """The backend gets the ClientHello byte for byte, what followed it, and the client's EOF while
    its answer still flows back (half-close, as a tcp expose)."""

    async def count_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        writer.write(b"%d %s\n" % (len(data), data[-5:]))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(count_until_eof, "127.0.0.1", 0)
    listen, hello = free_port(), openssl_hello("db.example.test")
    try:
        async with running((tls_expose("db", listen, server.sockets[0].getsockname()[1], "db.example.test"),)):
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            writer.write(hello + b"after")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 10) == b"%d after\n" % (len(hello) + 5)
            writer.close()
    finally:
        server.close()
