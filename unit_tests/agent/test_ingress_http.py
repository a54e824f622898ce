"""The http expose end to end on loopback: SNI picks the certificate (and, on a port shared by
several http exposes, the expose), Host is bound to it (421), HTTP/1.1 and HTTP/2 to clients,
forwarding and identity headers, a verified HTTPS backend (502 with a wrong CA), HTTP/2 backends
(h2c and h2 over TLS) with trailers both ways, a certificate replaced on disk served to new
handshakes, and a tcp expose with half-close."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509

from e2e.backends import served
from e2e.polling import eventually
from hack.grpc_echo import GrpcEcho, grpc_frame, grpc_messages
from hack.https_client import Answer, h2c_request, request
from hack.localenv import free_port
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.exposes import (
    Backend,
    Expose,
    HeaderEdits,
    Match,
    PathChange,
    Redirect,
    Rewrite,
    Route,
    VirtualHost,
    WeightedBackend,
)
from tailnet_agent.control import netmap as nm
from tailnet_agent.forward.egress import Closable
from tailnet_agent.forward.http import (
    Identity,
    PlainHttpPort,
    header_value,
    host_of,
    identify,
    identity_headers,
    misdirected,
    request_headers,
    response_headers,
    trailer_headers,
)
from tailnet_agent.forward.http.handover import HTTP2_PREFACE
from tailnet_agent.forward.ingress import Ingress
from tailnet_agent.health import AgentMetrics


class LoopbackNode:
    """Listens on 127.0.0.1 instead of the tailnet; ``netmap`` says who 127.0.0.1 is (or nobody)."""

    def __init__(self, netmap: nm.NetMap | None = None) -> None:
        self.netmap = netmap

    async def wait_ready(self) -> None:
        pass

    async def listen(self, protocol_factory: Callable[[], asyncio.Protocol], port: int) -> Closable:
        return await asyncio.get_running_loop().create_server(protocol_factory, "127.0.0.1", port)


@contextlib.asynccontextmanager
async def running(exposes: tuple[Expose, ...], netmap: nm.NetMap | None = None, *,
                  metrics: AgentMetrics | None = None) -> AsyncIterator[Ingress]:
    ingress = Ingress(LoopbackNode(netmap), exposes, metrics=metrics)
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
                              "headers": {k.lower(): v for k, v in request.headers.items()},
                              "headerList": [[k, v] for k, v in request.headers.items()]})


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


@contextlib.asynccontextmanager
async def named_backend(name: str, *, headers: bool = False) -> AsyncIterator[int]:
    """A backend that answers every request with its name and the path it was asked for (and the
    request's headers, lower-cased, with ``headers``)."""
    async def answer(request: web.Request) -> web.Response:
        seen = {"headers": {k.lower(): v for k, v in request.headers.items()}} if headers else {}
        return web.json_response({"backend": name, "path": request.path_qs, **seen})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    async with served(app) as port:
        yield port


async def test_routes_choose_the_backend_by_path_http1_and_http2(ca: CertificateAuthority) -> None:
    async with named_backend("default") as default, named_backend("api") as api, named_backend("v2") as v2:
        def to(port: int) -> Backend:
            return Backend(host="127.0.0.1", port=port)

        routes = (Route(path="/api", backend=to(api)), Route(path="/api/v2", type="Exact", backend=to(v2)))
        routed = vhost(ca, "routed.example.test")
        strict = vhost(ca, "strict.example.test")
        plain = vhost(ca, "plain.example.test")
        web_expose = Expose(name="web", port=free_port(), mode="http", backend=to(default), hosts=(
            VirtualHost(name=routed.name, cert_file=routed.cert_file, key_file=routed.key_file, routes=routes),
            VirtualHost(name=strict.name, cert_file=strict.cert_file, key_file=strict.key_file, routes=routes,
                        fallback=False),
            plain))
        async with running((web_expose,)):
            for alpn in ("http/1.1", "h2"):
                for sni, path, expected in (
                        ("routed.example.test", "/api/v2", "v2"), ("routed.example.test", "/api/v2/x", "api"),
                        ("routed.example.test", "/api?q=1", "api"), ("routed.example.test", "/apiary", "default"),
                        ("routed.example.test", "/", "default"), ("strict.example.test", "/api/x", "api"),
                        ("plain.example.test", "/api", "default")):
                    answer = await ask(web_expose.port, ca, sni, alpn=alpn, path=path)
                    assert answer.alpn == alpn and answer.status == 200, answer
                    assert json.loads(answer.body) == {"backend": expected, "path": path}, (sni, path, alpn)
                missed = await ask(web_expose.port, ca, "strict.example.test", alpn=alpn, path="/apiary?x=1")
                assert missed.status == 404, missed
                assert b"no path of strict.example.test matches /apiary" in missed.body


async def test_gateway_route_matches_weights_redirects_rewrites_and_header_edits_http1_and_http2(
        ca: CertificateAuthority) -> None:
    """The HTTPRoute features on a real listener: header, query and method matches chosen over a
    plain path, a 3:1 split between two backends, a redirect the agent answers itself, a path and
    Host rewrite the backend sees, and header edits both ways."""
    async with named_backend("default", headers=True) as default, named_backend("canary", headers=True) as canary, \
            named_backend("left", headers=True) as left, named_backend("right", headers=True) as right:
        def to(port: int) -> Backend:
            return Backend(host="127.0.0.1", port=port)

        edits = HeaderEdits(set=(Match(name="X-Env", value="set-by-route"),), add=(Match(name="X-Added", value="1"),),
                            remove=("X-Drop",))
        routes = (
            Route(path="/app", backend=to(default)),
            Route(path="/app", headers=(Match(name="X-Env", value="canary"),), backend=to(canary),
                  request_headers=edits,
                  response_headers=HeaderEdits(add=(Match(name="X-Served-By", value="canary"),))),
            Route(path="/app", method="POST", query=(Match(name="v", value="2"),), backend=to(canary)),
            Route(path="/split", backends=(WeightedBackend(backend=to(left), weight=3),
                                           WeightedBackend(backend=to(right), weight=1))),
            Route(path="/none", backends=(WeightedBackend(backend=to(left), weight=0),)),
            Route(path="/old", redirect=Redirect(path=PathChange(type="ReplacePrefixMatch", value="/new"), status=301)),
            Route(path="/insecure", redirect=Redirect(scheme="http")),
            Route(path="/strip", backend=to(left), rewrite=Rewrite(
                hostname="inside.svc", path=PathChange(type="ReplacePrefixMatch", value="/"))),
        )
        host = vhost(ca, "gw.example.test")
        expose = Expose(name="gw", port=free_port(), mode="http", backend=to(default), hosts=(
            VirtualHost(name=host.name, cert_file=host.cert_file, key_file=host.key_file, routes=routes,
                        fallback=False),))
        async with running((expose,)):
            for alpn in ("http/1.1", "h2"):
                async def seen(path: str, alpn: str = alpn, **kw: Any) -> tuple[Answer, dict[str, Any]]:
                    answer = await ask(expose.port, ca, "gw.example.test", alpn=alpn, path=path, **kw)
                    assert answer.status == 200 and answer.alpn == alpn, (path, answer)
                    return answer, json.loads(answer.body)

                _, plain = await seen("/app/x", headers=(("X-Env", "prod"),))
                assert plain["backend"] == "default" and plain["headers"]["x-env"] == "prod"
                assert "x-added" not in plain["headers"]
                answer, matched = await seen("/app/x", headers=(("x-env", "canary"), ("X-Drop", "gone")))
                assert matched["backend"] == "canary"
                assert matched["headers"]["x-env"] == "set-by-route" and matched["headers"]["x-added"] == "1"
                assert "x-drop" not in matched["headers"] and answer.headers.get("x-served-by") == "canary"
                _, posted = await seen("/app?v=2", method="POST")
                assert posted["backend"] == "canary" and "x-added" not in posted["headers"]
                _, got = await seen("/app?v=2")
                assert got["backend"] == "default", "the method is part of the match"
                # 3:1 over 80 requests: 60 expected on the left; the bounds are over 5 deviations out
                backends = [(await seen("/split/a"))[1]["backend"] for _ in range(80)]
                assert 40 <= backends.count("left") <= 75 and backends.count("right") >= 5, backends
                none = await ask(expose.port, ca, "gw.example.test", alpn=alpn, path="/none")
                assert none.status == 500 and b"every weight is 0" in none.body, none
                moved = await ask(expose.port, ca, "gw.example.test", alpn=alpn, path="/old/page?q=1")
                assert moved.status == 301, moved
                assert moved.headers["location"] == f"https://gw.example.test:{expose.port}/new/page?q=1"
                insecure = await ask(expose.port, ca, "gw.example.test", alpn=alpn, path="/insecure/x")
                assert insecure.status == 302 and insecure.headers["location"] == "http://gw.example.test/insecure/x"
                _, stripped = await seen("/strip/deep/er?k=v")
                assert stripped["backend"] == "left" and stripped["path"] == "/deep/er?k=v"
                assert stripped["headers"]["host"] == "inside.svc"
                assert stripped["headers"]["x-forwarded-host"] == "gw.example.test"


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
            after = ingress.services["web"].certs.status()[0]["notAfter"]
            assert before is not None and after is not None and after >= before
            install(a, renewed.cert.read_bytes(), b"not a key")
            third = await ask(expose.port, ca, "a.example.test")
            assert third.certificate == second.certificate, "a broken file keeps the certificate in force"
            error = ingress.services["web"].certs.status()[0]["error"]
            assert error is not None and "cannot load" in error


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


# -- identity headers -----------------------------------------------------------------------------

def tailnet(*peers: dict[str, Any]) -> nm.NetMap:
    def node(node_id: int, ip: str, **extra: Any) -> dict[str, Any]:
        return {"ID": node_id, "Name": f"n{node_id}.tailnet.test.", "Key": f"nodekey:{node_id:064x}",
                "Addresses": [f"{ip}/32"], **extra}
    netmap = nm.apply(None, {"Node": node(1, "100.64.0.1"), "Peers": [node(**p) for p in peers],
                             "UserProfiles": [{"ID": 7, "LoginName": "alice@example.com", "DisplayName": "Alice Ünal"},
                                              {"ID": 9, "LoginName": "tagged-devices"}]})
    assert netmap is not None
    return netmap


def test_identity_from_the_netmap_user_or_tags() -> None:
    netmap = tailnet({"node_id": 2, "ip": "100.64.0.2", "User": 7},
                     {"node_id": 3, "ip": "100.64.0.3", "User": 9, "Tags": ["tag:ci", "tag:build"]},
                     {"node_id": 4, "ip": "100.64.0.4", "User": 99})
    assert identify(netmap, "100.64.0.2") == Identity(node_name="n2.tailnet.test", login_name="alice@example.com",
                                                      display_name="Alice Ünal")
    assert identify(netmap, "100.64.0.3") == Identity(node_name="n3.tailnet.test", tags=("tag:ci", "tag:build"))
    assert identify(netmap, "100.64.0.4") == Identity(node_name="n4.tailnet.test"), "no profile: the node alone"
    assert identify(netmap, "100.64.0.5") is None and identify(None, "100.64.0.2") is None
    assert identity_headers(identify(netmap, "100.64.0.2")) == [
        ("Tailnet-Node-Name", "n2.tailnet.test"), ("Tailnet-User-Login", "alice@example.com"),
        ("Tailnet-User-Name", "=?utf-8?q?Alice_=C3=9Cnal?=")]
    assert identity_headers(identify(netmap, "100.64.0.3")) == [
        ("Tailnet-Node-Name", "n3.tailnet.test"), ("Tailnet-Node-Tags", "tag:ci,tag:build")]
    assert identity_headers(None) == []


def test_header_values_are_ascii_or_q_encoded() -> None:
    assert header_value("bob@example.com") == "bob@example.com"
    assert header_value("a\r\nX-Evil: 1") == "=?utf-8?q?a=0D=0AX-Evil=3A_1?="
    assert "\n" not in header_value("é\n")


def test_spoofed_identity_headers_are_dropped_and_ours_set() -> None:
    sent = [("Host", "shop"), ("Tailnet-User-Login", "root@evil"), ("tailnet-node-tags", "tag:admin"),
            ("TAILNET-Anything", "x"), ("Accept", "*/*")]
    me = Identity(node_name="laptop.tailnet.test", login_name="bob@example.com", display_name="Bob")
    assert request_headers(sent, client="100.64.0.9", authority="shop", identity=me) == [
        ("Host", "shop"), ("Accept", "*/*"), ("X-Forwarded-For", "100.64.0.9"), ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "shop"), ("Tailnet-Node-Name", "laptop.tailnet.test"),
        ("Tailnet-User-Login", "bob@example.com"), ("Tailnet-User-Name", "Bob")]
    assert [k for k, _ in request_headers(sent, client="1.2.3.4", authority="shop")] == [
        "Host", "Accept", "X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host"], "unknown caller: none"


def test_te_trailers_goes_only_to_an_http2_backend_and_trailers_are_cleaned() -> None:
    sent = [("content-type", "application/grpc"), ("te", "trailers")]
    assert ("te", "trailers") in request_headers(sent, client="c", authority="a", trailers=True)
    assert all(k != "te" for k, _ in request_headers(sent, client="c", authority="a"))
    assert all(k != "te" for k, _ in request_headers([("te", "gzip")], client="c", authority="a", trailers=True))
    assert trailer_headers([("Grpc-Status", "0"), (":status", "200"), ("connection", "x"), ("x-t", "1")]) == [
        ("grpc-status", "0"), ("x-t", "1")]


SPOOFED = (("Tailnet-User-Login", "root@evil"), ("Tailnet-Node-Tags", "tag:admin"),
           ("Tailnet_User_Login", "root@evil"), ("tailnet_node_name", "evil"), ("TAILNET_USER-NAME", "Evil"),
           ("Tailscale-User-Login", "root@evil"), ("Tailscale-User-Name", "Evil"),
           ("Tailscale_User_Profile_Pic", "https://evil.test/x.png"), ("tailscale-app-capabilities", "{}"),
           ("Tailscale-Headers-Info", "x"))
"""Names a backend may read as identity: the agent's own in any case or with ``_`` for ``-`` (CGI and
WSGI read ``Tailnet_User_Login`` as HTTP_TAILNET_USER_LOGIN, as they read ``Tailnet-User-Login``),
and those of ``tailscale serve``."""
KEPT = (("X-Tailnet-User-Login", "1"), ("Tailnetwork", "2"), ("Tailscale", "3"), ("TailnetUserLogin", "4"))
"""Names outside the identity namespace: passed on."""


def identity_named(name: str) -> bool:
    return name.lower().replace("_", "-").startswith(("tailnet-", "tailscale-"))


@pytest.mark.parametrize("name", [k for k, _ in SPOOFED])
def test_every_header_in_the_identity_namespace_is_dropped(name: str) -> None:
    me = Identity(node_name="laptop.tailnet.test", login_name="bob@example.com", display_name="Bob")
    out = request_headers([("Host", "shop"), (name, "spoofed"), *KEPT], client="100.64.0.9", authority="shop",
                          identity=me)
    assert [(k, v) for k, v in out if identity_named(k)] == [
        ("Tailnet-Node-Name", "laptop.tailnet.test"), ("Tailnet-User-Login", "bob@example.com"),
        ("Tailnet-User-Name", "Bob")]
    assert [h for h in out if h in KEPT] == list(KEPT)
    assert all(identity_named(k) is False for k, _ in request_headers([(name, "spoofed")], client="c", authority="a"))


async def test_spoofed_identity_in_any_spelling_never_reaches_the_backend(ca: CertificateAuthority) -> None:
    """Through the agent, HTTP/1.1 and HTTP/2 clients to an HTTP/1.1 and an h2c backend: the backend
    receives exactly the agent's identity headers, once each, whatever the client put in the
    identity namespace (headers, and HTTP/2 request trailers); other headers pass."""
    netmap = tailnet({"node_id": 2, "ip": "127.0.0.1", "User": 7})
    a = vhost(ca, "a.example.test")
    ours = [("tailnet-node-name", "n2.tailnet.test"), ("tailnet-user-login", "alice@example.com"),
            ("tailnet-user-name", "=?utf-8?q?Alice_=C3=9Cnal?=")]
    kept_names = {k.lower() for k, _ in KEPT}
    h2c = await GrpcEcho.start()
    try:
        async with backend() as port:
            http1 = Expose(name="http1", port=free_port(), mode="http", hosts=(a,),
                           backend=Backend(host="127.0.0.1", port=port))
            h2 = Expose(name="h2", port=free_port(), mode="http", hosts=(a,),
                        backend=Backend(host="127.0.0.1", port=h2c.port, protocol="h2"))
            async with running((http1, h2), netmap):
                identity: dict[tuple[str, str], list[tuple[str, str]]] = {}
                other: dict[tuple[str, str], list[tuple[str, str]]] = {}
                trailers_seen: dict[str, str] = {}
                for alpn in ("http/1.1", "h2"):
                    answer = await ask(http1.port, ca, "a.example.test", alpn=alpn, headers=(*SPOOFED, *KEPT))
                    assert answer.status == 200, answer
                    received = [(k.lower(), v) for k, v in json.loads(answer.body)["headerList"]]
                    identity[alpn, "http1"] = [h for h in received if identity_named(h[0])]
                    other[alpn, "http1"] = [h for h in received if h[0] in kept_names]

                    trailers = (("tailnet-user-login", "root@evil"), ("tailscale_user_login", "root@evil"),
                                ("x-checksum", "abc")) if alpn == "h2" else ()
                    answer = await ask(h2.port, ca, "a.example.test", alpn=alpn, method="POST", path="/echo.Echo/Say",
                                       body=grpc_frame(b"hi"), headers=(*GRPC_HEADERS, *SPOOFED, *KEPT),
                                       trailers=trailers)
                    assert answer.status == 200, answer
                    seen = said(answer)
                    identity[alpn, "h2"] = sorted((k, v) for k, v in seen["headers"].items() if identity_named(k))
                    other[alpn, "h2"] = [(k, v) for k, v in seen["headers"].items() if k in kept_names]
                    if alpn == "h2":
                        trailers_seen = seen["trailers"]
                combinations = [(alpn, proto) for alpn in ("http/1.1", "h2") for proto in ("http1", "h2")]
                assert identity == {c: ours if c[1] == "http1" else sorted(ours) for c in combinations}
                assert other == {c: [(k.lower(), v) for k, v in KEPT] for c in combinations}
                assert trailers_seen == {"x-checksum": "abc"}, "identity names are dropped from request trailers too"
    finally:
        h2c.close()


async def test_identity_headers_reach_the_backend_and_spoofed_ones_do_not(ca: CertificateAuthority) -> None:
    netmap = tailnet({"node_id": 2, "ip": "127.0.0.1", "User": 7})
    a = vhost(ca, "a.example.test")
    async with backend() as port:
        expose = Expose(name="web", port=free_port(), mode="http", backend=Backend(host="127.0.0.1", port=port),
                        hosts=(a,))
        async with running((expose,), netmap):
            for alpn in ("http/1.1", "h2"):
                answer = await ask(expose.port, ca, "a.example.test", alpn=alpn, headers=(
                    ("Tailnet-User-Login", "root@evil"), ("Tailnet-Node-Tags", "tag:admin")))
                seen = json.loads(answer.body)["headers"]
                assert seen["tailnet-user-login"] == "alice@example.com", alpn
                assert seen["tailnet-user-name"] == "=?utf-8?q?Alice_=C3=9Cnal?="
                assert seen["tailnet-node-name"] == "n2.tailnet.test"
                assert "tailnet-node-tags" not in seen


# -- HTTP/2 backends and trailers -----------------------------------------------------------------

GRPC_HEADERS = (("content-type", "application/grpc"), ("te", "trailers"))


async def grpc_call(port: int, ca: CertificateAuthority, sni: str, message: bytes, **kw: Any) -> Answer:
    return await ask(port, ca, sni, alpn="h2", method="POST", path="/echo.Echo/Say", body=grpc_frame(message),
                     headers=GRPC_HEADERS, **kw)


def said(answer: Answer) -> dict[str, Any]:
    [message] = grpc_messages(answer.body)
    seen: dict[str, Any] = json.loads(message)
    return seen


async def test_grpc_over_h2c_and_h2_over_tls_keeps_trailers_both_ways(ca: CertificateAuthority,
                                                                       tmp_path: Path) -> None:
    a = vhost(ca, "a.example.test")
    app_pair = ca.issue("grpc-app", common_name="grpc.internal", hosts=("grpc.internal",))
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(app_pair.cert, app_pair.key)
    other = CertificateAuthority(tmp_path / "other", "other")
    h2c, h2s = await GrpcEcho.start(), await GrpcEcho.start(tls)
    try:
        plain = Expose(name="plain", port=free_port(), mode="http", hosts=(a,),
                       backend=Backend(host="127.0.0.1", port=h2c.port, protocol="h2"))
        secure = Expose(name="secure", port=free_port(), mode="http", hosts=(a,), backend=Backend(
            host="127.0.0.1", port=h2s.port, scheme="https", ca_file=str(ca.cert_path), server_name="grpc.internal",
            protocol="h2"))
        wrong_ca = Expose(name="wrong", port=free_port(), mode="http", hosts=(a,), backend=Backend(
            host="127.0.0.1", port=h2s.port, scheme="https", ca_file=str(other.cert_path),
            server_name="grpc.internal", protocol="h2"))
        async with running((plain, secure, wrong_ca)):
            for expose, scheme in ((plain, "http"), (secure, "https")):
                answer = await grpc_call(expose.port, ca, "a.example.test", b"hello",
                                         trailers=(("x-checksum", "abc"),))
                assert (answer.status, answer.headers["content-type"]) == (200, "application/grpc"), answer
                assert answer.trailers == {"grpc-status": "0", "grpc-message": "echoed"}, answer
                seen = said(answer)
                assert seen["message"] == "hello" and seen["path"] == "/echo.Echo/Say"
                assert seen["trailers"] == {"x-checksum": "abc"}, "the request's trailers reached the backend"
                assert seen["headers"]["te"] == "trailers" and seen["headers"][":scheme"] == scheme
                assert seen["headers"][":authority"] == "a.example.test" and "host" not in seen["headers"]
                failing = await ask(expose.port, ca, "a.example.test", alpn="h2", method="POST", path="/x",
                                    body=grpc_frame(b"x"), headers=(*GRPC_HEADERS, ("x-want-status", "13")))
                assert failing.trailers["grpc-status"] == "13" and not failing.headers_only
                only = await ask(expose.port, ca, "a.example.test", alpn="h2", method="POST", path="/x",
                                 body=grpc_frame(b"x"), headers=(*GRPC_HEADERS, ("x-want-status", "5"),
                                                                 ("x-trailers-only", "1")))
                assert only.headers_only and only.headers["grpc-status"] == "5" and only.body == b"", only
                h1 = await ask(expose.port, ca, "a.example.test", alpn="http/1.1", method="POST", path="/y",
                               body=grpc_frame(b"over http/1.1"), headers=GRPC_HEADERS)
                assert h1.status == 200 and said(h1)["message"] == "over http/1.1", "trailers dropped, body kept"
            big = "y" * 300000  # the answer is larger than HTTP/2's default 64 KiB window
            answer = await grpc_call(plain.port, ca, "a.example.test", big.encode())
            assert said(answer)["message"] == big and answer.trailers["grpc-status"] == "0"
            many = await asyncio.gather(*(grpc_call(plain.port, ca, "a.example.test", b"m%d" % i) for i in range(20)))
            assert sorted(said(m)["message"] for m in many) == sorted(f"m{i}" for i in range(20))
            assert h2c.connections == 1, "the streams share one backend connection"
            bad = await grpc_call(wrong_ca.port, ca, "a.example.test", b"x")
            assert bad.status == 502 and b"certificate verify failed" in bad.body, bad
    finally:
        h2c.close()
        h2s.close()


async def test_an_h2_backend_that_does_not_speak_h2_is_a_bad_gateway(ca: CertificateAuthority) -> None:
    a = vhost(ca, "a.example.test")
    app_pair = ca.issue("app", common_name="app.internal", hosts=("app.internal",))
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(app_pair.cert, app_pair.key)
    async with backend(tls) as port:  # aiohttp: HTTP/1.1 only, no ALPN h2
        expose = Expose(name="web", port=free_port(), mode="http", hosts=(a,), backend=Backend(
            host="127.0.0.1", port=port, scheme="https", ca_file=str(ca.cert_path), server_name="app.internal",
            protocol="h2"))
        async with running((expose,)):
            answer = await ask(expose.port, ca, "a.example.test", alpn="h2")
            assert answer.status == 502 and b"did not negotiate HTTP/2" in answer.body, answer
    async with backend() as port:
        expose = Expose(name="web", port=free_port(), mode="http", hosts=(a,),
                        backend=Backend(host="127.0.0.1", port=port, protocol="h2"))
        async with running((expose,)):
            answer = await ask(expose.port, ca, "a.example.test", alpn="h2")
            assert answer.status == 502, answer


# -- several http exposes on one port -------------------------------------------------------------

async def keep_alive_get(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], host: str) -> dict[str, Any]:
    reader, writer = stream
    writer.write(f"GET /again HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    length = int(head.split("content-length:")[1].split("\r\n")[0])
    seen: dict[str, Any] = json.loads(await reader.readexactly(length))
    return seen


async def test_http_exposes_sharing_a_port_are_chosen_by_sni(ca: CertificateAuthority) -> None:
    a, b = vhost(ca, "a.example.test", "a"), vhost(ca, "b.example.test")
    async with backend() as port_a, backend() as port_b:
        listen = free_port()
        first = Expose(name="first", port=listen, mode="http", hosts=(a,),
                       backend=Backend(host="127.0.0.1", port=port_a))
        second = Expose(name="second", port=listen, mode="http", hosts=(b,),
                        backend=Backend(host="127.0.0.1", port=port_b, protocol="http1"))
        async with running((first, second)) as ingress:
            assert ingress.forwarder.is_listening("first") and ingress.forwarder.is_listening("second")
            for sni, names in (("a", ["a.example.test", "a"]), ("b.example.test", ["b.example.test"])):
                for alpn in ("http/1.1", "h2"):
                    answer = await ask(listen, ca, sni, alpn=alpn, path=f"/{sni}")
                    assert answer.status == 200 and subject_names(answer.certificate) == names, answer
                    assert json.loads(answer.body)["path"] == f"/{sni}"
            wrong = await ask(listen, ca, "a.example.test", alpn="h2", host="b.example.test")
            assert wrong.status == 421, "a connection stays with the expose its SNI chose"
            unnamed = ssl.create_default_context(cafile=str(ca.cert_path))
            unnamed.check_hostname = False
            no_sni = await asyncio.open_connection("127.0.0.1", listen, ssl=unnamed, server_hostname="")
            assert subject_names(no_sni[1].get_extra_info("ssl_object").getpeercert(binary_form=True)) == [
                "a.example.test", "a"], "no SNI: the first host of the first expose on the port"
            assert (await keep_alive_get(no_sni, "a"))["path"] == "/again"
            no_sni[1].close()

            tls = ssl.create_default_context(cafile=str(ca.cert_path))
            kept = await asyncio.open_connection("127.0.0.1", listen, ssl=tls, server_hostname="a.example.test")
            assert (await keep_alive_get(kept, "a.example.test"))["path"] == "/again"
            held_b = await asyncio.open_connection("127.0.0.1", listen, ssl=tls, server_hostname="b.example.test")
            assert (await keep_alive_get(held_b, "b.example.test"))["path"] == "/again"

            await ingress.forwarder.apply((first,))  # second leaves the shared port
            assert ingress.forwarder.is_listening("first") and set(ingress.services) == {"first"}
            assert (await keep_alive_get(kept, "a.example.test"))["path"] == "/again", "its sibling's connection stays"
            assert await asyncio.wait_for(held_b[0].read(), 10) == b"", "the removed expose's connection ended"
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await ask(listen, ca, "b.example.test")
            assert (await ask(listen, ca, "a.example.test")).status == 200

            await ingress.forwarder.apply((second,))  # the last lease goes and the port is bound again
            assert (await ask(listen, ca, "b.example.test")).status == 200
            assert await asyncio.wait_for(kept[0].read(), 10) == b""
            kept[1].close()
            held_b[1].close()


async def test_plaintext_exposes_share_a_port_and_each_request_picks_its_host_by_host() -> None:
    """Two plaintext exposes on one port: Host (name or alias, any case, with a port) picks the
    host of either, ``*`` takes every other name, and what the backend is told says http."""
    async with named_backend("shop", headers=True) as shop, named_backend("any", headers=True) as anything, \
            named_backend("docs", headers=True) as docs:
        port = free_port()

        def to(p: int) -> Backend:
            return Backend(host="127.0.0.1", port=p)

        first = Expose(name="first", port=port, mode="http", plaintext=True, backend=to(shop), hosts=(
            VirtualHost(name="shop.example.test", alias="shop", routes=(
                Route(path="/docs", backend=to(docs)),
                Route(path="/old", redirect=Redirect(path=PathChange(type="ReplaceFullPath", value="/new"))))),))
        second = Expose(name="second", port=port, mode="http", plaintext=True, backend=to(anything),
                        hosts=(VirtualHost(name="*"),))
        async with running((first, second)), aiohttp.ClientSession() as session:
            async def get(host: str, path: str = "/") -> tuple[int, dict[str, Any] | str, Any]:
                async with session.get(f"http://127.0.0.1:{port}{path}", headers={"Host": host},
                                       allow_redirects=False) as answer:
                    text = await answer.text()
                    body = json.loads(text) if answer.content_type == "application/json" else text
                    return answer.status, body, answer.headers

            for host in ("shop.example.test", "SHOP.example.test:80", "shop"):
                status, body, _ = await get(host, "/x")
                assert status == 200 and isinstance(body, dict) and body["backend"] == "shop", (host, body)
                assert body["headers"]["x-forwarded-proto"] == "http"
                assert body["headers"]["x-forwarded-host"] == host
            status, body, _ = await get("shop", "/docs/a")
            assert isinstance(body, dict) and body["backend"] == "docs"
            status, _, headers = await get("shop.example.test", "/old?q=1")
            assert status == 302 and headers["Location"] == f"http://shop.example.test:{port}/new?q=1"
            status, body, _ = await get("other.example.test")
            assert status == 200 and isinstance(body, dict) and body["backend"] == "any"


async def test_a_plaintext_port_without_a_host_for_the_name_answers_404() -> None:
    async with named_backend("shop") as shop:
        port = free_port()
        expose = Expose(name="only", port=port, mode="http", plaintext=True,
                        backend=Backend(host="127.0.0.1", port=shop), hosts=(VirtualHost(name="shop.example.test"),))
        async with running((expose,)), aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/", headers={"Host": "else.example.test"}) as answer:
            assert answer.status == 404 and "no host else.example.test" in await answer.text()


class Trickle:
    """A stream writer that sends the first ``first`` bytes one at a time, a little apart (a client
    whose preface, or request line, arrives in pieces), then the rest as written, in order."""

    def __init__(self, writer: asyncio.StreamWriter, first: int) -> None:
        self.writer, self.left = writer, first
        self._sent: asyncio.Task[None] | None = None

    def write(self, data: bytes) -> None:
        head, rest = data[:self.left], data[self.left:]
        self.left -= len(head)
        self._sent = asyncio.get_running_loop().create_task(self._send(self._sent, head, rest))

    async def _send(self, before: asyncio.Task[None] | None, head: bytes, rest: bytes) -> None:
        if before is not None:
            await before
        for i in range(len(head)):
            if i:
                await asyncio.sleep(0.01)  # a gap between TCP segments, not a wait for a state
            self.writer.write(head[i:i + 1])
            await self.writer.drain()
        self.writer.write(rest)

    def close(self) -> None:
        self.writer.close()


async def test_a_plaintext_port_tells_http2_prior_knowledge_from_http1_by_the_first_bytes() -> None:
    """A connection that opens with the HTTP/2 preface is served HTTP/2, even when the preface
    arrives a byte at a time; one that does not (``POST`` begins like ``PRI``) is HTTP/1.1. Each
    HTTP/2 stream picks its host by ``:authority`` among the port's plaintext exposes."""
    async with named_backend("shop", headers=True) as shop, named_backend("docs", headers=True) as docs:
        port = free_port()
        first = Expose(name="first", port=port, mode="http", plaintext=True,
                       backend=Backend(host="127.0.0.1", port=shop), hosts=(VirtualHost(name="shop.example.test"),))
        second = Expose(name="second", port=port, mode="http", plaintext=True,
                        backend=Backend(host="127.0.0.1", port=docs), hosts=(VirtualHost(name="docs.example.test"),))
        async with running((first, second)):
            for host, name in (("shop.example.test", "shop"), ("DOCS.example.test:80", "docs")):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                answer = await asyncio.wait_for(h2c_request(
                    (reader, cast(asyncio.StreamWriter, Trickle(writer, len(HTTP2_PREFACE)))), host=host,
                    path="/h2"), 10)
                seen = json.loads(answer.body)
                assert (answer.status, seen["backend"], seen["path"]) == (200, name, "/h2"), answer
                assert seen["headers"]["x-forwarded-proto"] == "http" and seen["headers"]["x-forwarded-host"] == host
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            trickle = Trickle(writer, 3)
            trickle.write(b"POST /h1 HTTP/1.1\r\nHost: shop.example.test\r\nContent-Length: 2\r\n"
                          b"Connection: close\r\n\r\nhi")
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), data
            assert json.loads(body)["path"] == "/h1"


async def test_a_plaintext_connection_that_ends_before_or_as_its_first_bytes_arrive_leaves_nothing_behind() -> None:
    """Clients that close without a byte, or reset right after the first bytes of either HTTP
    version: no connection of the port is left waiting, and the next client is served."""
    async with named_backend("shop") as shop:
        port = free_port()
        expose = Expose(name="only", port=port, mode="http", plaintext=True,
                        backend=Backend(host="127.0.0.1", port=shop), hosts=(VirtualHost(name="*"),))
        async with running((expose,)) as ingress:
            shared = ingress.ports[port]
            assert isinstance(shared, PlainHttpPort)
            for first in (b"", b"GET / HTTP/1.1\r\n", HTTP2_PREFACE) * 10:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
                writer.write(first)
                writer.close()
            await eventually(lambda: not shared._tasks and not shared._serving,
                             what="every connection of the port ended")
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/x") as answer:
                assert answer.status == 200
