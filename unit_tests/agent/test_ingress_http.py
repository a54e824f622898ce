"""The http expose end to end on loopback: SNI picks the certificate, Host is bound to it (421),
HTTP/1.1 and HTTP/2 to clients, forwarding headers, a verified HTTPS backend (502 with a wrong CA),
a certificate replaced on disk served to new handshakes, and a tcp expose with half-close."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509

from hack.https_client import Answer, request
from hack.localenv import free_port
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.exposes import Backend, Expose, VirtualHost
from tailnet_agent.forward.egress import Closable
from tailnet_agent.forward.http import host_of, misdirected, request_headers, response_headers
from tailnet_agent.forward.ingress import Ingress


class LoopbackNode:
    """Listens on 127.0.0.1 instead of the tailnet."""

    async def wait_ready(self) -> None:
        pass

    async def listen(self, protocol_factory: Callable[[], asyncio.Protocol], port: int) -> Closable:
        return await asyncio.get_running_loop().create_server(protocol_factory, "127.0.0.1", port)


@contextlib.asynccontextmanager
async def running(exposes: tuple[Expose, ...]) -> AsyncIterator[Ingress]:
    ingress = Ingress(LoopbackNode(), exposes)
    task = asyncio.create_task(ingress.forwarder.run())
    try:
        await asyncio.wait([task, asyncio.create_task(ingress.forwarder.listening.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        yield ingress
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"path": request.path_qs, "method": request.method, "bodyLength": len(body),
                              "headers": {k.lower(): v for k, v in request.headers.items()}})


@contextlib.asynccontextmanager
async def backend(tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    try:
        yield port
    finally:
        await runner.cleanup()


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "pki", "ingress")


def vhost(ca: CertificateAuthority, name: str, alias: str | None = None) -> VirtualHost:
    pair = ca.issue(name, common_name=name, hosts=(name, alias) if alias else (name,))
    return VirtualHost(name=name, alias=alias, cert_file=str(pair.cert), key_file=str(pair.key))


async def ask(port: int, ca: CertificateAuthority, sni: str, **kw: Any) -> Answer:
    return await request(await asyncio.open_connection("127.0.0.1", port), ca=ca.cert_path, sni=sni, **kw)


def subject_names(der: bytes) -> list[str]:
    cert = x509.load_der_x509_certificate(der)
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)


# -- pure parts -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("authority", "wrong"), [
    ("shop.example.com", False), ("SHOP.example.com:443", False), ("shop.example.com.", False), ("shop", False),
    ("shop:8443", False), ("other.example.com", True), ("", True), (None, True), ("[::1]:443", True),
])
def test_host_must_name_the_tls_host_or_its_alias(authority: str | None, wrong: bool) -> None:
    host = VirtualHost(name="shop.example.com", alias="shop", cert_file="c", key_file="k")
    assert misdirected(host, authority) is wrong


def test_host_of_strips_port_case_and_dot() -> None:
    assert [host_of(a) for a in ("A.b:1", "a.b.", "[::1]:8", "x")] == ["a.b", "a.b", "[::1]", "x"]


def test_forwarding_headers_replace_the_clients_and_drop_hop_by_hop() -> None:
    sent = [("Host", "shop"), ("X-Forwarded-For", "6.6.6.6"), ("Forwarded", "for=evil"),
            ("Connection", "X-Trace, close"), ("X-Trace", "1"),
            ("Keep-Alive", "5"), ("TE", "trailers"), ("Accept", "*/*"), (":path", "/")]
    assert request_headers(sent, client="100.64.0.9", authority="shop") == [
        ("Host", "shop"), ("Accept", "*/*"), ("X-Forwarded-For", "100.64.0.9"), ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "shop")]
    assert response_headers([("Transfer-Encoding", "chunked"), ("Connection", "close"), ("ETag", "x")]) == [
        ("ETag", "x")]


# -- over loopback --------------------------------------------------------------------------------

async def test_sni_host_binding_http1_and_http2(ca: CertificateAuthority) -> None:
    a, b = vhost(ca, "a.example.test", "a"), vhost(ca, "b.example.test")
    async with backend() as port:
        web_expose = Expose(name="web", port=free_port(), mode="http", backend=Backend(host="127.0.0.1", port=port),
                            hosts=(a, b))
        async with running((web_expose,)):
            listen = web_expose.port
            for sni, names in (("a.example.test", ["a.example.test", "a"]), ("a", ["a.example.test", "a"]),
                               ("b.example.test", ["b.example.test"])):
                for alpn in ("http/1.1", "h2"):
                    answer = await ask(listen, ca, sni, alpn=alpn, path="/x?y=1")
                    assert answer.alpn == alpn and answer.status == 200, answer
                    assert subject_names(answer.certificate) == names
                    seen = json.loads(answer.body)
                    assert seen["path"] == "/x?y=1"
                    assert seen["headers"]["host"] == sni and seen["headers"]["x-forwarded-host"] == sni
                    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
                    assert seen["headers"]["x-forwarded-proto"] == "https"
                    wrong = await ask(listen, ca, sni, alpn=alpn, host="b.example.test" if sni != "b.example.test"
                                      else "a.example.test")
                    assert wrong.status == 421, wrong
            big = bytes(range(256)) * 8192  # 2 MiB up, through HTTP/2 flow control
            for alpn in ("http/1.1", "h2"):
                answer = await ask(listen, ca, "a.example.test", alpn=alpn, method="POST", body=big)
                assert json.loads(answer.body)["bodyLength"] == len(big)
            with pytest.raises((ssl.SSLError, ConnectionError)):  # refused by the SNI callback
                await ask(listen, ca, "c.example.test")


def install(host: VirtualHost, cert: bytes, key: bytes) -> None:
    Path(host.cert_file).write_bytes(cert)
    Path(host.key_file).write_bytes(key)


async def test_a_replaced_certificate_serves_new_handshakes(ca: CertificateAuthority, tmp_path: Path) -> None:
    a = vhost(ca, "a.example.test")
    async with backend() as port:
        expose = Expose(name="web", port=free_port(), mode="http", backend=Backend(host="127.0.0.1", port=port),
                        hosts=(a,))
        async with running((expose,)) as ingress:
            first = await ask(expose.port, ca, "a.example.test")
            before = ingress.services["web"].certs.status()[0]["notAfter"]
            renewed = ca.issue("renewed", common_name="renewed", hosts=("a.example.test", "renewed.example.test"))
            install(a, renewed.cert.read_bytes(), renewed.key.read_bytes())
            second = await ask(expose.port, ca, "a.example.test")
            assert first.certificate != second.certificate
            assert subject_names(second.certificate) == ["a.example.test", "renewed.example.test"]
            assert ingress.services["web"].certs.status()[0]["notAfter"] >= before
            install(a, renewed.cert.read_bytes(), b"not a key")
            third = await ask(expose.port, ca, "a.example.test")
            assert third.certificate == second.certificate, "a broken file keeps the certificate in force"
            assert "cannot load" in ingress.services["web"].certs.status()[0]["error"]


async def test_https_backend_is_verified(ca: CertificateAuthority, tmp_path: Path) -> None:
    a = vhost(ca, "a.example.test")
    app_pair = ca.issue("app", common_name="app.internal", hosts=("app.internal",))
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(app_pair.cert, app_pair.key)
    other = CertificateAuthority(tmp_path / "other", "other")
    async with backend(tls) as port:
        def expose(name: str, ca_file: Path) -> Expose:
            return Expose(name=name, port=free_port(), mode="http", hosts=(a,), backend=Backend(
                host="127.0.0.1", port=port, scheme="https", ca_file=str(ca_file), server_name="app.internal"))

        good, bad = expose("good", ca.cert_path), expose("bad", other.cert_path)
        async with running((good, bad)):
            assert (await ask(good.port, ca, "a.example.test", alpn="h2")).status == 200
            for alpn in ("http/1.1", "h2"):
                answer = await ask(bad.port, ca, "a.example.test", alpn=alpn)
                assert answer.status == 502 and b"certificate verify failed" in answer.body, answer


async def test_tcp_expose_keeps_half_close() -> None:
    async def answer_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        writer.write(b"%d\n" % len(data))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_after_eof, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    db = Expose(name="db", port=free_port(), backend=Backend(host="127.0.0.1", port=port))
    async with running((db,)) as ingress:
        reader, writer = await asyncio.open_connection("127.0.0.1", db.port)
        writer.write(b"x" * 100000)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"100000\n"
        writer.close()
        assert ingress.forwarder.is_listening("db")
    server.close()
