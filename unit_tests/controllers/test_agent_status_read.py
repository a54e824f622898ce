"""The operator's read of an agent's ``GET /status`` against pods that misbehave, on 127.0.0.1.

Whatever a pod answers, the read ends within its time limit, holds at most the size cap in memory
and returns either a document of the agreed shape or None ("agent status unavailable", which the
egress and ingress reconcilers show as Unknown), with the reason logged (``fetch`` raises it).
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from tailnet_agent.contract.targets import PortMapping, Target
from tailnet_agent.probe import ProbeResult
from tailnet_agent.status import status_document
from tailnet_operator.controllers.egress_status import HttpAgentStatus, StatusUnavailable, parse_status
from tailnet_operator.controllers.pipeline import node_status

OWNER = SimpleNamespace(metadata=SimpleNamespace(name="db", namespace="apps"))
SAFETY = 64 << 20
"""An "endless" body stops here and holds the connection open instead, so a reader without a cap
waits (and the test fails at its deadline) rather than filling this machine's memory."""
DEADLINE = 10.0
"""How long a test waits for a read that should end at once (the shared 2-core machine is slow)."""


class Pod:
    """A fake agent: answers each connection with ``answer``, counts the bytes it got out, and
    notes when the reader hung up."""

    def __init__(self, answer: Callable[[Pod, asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.answer = answer
        self.sent = 0
        self.requests: list[bytes] = []
        self.hung_up = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/status"

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            await self.answer(self, writer)
            await reader.read()  # the connection stays open until the reader closes it
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.hung_up.set()
            writer.close()


@asynccontextmanager
async def pod(answer: Callable[[Pod, asyncio.StreamWriter], Awaitable[None]]) -> AsyncIterator[Pod]:
    fake = Pod(answer)
    fake.server = await asyncio.start_server(fake._serve, "127.0.0.1", 0)
    try:
        yield fake
    finally:
        fake.server.close()


def head(*fields: str, status: str = "200 OK") -> bytes:
    return "".join(f"{line}\r\n" for line in (f"HTTP/1.1 {status}", *fields, "")).encode()


def json_answer(body: bytes, *fields: str) -> Callable[[Pod, asyncio.StreamWriter], Awaitable[None]]:
    async def answer(p: Pod, writer: asyncio.StreamWriter) -> None:
        await p.send(writer, head("Content-Type: application/json", f"Content-Length: {len(body)}", *fields) + body)
    return answer


async def read(fake: Pod, *, timeout: float = 60.0, deadline: float = DEADLINE) -> tuple[Any, str | None]:
    """What the reconcilers get (within ``deadline``), and the reason a second read gives for None."""
    reader = HttpAgentStatus(timeout, url=lambda owner: fake.url)
    document = await asyncio.wait_for(reader.read(OWNER), deadline)
    try:
        await asyncio.wait_for(reader.fetch(fake.url), deadline)
    except StatusUnavailable as exc:
        return document, exc.reason
    return document, None


# -- size ------------------------------------------------------------------------------------------

async def endless_chunked(p: Pod, writer: asyncio.StreamWriter) -> None:
    await p.send(writer, head("Content-Type: application/json", "Transfer-Encoding: chunked")
                 + b'13\r\n{"node": {"name": "\r\n')
    chunk = b"%x\r\n%s\r\n" % (64 << 10, b"a" * (64 << 10))
    while p.sent < SAFETY:
        await p.send(writer, chunk)


async def declared_huge(p: Pod, writer: asyncio.StreamWriter) -> None:
    await p.send(writer, head("Content-Type: application/json", "Content-Length: 10737418240") + b'{"node": ')


async def endless_head(p: Pod, writer: asyncio.StreamWriter) -> None:
    await p.send(writer, b"HTTP/1.1 200 OK\r\n")
    field = b"X-Pad: %s\r\n" % (b"a" * 8000)
    while p.sent < SAFETY:
        await p.send(writer, field)


@pytest.mark.parametrize(("answer", "why"), [(endless_chunked, "larger than 1 MiB"),
                                             (declared_huge, "larger than 1 MiB"),
                                             (endless_head, "Too many headers")],
                         ids=["endless", "declared-10GiB", "endless-head"])
async def test_an_answer_over_the_cap_is_refused_without_reading_it(
        answer: Callable[[Pod, asyncio.StreamWriter], Awaitable[None]], why: str) -> None:
    async with pod(answer) as fake:
        document, reason = await read(fake)
        assert document is None
        assert reason is not None and why in reason, reason
        await asyncio.wait_for(fake.hung_up.wait(), DEADLINE)
        assert fake.sent < SAFETY // 2, f"the reader took {fake.sent} bytes (the cap and the socket buffers)"


async def test_a_compressed_body_is_not_inflated() -> None:
    bomb = gzip.compress(b" " * SAFETY + b"{}", compresslevel=1)  # 64 MiB of JSON in well under 1 MiB
    async with pod(json_answer(bomb, "Content-Encoding: gzip")) as fake:
        document, reason = await read(fake)
        assert document is None
        assert reason is not None and "gzip" in reason, reason
        assert b"accept-encoding: identity" in fake.requests[0].lower()


# -- time ------------------------------------------------------------------------------------------

async def trickle(p: Pod, writer: asyncio.StreamWriter, data: bytes) -> None:
    for i in range(len(data)):  # a slow pod: one byte every 50 ms, far longer than the time limit
        await p.send(writer, data[i:i + 1])
        await asyncio.sleep(0.05)


async def trickled_body(p: Pod, writer: asyncio.StreamWriter) -> None:
    body = b'{"node": {"id": "7", "name": "db"}}' + b" " * 2000
    await p.send(writer, head("Content-Type: application/json", f"Content-Length: {len(body)}"))
    await trickle(p, writer, body)


async def trickled_head(p: Pod, writer: asyncio.StreamWriter) -> None:
    await trickle(p, writer, head("Content-Type: application/json", "Content-Length: 2", "X-Pad: " + "a" * 2000))


async def silent(p: Pod, writer: asyncio.StreamWriter) -> None:
    pass


@pytest.mark.parametrize("answer", [trickled_body, trickled_head, silent], ids=["body", "head", "silent"])
async def test_a_slow_pod_is_given_up_on_at_the_time_limit(
        answer: Callable[[Pod, asyncio.StreamWriter], Awaitable[None]]) -> None:
    async with pod(answer) as fake:
        loop = asyncio.get_running_loop()
        started = loop.time()
        document, reason = await read(fake, timeout=0.5, deadline=DEADLINE)
        assert document is None
        assert reason is not None and "0.5 s" in reason, reason
        assert loop.time() - started < DEADLINE
        await asyncio.wait_for(fake.hung_up.wait(), DEADLINE)


# -- shape -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "why"), [
    (b'{"node": {"id": "7", ', "JSON"),
    (b"<html>busy</html>", "JSON"),
    (b'["node"]', "object"),
    (b"[" * 100000 + b"]" * 100000, "JSON"),
    (b'{"node": {"id": 7, "name": "db", "addresses": []}}', "node.id"),
    (b'{"node": {"id": "7", "name": "db", "addresses": "100.64.0.7"}}', "node.addresses"),
    (b'{"targets": "ledger"}', "targets"),
    (b'{"targets": [{"name": ["ledger"]}]}', "targets.0.name"),
    (b'{"targets": [{"name": "ledger", "ports": ["5432"]}]}', "targets.0.ports.0"),
    (b'{"targets": [{"name": "ledger", "latencyMs": NaN}]}', "targets.0.latencyMs"),
    (b'{"targets": [{"name": "ledger", "reachable": "yes"}]}', "targets.0.reachable"),
    (b'{"exposes": [{"name": "web", "listening": 1}]}', "exposes.0.listening"),
    (b'{"exposes": [{"name": "web", "hosts": [{"name": "a", "error": {"x": 1}}]}]}', "exposes.0.hosts.0.error"),
], ids=["cut", "html", "array", "deep", "id-int", "addresses-str", "targets-str", "name-list", "port-str", "nan",
        "reachable-str", "listening-int", "error-object"])
async def test_a_body_that_is_not_a_status_document_is_refused(body: bytes, why: str) -> None:
    async with pod(json_answer(body)) as fake:
        document, reason = await read(fake)
        assert document is None
        assert reason is not None and why in reason, reason


async def test_a_redirect_is_not_followed() -> None:
    good = json.dumps({"node": {"id": "7", "name": "db", "addresses": ["100.64.0.7"]}}).encode()
    async with pod(json_answer(good)) as elsewhere:
        async def redirect(p: Pod, writer: asyncio.StreamWriter) -> None:
            await p.send(writer, head(f"Location: {elsewhere.url}", "Content-Length: 0", status="302 Found"))

        async with pod(redirect) as fake:
            document, reason = await read(fake)
            assert document is None
            assert reason is not None and "302" in reason, reason
            assert elsewhere.requests == []


async def test_a_status_document_is_read_with_unknown_keys_left_out() -> None:
    egress = {"node": {"id": "7", "name": "db.tailnet.test", "addresses": ["100.64.0.7"], "os": "linux"},
              "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [5432], "state": "Ready",
                           "router": "gw.tailnet.test", "routerId": "3", "message": "routed", "reachable": True,
                           "latencyMs": 3, "checkedAt": "2026-01-01T12:00:00Z", "future": [1, 2]}],
              "targetsFile": {"error": None, "loadedAt": None}, "version": "2"}
    ingress = {"node": {"id": None, "name": "shop", "addresses": []},
               "exposes": [{"name": "web", "port": 443, "mode": "http", "listening": True, "message": None,
                            "backend": "web.shop.svc:8443", "reachable": None, "latencyMs": None, "checkedAt": None,
                            "backendError": None, "hosts": [{"name": "shop.example.com", "alias": "shop",
                                                             "notAfter": "2026-03-01T00:00:00Z", "error": None}]}],
               "exposesFile": {"error": None, "loadedAt": "2026-01-01T11:58:00Z"}}
    for sent in (egress, ingress):
        async with pod(json_answer(json.dumps(sent).encode())) as fake:
            document, reason = await read(fake)
            assert reason is None
            expected = json.loads(json.dumps(sent))
            expected.pop("version", None)
            expected["node"].pop("os", None)
            for entry in expected.get("targets", []):
                entry.pop("future")
            assert document == expected
    assert node_status(document) is None, "no node id yet"


def test_what_the_agent_writes_is_read_unchanged() -> None:
    checked = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    target = Target(name="db", address="198.18.5.9", ports=(PortMapping(port=5432, listen=15432),))
    for probes in ({"db": ProbeResult(True, 12.5, checked)}, {"db": ProbeResult(False, None, checked, "timeout")}, {}):
        doc = status_document(netmap=None, hostname="egress-a", addresses=["100.64.0.1"], targets=(target,),
                              lookups={}, probes=probes, targets_error="not valid JSON", loaded_at=checked)
        assert parse_status(json.dumps(doc).encode()) == doc


async def test_an_error_status_or_a_closed_port_is_unavailable() -> None:
    async def unavailable(p: Pod, writer: asyncio.StreamWriter) -> None:
        await p.send(writer, head("Content-Length: 0", status="503 Service Unavailable"))

    async with pod(unavailable) as fake:
        document, reason = await read(fake)
        assert document is None and reason is not None and "503" in reason, reason
    async with pod(silent) as closed:
        assert closed.server is not None
        url = closed.url
        closed.server.close()
        await closed.server.wait_closed()
        reader = HttpAgentStatus(60.0, url=lambda owner: url)
        assert await asyncio.wait_for(reader.read(OWNER), DEADLINE) is None
        with pytest.raises(StatusUnavailable, match="cannot be asked"):
            await asyncio.wait_for(reader.fetch(url), DEADLINE)
