"""The agent's ingress mode against a real Headscale v0.29.2 and a tailscaled v1.98 "laptop":
tcp and http exposes, certificates by SNI and their rotation, gRPC-style HTTP/2 to h2c and h2
backends with trailers, http exposes sharing a port, the caller's identity headers, HTTP/2 with
prior knowledge (h2c) on a plaintext port beside HTTP/1.1, and tls exposes sharing a port, passed
through to the backend chosen by SNI.

The laptop reaches the agent's tailnet address through its HTTP proxy (CONNECT); the backends
are servers on 127.0.0.1 (in a cluster: the exposes' Services). The agent is assembled as
``tailnet_agent.__main__`` does for ingress (node, exposes followed from their file, health server
with ``/status``), with short intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509

from e2e.backends import served
from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from e2e.test_agent_egress import TAG, read_all, wait_peer_sees
from e2e.test_agent_targets import fetch_status, running, write_like_kubelet
from hack.grpc_echo import GrpcEcho, grpc_frame, grpc_messages
from hack.https_client import Answer, h2c_request, http1_request, request, tunnel
from hack.localenv import Headscale, TailscaleNode, free_port
from hack.localenv._pki import CertificateAuthority
from tailnet_agent.contract.backoff import Backoff, derp_backoff
from tailnet_agent.contract.clock import RealClock
from tailnet_agent.contract.exposes import Expose, parse_exposes
from tailnet_agent.control import ControlOptions
from tailnet_agent.forward.ingress import Ingress, LocalDialer
from tailnet_agent.health import AgentMetrics, HealthServer
from tailnet_agent.node import Node, NodeOptions
from tailnet_agent.probe import Prober
from tailnet_agent.status import ingress_status
from tailnet_agent.targets import TargetsWatcher

pytestmark = pytest.mark.integration


@dataclass
class IngressAgent:
    node: Node
    ingress: Ingress
    watcher: TargetsWatcher[Expose]
    health: HealthServer

    @property
    def ip(self) -> str:
        return self.node.addresses()[0]

    async def status(self) -> dict[str, Any]:
        return await fetch_status(self.health)


@contextlib.asynccontextmanager
async def ingress_agent(headscale: Headscale, hostname: str, key: str, directory: Path, exposes: list[dict[str, Any]],
                        ) -> AsyncIterator[IngressAgent]:
    clock = RealClock()
    path = write_like_kubelet(directory, json.dumps(exposes))
    control = ControlOptions(url=headscale.url, auth_key=key, hostname=hostname, ca_bundle=headscale.ca_bundle,
                             backoff=Backoff(initial=0.2, maximum=2.0))
    node = Node(NodeOptions(control=control, derp_backoff=derp_backoff(initial=0.1, maximum=1.0), dial_timeout=15.0,
                            udp_port=None, accept_routes=False), clock=clock)
    metrics = AgentMetrics(node)
    ingress = Ingress(node, parse_exposes(path.read_text()), dial_timeout=15.0, metrics=metrics,
                      prober=Prober(LocalDialer(), clock, metrics=metrics, interval=1.0, timeout=5.0))
    watcher = TargetsWatcher(path, ingress.forwarder.apply, clock=clock, interval=0.2, parse=parse_exposes,
                             initial_digest=hashlib.sha256(path.read_bytes()).hexdigest(), what="exposes",
                             report=metrics.targets_reload_outcome)
    health = HealthServer(node, metrics, host="127.0.0.1", port=0,
                          status=lambda: ingress_status(node, ingress, watcher))

    tasks = {"node": node.run(), "ingress": ingress.forwarder.run(), "exposes": watcher.run(), "health": health.run()}
    async with running(tasks, lambda: node.ready and ingress.forwarder.listening.is_set() and health.started.is_set(),
                       f"agent-{hostname}"):
        yield IngressAgent(node, ingress, watcher, health)


async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers one HTTP/1.0 request with ``hello``."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\nhello\n")
        await writer.drain()
    writer.close()


def tcp(name: str, port: int, backend: int) -> dict[str, Any]:
    return {"name": name, "port": port, "backend": {"host": "127.0.0.1", "port": backend}}


async def test_tcp_expose_16_mib_each_way_kept_across_a_reload(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    size = 16 << 20
    download, upload = os.urandom(size), os.urandom(size)

    async def bulk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Sends 16 MiB while it reads 16 MiB, then the SHA-256 of what it read. (tailscaled's proxy
        ends a tunnel at the first EOF, so half-close is tested on loopback, unit_tests/agent.)"""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # probes connect and leave
            await reader.readexactly(4)  # "go\r\n": the client is ready
            receiving = asyncio.create_task(reader.readexactly(size))
            for i in range(0, size, 1 << 20):
                writer.write(download[i:i + (1 << 20)])
                await writer.drain()
            writer.write(hashlib.sha256(await receiving).digest())
            await writer.drain()
        writer.close()

    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-tcp", headscale, authkey=key)
    bulk_server = await asyncio.start_server(bulk, "127.0.0.1", 0)
    web_server = await asyncio.start_server(hello, "127.0.0.1", 0)
    bulk_port, web_port = (s.sockets[0].getsockname()[1] for s in (bulk_server, web_server))
    listen = {"bulk": free_port(), "web": free_port()}
    try:
        async with ingress_agent(headscale, "ingress-tcp", key, tmp_path,
                                 [tcp("bulk", listen["bulk"], bulk_port)]) as agent:
            await wait_peer_sees(laptop, "ingress-tcp")
            reader, writer = await tunnel(laptop.http_proxy_port, agent.ip, listen["bulk"])
            writer.write(b"go\r\n")

            # A reload that adds an expose while the bulk connection is open.
            write_like_kubelet(tmp_path, json.dumps([tcp("bulk", listen["bulk"], bulk_port),
                                                     tcp("web", listen["web"], web_port)]))
            await eventually(lambda: agent.ingress.forwarder.is_listening("web"), timeout=10, what="web exposed")
            r2, w2 = await tunnel(laptop.http_proxy_port, agent.ip, listen["web"])
            w2.write(b"GET / HTTP/1.0\r\nHost: web\r\n\r\n")
            assert (await asyncio.wait_for(read_all(r2), 30)).endswith(b"\r\n\r\nhello\n")
            w2.close()

            async def send() -> None:
                for i in range(0, size, 1 << 20):
                    writer.write(upload[i:i + (1 << 20)])
                    await writer.drain()

            sending = asyncio.create_task(send())
            received = await asyncio.wait_for(reader.readexactly(size + 32), 240)
            await sending
            writer.close()
            assert hashlib.sha256(received[:size]).digest() == hashlib.sha256(download).digest()
            assert received[size:] == hashlib.sha256(upload).digest(), "the upload arrived intact"

            document = await eventually(_probed(agent, "web"), timeout=20, what="a probe of web's backend")
            entry = next(e for e in document["exposes"] if e["name"] == "web")
            assert entry == {**entry, "port": listen["web"], "mode": "tcp", "listening": True, "message": None,
                             "backend": f"127.0.0.1:{web_port}", "reachable": True, "backendError": None,
                             "hosts": []}
            assert document["node"]["addresses"] == agent.node.addresses()
            assert document["exposesFile"]["error"] is None
    finally:
        bulk_server.close()
        web_server.close()


def _probed(agent: IngressAgent, name: str) -> Any:
    async def check() -> dict[str, Any] | None:
        document = await agent.status()
        entry = next((e for e in document["exposes"] if e["name"] == name), None)
        return document if entry and entry["checkedAt"] else None
    return check


async def whoami(request: web.Request) -> web.Response:
    return web.json_response({"host": request.headers.get("Host"), "xff": request.headers.get("X-Forwarded-For"),
                              "proto": request.headers.get("X-Forwarded-Proto")})


async def whoami_backend() -> tuple[web.AppRunner, int]:
    """A backend on 127.0.0.1 that answers every GET with what it was told (:func:`whoami`); the
    caller cleans the runner up."""
    app = web.Application()
    app.router.add_get("/{tail:.*}", whoami)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def dns_names(answer: Answer) -> list[str]:
    cert = x509.load_der_x509_certificate(answer.certificate)
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)


def replace_atomically(path: Path, data: bytes) -> None:
    """A new file renamed over the old one, as a projected Secret changes at once."""
    (path.parent / f".{path.name}.new").write_bytes(data)
    (path.parent / f".{path.name}.new").rename(path)


async def ask(laptop: TailscaleNode, agent: IngressAgent, port: int, ca: Path, sni: str, **kw: Any) -> Answer:
    return await asyncio.wait_for(request(await tunnel(laptop.http_proxy_port, agent.ip, port), ca=ca, sni=sni,
                                          **kw), 30)


async def test_http_expose_sni_certificates_h1_h2_421_and_rotation(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki", "ingress")
    shop = ca.issue("shop", common_name="shop.example.test", hosts=("shop.example.test", "shop"))
    blog = ca.issue("blog", common_name="blog.example.test", hosts=("blog.example.test",))
    wild = ca.issue("wild", common_name="*.shop.example.test", hosts=("*.shop.example.test",))
    anyhost = ca.issue("any", common_name="any.example.test", hosts=("any.example.test",))
    runner, backend_port = await whoami_backend()
    port = free_port()
    expose = {"name": "web", "port": port, "mode": "http", "backend": {"host": "127.0.0.1", "port": backend_port},
              "hosts": [{"name": "shop.example.test", "alias": "shop",
                         "tls": {"certFile": str(shop.cert), "keyFile": str(shop.key)}},
                        {"name": "blog.example.test", "tls": {"certFile": str(blog.cert), "keyFile": str(blog.key)}},
                        {"name": "*.shop.example.test", "tls": {"certFile": str(wild.cert), "keyFile": str(wild.key)}},
                        {"name": "*", "fallback": False,
                         "tls": {"certFile": str(anyhost.cert), "keyFile": str(anyhost.key)}}]}
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-https", headscale, authkey=key)
    try:
        async with ingress_agent(headscale, "ingress-https", key, tmp_path, [expose]) as agent:
            await wait_peer_sees(laptop, "ingress-https")
            laptop_ip = laptop.ipv4()
            for sni, names in (("shop.example.test", ["shop.example.test", "shop"]), ("shop", ["shop.example.test",
                                                                                             "shop"]),
                               ("blog.example.test", ["blog.example.test"])):
                for alpn in ("http/1.1", "h2"):
                    answer = await ask(laptop, agent, port, ca.cert_path, sni, alpn=alpn)
                    assert (answer.status, answer.alpn) == (200, alpn), answer
                    assert dns_names(answer) == names
                    assert json.loads(answer.body) == {"host": sni, "xff": laptop_ip, "proto": "https"}
                    other = "blog.example.test" if sni != "blog.example.test" else "shop.example.test"
                    wrong = await ask(laptop, agent, port, ca.cert_path, sni, alpn=alpn, host=other)
                    assert wrong.status == 421, wrong
            # A name no exact host answers: the longest *. host that covers it, then *.
            for sni, names, code in (("a.shop.example.test", ["*.shop.example.test"], 200),
                                       ("a.b.shop.example.test", ["*.shop.example.test"], 200),
                                       ("elsewhere.test", ["any.example.test"], 404)):
                for alpn in ("http/1.1", "h2"):
                    answer = await ask(laptop, agent, port, ca.cert_path, sni, check_name=False, alpn=alpn)
                    assert (answer.status, dns_names(answer)) == (code, names), (sni, alpn, answer)
            outside = await ask(laptop, agent, port, ca.cert_path, "a.shop.example.test", check_name=False,
                                host="blog.example.test")
            assert outside.status == 421, outside

            document = await agent.status()
            entry = document["exposes"][0]
            assert (entry["listening"], entry["mode"]) == (True, "http")
            hosts = {h["name"]: h for h in entry["hosts"]}
            assert hosts["shop.example.test"]["alias"] == "shop" and hosts["shop.example.test"]["error"] is None
            before = await ask(laptop, agent, port, ca.cert_path, "shop.example.test")
            assert hosts["shop.example.test"]["notAfter"] == _not_after(before)

            renewed = ca.issue("shop-renewed", common_name="shop.example.test",
                               hosts=("shop.example.test", "shop", "renewed.example.test"))
            replace_atomically(shop.key, renewed.key.read_bytes())
            replace_atomically(shop.cert, renewed.cert.read_bytes())
            after = await ask(laptop, agent, port, ca.cert_path, "shop.example.test", alpn="h2")
            assert after.status == 200 and dns_names(after) == ["shop.example.test", "shop", "renewed.example.test"]
            status = await agent.status()
            assert status["exposes"][0]["hosts"][0]["notAfter"] == _not_after(after)
    finally:
        await runner.cleanup()


def _not_after(answer: Answer) -> str:
    when = x509.load_der_x509_certificate(answer.certificate).not_valid_after_utc
    return when.isoformat().replace("+00:00", "Z")


BACKEND_NAME = web.AppKey("backend_name", str)


async def identity_echo(request: web.Request) -> web.Response:
    """What the backend was told: its name (which expose's backend this is), path and headers."""
    return web.json_response({"backend": request.app[BACKEND_NAME], "path": request.path,
                              "headers": {k.lower(): v for k, v in request.headers.items()}})


@contextlib.asynccontextmanager
async def named_backend(name: str, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    app = web.Application()
    app[BACKEND_NAME] = name
    app.router.add_route("*", "/{tail:.*}", identity_echo)
    async with served(app, tls=tls) as port:
        yield port


SPOOFED = (("Tailnet-User-Login", "root@evil.test"), ("Tailnet-Node-Tags", "tag:admin"),
           ("Tailnet_User_Login", "root@evil.test"), ("tailnet_node_tags", "tag:admin"),
           ("Tailscale-User-Login", "root@evil.test"), ("Tailscale_User_Name", "Evil"))
"""What a client claims: the agent's own names, and the same with ``_`` (which CGI and WSGI read as
the same variable) or in ``tailscale serve``'s namespace."""


def identity_names(headers: dict[str, Any]) -> set[str]:
    """The headers a backend could read as identity: lower-cased, ``_`` read as ``-``, ``tailnet-*``
    or ``tailscale-*``."""
    return {k for k in headers if k.lower().replace("_", "-").startswith(("tailnet-", "tailscale-"))}


def echoed_grpc_call(answer: Answer, message: str, checksum: str, scheme: str) -> dict[str, Any]:
    """Check that the gRPC echo answered ``/echo.Echo/Say`` to ``grpc.example.test`` with
    ``message`` and the request trailer ``x-request-checksum: checksum`` intact; the request
    headers it saw."""
    assert answer.status == 200 and answer.headers["content-type"] == "application/grpc", answer
    assert answer.trailers == {"grpc-status": "0", "grpc-message": "echoed"}, answer
    [echoed] = grpc_messages(answer.body)
    seen = json.loads(echoed)
    assert seen["message"] == message and seen["path"] == "/echo.Echo/Say"
    assert seen["trailers"] == {"x-request-checksum": checksum}
    headers: dict[str, Any] = seen["headers"]
    assert (headers[":scheme"], headers[":authority"], headers["te"]) == (scheme, "grpc.example.test", "trailers")
    return headers


def http_expose(name: str, port: int, backend: dict[str, Any], *hosts: tuple[str, Any]) -> dict[str, Any]:
    return {"name": name, "port": port, "mode": "http", "backend": {"host": "127.0.0.1", **backend},
            "hosts": [{"name": host, "tls": {"certFile": str(pair.cert), "keyFile": str(pair.key)}}
                      for host, pair in hosts]}


async def test_grpc_over_h2_with_trailers_sni_across_exposes_and_identity_headers(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """A user's laptop calls, through the agent: a gRPC-style method on an h2c backend and on an h2
    backend over verified TLS (trailers both ways); two http exposes on one port, each chosen by
    SNI; the backends see who calls (Tailnet-* headers from the netmap: the user, or a tagged
    caller's tags), never what the client claimed."""
    ca = CertificateAuthority(tmp_path / "pki", "ingress")
    pairs = {name: ca.issue(name.split(".")[0], common_name=name, hosts=(name,))
             for name in ("grpc.example.test", "shop.example.test", "blog.example.test")}
    app_pair = ca.issue("grpc-app", common_name="grpc.internal", hosts=("grpc.internal",))
    app_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    app_tls.load_cert_chain(app_pair.cert, app_pair.key)
    h2c, h2s = await GrpcEcho.start(), await GrpcEcho.start(app_tls)

    user = headscale.api("POST", "/api/v1/user", {"name": "alice", "displayName": "Alice Ünal",
                                                  "email": "alice@example.test"})["user"]
    laptop = tailscale_nodes("ts-laptop-grpc", headscale,
                             authkey=headscale.create_preauth_key(user_id=str(user["id"]), ephemeral=True))
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    ports = {"grpc": free_port(), "grpcs": free_port(), "web": free_port()}
    grpc_host = ("grpc.example.test", pairs["grpc.example.test"])
    try:
        async with named_backend("shop") as shop_port, named_backend("blog") as blog_port:
            exposes = [
                http_expose("grpc", ports["grpc"], {"port": h2c.port, "protocol": "h2"}, grpc_host),
                http_expose("grpcs", ports["grpcs"], {"port": h2s.port, "protocol": "h2", "scheme": "https",
                                                      "caFile": str(ca.cert_path), "serverName": "grpc.internal"},
                            grpc_host),
                http_expose("shop", ports["web"], {"port": shop_port}, ("shop.example.test",
                                                                        pairs["shop.example.test"])),
                http_expose("blog", ports["web"], {"port": blog_port}, ("blog.example.test",
                                                                        pairs["blog.example.test"]))]
            async with ingress_agent(headscale, "ingress-grpc", key, tmp_path, exposes) as agent:
                await wait_peer_sees(laptop, "ingress-grpc")
                laptop_name = str(laptop.status()["Self"]["DNSName"]).rstrip(".")
                spoofed = SPOOFED
                user_headers = {"tailnet-node-name", "tailnet-user-login", "tailnet-user-name"}

                for expose, scheme in (("grpc", "http"), ("grpcs", "https")):
                    answer = await ask(laptop, agent, ports[expose], ca.cert_path, "grpc.example.test", alpn="h2",
                                       method="POST", path="/echo.Echo/Say", body=grpc_frame(b"hello " + b"x" * 40000),
                                       headers=(("content-type", "application/grpc"), ("te", "trailers"), *spoofed),
                                       trailers=(("x-request-checksum", "c0ffee"),))
                    assert answer.alpn == "h2", answer
                    headers = echoed_grpc_call(answer, "hello " + "x" * 40000, "c0ffee", scheme)
                    assert headers["tailnet-user-login"] == "alice@example.test", headers
                    assert headers["tailnet-node-name"] == laptop_name and "tailnet-node-tags" not in headers
                    assert identity_names(headers) == user_headers, headers

                for sni, name in (("shop.example.test", "shop"), ("blog.example.test", "blog")):
                    for alpn in ("http/1.1", "h2"):
                        answer = await ask(laptop, agent, ports["web"], ca.cert_path, sni, alpn=alpn, path=f"/{alpn}",
                                           headers=spoofed)
                        assert (answer.status, answer.alpn) == (200, alpn), answer
                        assert dns_names(answer) == [sni]
                        seen = json.loads(answer.body)
                        assert (seen["backend"], seen["path"]) == (name, f"/{alpn}")
                        headers = seen["headers"]
                        assert headers["tailnet-user-login"] == "alice@example.test"
                        assert headers["tailnet-user-name"] == "=?utf-8?q?Alice_=C3=9Cnal?="
                        assert headers["tailnet-node-name"] == laptop_name
                        assert "tailnet-node-tags" not in headers and headers["x-forwarded-for"] == laptop.ipv4()
                        assert identity_names(headers) == user_headers, headers
                wrong = await ask(laptop, agent, ports["web"], ca.cert_path, "shop.example.test", alpn="h2",
                                  host="blog.example.test")
                assert wrong.status == 421, wrong

                tagged = tailscale_nodes("ts-ci-grpc", headscale, authkey=key)  # a tagged caller: no user
                await wait_peer_sees(tagged, "ingress-grpc")
                answer = await ask(tagged, agent, ports["web"], ca.cert_path, "blog.example.test", headers=spoofed)
                headers = json.loads(answer.body)["headers"]
                assert headers["tailnet-node-tags"] == TAG, headers
                assert headers["tailnet-node-name"] == str(tagged.status()["Self"]["DNSName"]).rstrip(".")
                assert "tailnet-user-login" not in headers and "tailnet-user-name" not in headers
                assert identity_names(headers) == {"tailnet-node-name", "tailnet-node-tags"}, headers
                document = await agent.status()
                assert {e["name"]: e["listening"] for e in document["exposes"]} == {
                    "grpc": True, "grpcs": True, "shop": True, "blog": True}
    finally:
        h2c.close()
        h2s.close()


async def test_a_plaintext_port_serves_h2c_with_prior_knowledge_and_grpc_beside_http1(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """A plaintext http port (a Gateway's HTTP listener) shared by a gRPC expose (h2c backend) and
    a web expose (HTTP/1.1 backend): a client that opens with the HTTP/2 preface (prior knowledge,
    as gRPC clients and the Gateway API conformance suite call an HTTP listener) is served HTTP/2,
    each stream's host chosen by ``:authority``; a gRPC call keeps its trailers both ways; HTTP/1.1
    on the same port is unchanged; the backends see the caller from the netmap, not what it claims."""
    user = headscale.api("POST", "/api/v1/user", {"name": "bob", "email": "bob@example.test"})["user"]
    laptop = tailscale_nodes("ts-laptop-h2c", headscale,
                             authkey=headscale.create_preauth_key(user_id=str(user["id"]), ephemeral=True))
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    port = free_port()
    h2c = await GrpcEcho.start()
    try:
        async with named_backend("shop") as shop_port:
            exposes = [{"name": name, "port": port, "mode": "http", "plaintext": True, "hosts": [{"name": host}],
                        "backend": {"host": "127.0.0.1", **backend}}
                       for name, host, backend in (("grpc", "grpc.example.test", {"port": h2c.port, "protocol": "h2"}),
                                                   ("web", "shop.example.test", {"port": shop_port}))]
            async with ingress_agent(headscale, "ingress-h2c", key, tmp_path, exposes) as agent:
                await wait_peer_sees(laptop, "ingress-h2c")
                laptop_name = str(laptop.status()["Self"]["DNSName"]).rstrip(".")

                async def through() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                    return await tunnel(laptop.http_proxy_port, agent.ip, port)

                call = await asyncio.wait_for(h2c_request(
                    await through(), host="grpc.example.test", method="POST", path="/echo.Echo/Say",
                    body=grpc_frame(b"plain " + b"z" * 70000),
                    headers=(("content-type", "application/grpc"), ("te", "trailers"), *SPOOFED),
                    trailers=(("x-request-checksum", "beef"),)), 30)
                headers = echoed_grpc_call(call, "plain " + "z" * 70000, "beef", "http")
                assert headers["tailnet-user-login"] == "bob@example.test", headers
                assert headers["tailnet-node-name"] == laptop_name
                assert identity_names(headers) == {"tailnet-node-name", "tailnet-user-login", "tailnet-user-name"}

                for ask_with in (h2c_request, http1_request):
                    answer = await asyncio.wait_for(ask_with(await through(), host="shop.example.test", path="/p",
                                                             headers=SPOOFED), 30)
                    assert answer.status == 200, (ask_with.__name__, answer)
                    seen = json.loads(answer.body)
                    assert (seen["backend"], seen["path"]) == ("shop", "/p")
                    assert seen["headers"]["x-forwarded-proto"] == "http"
                    assert seen["headers"]["tailnet-user-login"] == "bob@example.test"
                    assert "tailnet-node-tags" not in seen["headers"]
                    unknown = await asyncio.wait_for(ask_with(await through(), host="else.example.test"), 30)
                    assert unknown.status == 404 and b"no host else.example.test" in unknown.body, unknown
    finally:
        h2c.close()


async def test_a_node_with_no_port_opens_one_when_an_expose_comes_and_closes_it_when_it_goes(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """An empty exposes file is a node with no port open (a Gateway whose TLS and TCP listeners have
    no route yet): it registers and is ready; an expose written later listens, and once it is
    written away again nothing forwards to its backend."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-empty", headscale, authkey=key)
    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    listen = free_port()

    async def answer() -> bytes:
        reader, writer = await tunnel(laptop.http_proxy_port, agent.ip, listen)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        await writer.drain()
        try:
            return await asyncio.wait_for(read_all(reader), 10)
        finally:
            writer.close()

    try:
        async with ingress_agent(headscale, "ingress-empty", key, tmp_path, []) as agent:
            await wait_peer_sees(laptop, "ingress-empty")
            assert (await agent.status())["exposes"] == []
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await answer()

            write_like_kubelet(tmp_path, json.dumps([tcp("web", listen, server.sockets[0].getsockname()[1])]))
            await eventually(lambda: agent.ingress.forwarder.is_listening("web"), timeout=10, what="web exposed")
            assert (await answer()).endswith(b"\r\n\r\nhello\n")

            write_like_kubelet(tmp_path, "[]")
            await eventually(lambda: not agent.ingress.forwarder.is_listening("web"), timeout=10,
                             what="web closed")
            assert (await agent.status())["exposesFile"]["error"] is None
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await answer()
    finally:
        server.close()


async def test_a_tcp_expose_answers_on_the_nodes_ipv6_address(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """The node's tailnet IPv6 address (fd7a:115c:a1e0::/48) serves the exposes like its IPv4 one."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-v6", headscale, authkey=key)
    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    listen = free_port()
    try:
        async with ingress_agent(headscale, "ingress-v6", key, tmp_path,
                                 [tcp("web", listen, server.sockets[0].getsockname()[1])]) as agent:
            await wait_peer_sees(laptop, "ingress-v6")
            [v6] = [a for a in agent.node.addresses() if ":" in a]
            reader, writer = await tunnel(laptop.http_proxy_port, f"[{v6}]", listen)
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            await writer.drain()
            assert (await read_all(reader)).endswith(b"\r\n\r\nhello\n")
            writer.close()
    finally:
        server.close()


async def test_tls_hosts_of_one_port_split_over_two_exposes_by_a_reload_keep_answering(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """A Gateway's fifth host on a port makes the operator write a second expose on that port
    (four hosts per expose): the agent moves the hosts without stopping (the conformance suite's
    HTTPS listener test adds a route to a Gateway of four listeners on port 443)."""
    ca = CertificateAuthority(tmp_path / "pki", "ingress")
    cert = ca.issue("all", common_name="a.example.test", hosts=("a.example.test", "b.example.test", "c.example.test",
                                                              "*.w.example.test", "e.example.test"))
    tls = {"certFile": str(cert.cert), "keyFile": str(cert.key)}
    runner, backend_port = await whoami_backend()
    port = free_port()
    backend = {"host": "127.0.0.1", "port": backend_port}

    def expose(name: str, *hosts: str) -> dict[str, Any]:
        return {"name": name, "port": port, "mode": "http", "backend": backend,
                "hosts": [{"name": h, "tls": tls, **({"fallback": False} if h == "*" else {})} for h in hosts]}

    first = [expose("https-0", "*", "a.example.test", "*.w.example.test", "b.example.test")]
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-split", headscale, authkey=key)
    try:
        async with ingress_agent(headscale, "ingress-split", key, tmp_path, first) as agent:
            await wait_peer_sees(laptop, "ingress-split")
            address = agent.ip
            assert (await ask(laptop, agent, port, ca.cert_path, "a.example.test")).status == 200
            write_like_kubelet(tmp_path, json.dumps([
                expose("https-0", "*", "a.example.test", "*.w.example.test", "b.example.test"),
                expose("https-1", "e.example.test")]))
            await eventually(lambda: agent.ingress.forwarder.is_listening("https-1"), timeout=10,
                             what="the second expose on the port")
            for sni, code in (("a.example.test", 200), ("e.example.test", 200), ("x.w.example.test", 200),
                              ("elsewhere.test", 404)):
                answer = await ask(laptop, agent, port, ca.cert_path, sni, check_name=False)
                assert answer.status == code, (sni, answer)
            assert agent.ip == address and agent.node.ready
    finally:
        await runner.cleanup()


def tls_backend_context(ca: CertificateAuthority, name: str, *hosts: str) -> ssl.SSLContext:
    """A backend's own server context: a certificate of the test CA for ``hosts``."""
    pair = ca.issue(name, common_name=hosts[0], hosts=hosts)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pair.cert, pair.key)
    return context


async def test_tls_exposes_share_a_port_and_pass_tls_through_to_the_backend_sni_names(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """Two tls exposes on one port, one with an exact and a wildcard host: the laptop's TLS reaches
    the backend its SNI names, verified end to end against the backend's own certificate (the agent
    holds none), and the request arrives as the client wrote it (no forwarding or identity headers:
    nothing terminated it on the way). A name no host answers to is refused with an alert."""
    ca = CertificateAuthority(tmp_path / "pki", "ingress")
    shop_tls = tls_backend_context(ca, "shop", "shop.example.test")
    blog_tls = tls_backend_context(ca, "blog", "blog.example.test", "*.blog.example.test")
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-tls", headscale, authkey=key)
    port = free_port()
    async with named_backend("shop", shop_tls) as shop_port, named_backend("blog", blog_tls) as blog_port:
        exposes = [
            {"name": "shop", "port": port, "mode": "tls", "backend": {"host": "127.0.0.1", "port": shop_port},
             "hosts": [{"name": "shop.example.test"}]},
            {"name": "blog", "port": port, "mode": "tls", "backend": {"host": "127.0.0.1", "port": blog_port},
             "hosts": [{"name": "blog.example.test"}, {"name": "*.blog.example.test"}]}]
        async with ingress_agent(headscale, "ingress-tls", key, tmp_path, exposes) as agent:
            await wait_peer_sees(laptop, "ingress-tls")
            blog_names = ["blog.example.test", "*.blog.example.test"]
            # A certificate's * covers one label: a.b.blog is routed by the host, not verified by name.
            for sni, name, names, check_name in (("shop.example.test", "shop", ["shop.example.test"], True),
                                                 ("blog.example.test", "blog", blog_names, True),
                                                 ("a.blog.example.test", "blog", blog_names, True),
                                                 ("a.b.blog.example.test", "blog", blog_names, False)):
                answer = await ask(laptop, agent, port, ca.cert_path, sni, path=f"/{name}", check_name=check_name)
                assert answer.status == 200 and dns_names(answer) == names, (sni, answer)
                seen = json.loads(answer.body)
                assert (seen["backend"], seen["path"], seen["headers"]["host"]) == (name, f"/{name}", sni)
                assert identity_names(seen["headers"]) == set() and "x-forwarded-for" not in seen["headers"], seen
            with pytest.raises(ssl.SSLError, match="UNRECOGNIZED_NAME"):
                await ask(laptop, agent, port, ca.cert_path, "elsewhere.example.test")
            refused = agent.ingress.forwarder.metrics.registry.get_sample_value(
                "tailnet_agent_passthrough_refused_total", {"reason": "unknown_name"})
            assert refused == 1
            document = await agent.status()
            assert {e["name"]: (e["mode"], e["listening"]) for e in document["exposes"]} == {
                "shop": ("tls", True), "blog": ("tls", True)}
