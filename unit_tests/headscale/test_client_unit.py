"""The Headscale client through its transport seam: error mapping, retries, parsing, secrecy.

No network: every test scripts the server with a MockTransport handler and counts attempts.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import structlog

import tailnet_operator.headscale as hs
from tailnet_agent.contract.clock import FakeClock
from tailnet_operator.headscale import (
    AlreadyExists,
    APIError,
    Conflict,
    ConnectError,
    Forbidden,
    HeadscaleClient,
    InvalidRequest,
    MockTransport,
    NotFound,
    PolicyRejected,
    Request,
    RequestTimeout,
    Response,
    ServerError,
    TLSVerificationError,
    TransportError,
    Unauthorized,
)

URL = "https://headscale.test:8443"
KEY = "hskey-api-AbCdEfGhIjKl-" + "S3cr3tS3cr3tS3cr3tS3cr3tS3cr3tS3cr3tS3cr3tS3cr3tS3cr3tS3cr3tS3cr"
SECRET = KEY.split("-", 3)[3]
JSON = dict[str, Any]


def grpc(status: int, code: int, message: str) -> Response:
    body = json.dumps({"code": code, "message": message, "details": []}).encode()
    return Response(status, {"content-type": "application/json"}, body)


def problem(status: int, title: str, detail: str) -> Response:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    return Response(status, {"content-type": "application/problem+json"}, body)


def ok(doc: JSON) -> Response:
    return Response(200, {"content-type": "application/json"}, json.dumps(doc).encode())


class Server:
    """Answers each request with the next scripted outcome (the last one repeats); records requests."""

    def __init__(self, *outcomes: Response | Exception) -> None:
        self.outcomes = list(outcomes)
        self.requests: list[Request] = []

    def __call__(self, request: Request) -> Response:
        self.requests.append(request)
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @property
    def attempts(self) -> int:
        return len(self.requests)

    def body(self, index: int = -1) -> JSON:
        raw = self.requests[index].body
        assert raw is not None
        doc: JSON = json.loads(raw)
        return doc


def client(server: Callable[[Request], Response], **kwargs: Any) -> HeadscaleClient:
    kwargs.setdefault("server_version", "v0.29.2")
    return HeadscaleClient(URL, KEY, transport=MockTransport(server), backoff=0, **kwargs)


# -- error mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(("response", "expected", "grpc_code"), [
    (grpc(400, 3, "tag must start with the string 'tag:'"), InvalidRequest, 3),
    (grpc(404, 5, "node not found"), NotFound, 5),
    (grpc(500, 2, "user not found"), NotFound, 2),
    (grpc(500, 2, "auth-key must be either tagged or owned by user"), InvalidRequest, 2),
    (grpc(500, 13, "creating user: constraint failed: UNIQUE constraint failed: users.name (2067)"),
     AlreadyExists, 13),
    (grpc(409, 6, "already exists"), AlreadyExists, 6),
    (grpc(403, 7, "denied"), Forbidden, 7),
    (grpc(500, 13, "database exploded"), ServerError, 13),
])
async def test_grpc_gateway_errors_map_to_one_hierarchy(response: Response, expected: type[APIError],
                                                        grpc_code: int) -> None:
    server = Server(response)
    async with client(server) as hsc:
        with pytest.raises(expected) as info:
            await hsc.list_users()
    assert type(info.value) is expected
    assert info.value.status == response.status
    assert info.value.grpc_code == grpc_code
    assert info.value.message == json.loads(response.body)["message"]
    assert info.value.path == "/api/v1/user" and info.value.method == "GET"
    assert server.attempts == 1, "Headscale's own answers are final"


@pytest.mark.parametrize(("response", "expected"), [
    (problem(400, "Bad Request", "tag must start with 'tag:'"), InvalidRequest),
    (problem(422, "Unprocessable Entity", "expected string"), InvalidRequest),
    (problem(401, "Unauthorized", "invalid API key"), Unauthorized),
    (problem(404, "Not Found", "node 7 not found"), NotFound),
    (problem(409, "Conflict", "user exists"), Conflict),
    (problem(500, "Internal Server Error", "db down"), ServerError),
])
async def test_problem_documents_map_to_the_same_hierarchy(response: Response, expected: type[APIError]) -> None:
    server = Server(response)
    async with client(server) as hsc:
        with pytest.raises(expected) as info:
            await hsc.get_node("7")
    assert type(info.value) is expected
    assert info.value.message == json.loads(response.body)["detail"]
    assert info.value.problem_type == "about:blank"
    assert info.value.grpc_code is None
    assert server.attempts == 1


async def test_plain_text_401_is_unauthorized() -> None:
    server = Server(Response(401, {"content-type": "text/plain; charset=utf-8"}, b"Unauthorized"))
    async with client(server) as hsc:
        with pytest.raises(Unauthorized) as info:
            await hsc.list_nodes()
    assert info.value.status == 401 and info.value.message == "Unauthorized"
    assert server.attempts == 1


async def test_refused_policy_keeps_the_server_message_verbatim() -> None:
    put_message = 'setting policy: parsing policy: src=tag not found: "tag:x"'
    check_message = "test(s) failed:\ntag:a -> tag:b:22: expected DENIED, got ALLOWED"
    server = Server(grpc(500, 2, put_message), grpc(400, 3, check_message),
                    problem(400, "Bad Request", "unknown field \"foo\""))
    async with client(server) as hsc:
        with pytest.raises(PolicyRejected) as put:
            await hsc.set_policy('{"acls": []}')
        with pytest.raises(PolicyRejected) as check:
            await hsc.check_policy('{"acls": []}')
        with pytest.raises(PolicyRejected) as later:
            await hsc.check_policy('{"foo": 1}')
    assert put.value.message == put_message and put.value.status == 500
    assert check.value.message == check_message
    assert later.value.message == 'unknown field "foo"'
    assert isinstance(put.value, InvalidRequest)
    assert server.attempts == 3, "a refused policy is never retried"


async def test_missing_policy_is_empty_but_other_not_found_raises() -> None:
    stored = {"policy": '{"acls": []}', "updatedAt": "2026-07-01T10:00:00.5Z"}
    server = Server(grpc(500, 2, "loading ACL from database: acl policy not found"), ok(stored),
                    grpc(404, 5, "Not Found"))
    async with client(server) as hsc:
        assert await hsc.get_policy() == ("", None)
        text, updated_at = await hsc.get_policy()
        assert text == '{"acls": []}' and updated_at == dt.datetime(2026, 7, 1, 10, 0, 0, 500000, tzinfo=dt.UTC)
        with pytest.raises(NotFound):
            await hsc.get_policy()


# -- retries --------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [
    ConnectError("refused"),
    Response(502, {"content-type": "text/html"}, b"<html>Bad Gateway</html>"),
    Response(503, {}, b"upstream connect error"),
    grpc(503, 14, "unavailable"),
])
async def test_transient_failures_are_retried_up_to_three_attempts(failure: Response | Exception) -> None:
    server = Server(failure)
    async with client(server) as hsc:
        with pytest.raises((ConnectError, ServerError)):
            await hsc.list_nodes()
    assert server.attempts == 3


async def test_a_retry_that_succeeds_returns_the_answer() -> None:
    server = Server(ConnectError("refused"), Response(503, {}, b""), ok({"users": []}))
    async with client(server) as hsc:
        assert await hsc.list_users() == []
    assert server.attempts == 3


async def test_the_waits_between_attempts_go_through_the_clock() -> None:
    """With a fake clock the retry happens only once the clock has moved past its wait: no real
    time passes, and a test can watch the backoff."""
    clock = FakeClock()
    server = Server(ConnectError("refused"), ok({"users": []}))
    hsc = HeadscaleClient(URL, KEY, transport=MockTransport(server), backoff=2, clock=clock,
                          server_version="v0.29.2")
    async with hsc:
        call = asyncio.create_task(hsc.list_users())
        await clock.wait_for_sleepers()
        assert server.attempts == 1
        deadline = clock.next_deadline
        assert deadline is not None and deadline > clock.now()
        clock.advance(deadline - clock.now())
        assert await call == []
    assert server.attempts == 2


@pytest.mark.parametrize("failure", [
    grpc(400, 3, "bad"),
    Response(401, {}, b"Unauthorized"),
    grpc(404, 5, "node not found"),
    grpc(500, 2, "parsing route: netip.ParsePrefix(\"bad\"): no '/'"),
    grpc(500, 13, "internal"),
    TLSVerificationError("TLS verification failed"),
])
async def test_final_answers_are_not_retried(failure: Response | Exception) -> None:
    server = Server(failure)
    async with client(server) as hsc:
        with pytest.raises((APIError, TransportError)):
            await hsc.approve_routes("1", ["bad"])
    assert server.attempts == 1


@pytest.mark.parametrize(("failure", "attempts"), [
    (RequestTimeout("slow"), 1),
    (Response(504, {}, b"gateway timeout"), 1),
    (TransportError("connection reset"), 1),
    (ConnectError("refused"), 3),
    (Response(503, {}, b""), 3),
])
async def test_creates_are_not_repeated_after_an_ambiguous_failure(failure: Response | Exception,
                                                                   attempts: int) -> None:
    server = Server(failure)
    async with client(server) as hsc:
        with pytest.raises((TransportError, APIError)):
            await hsc.create_preauth_key(acl_tags=["tag:a"])
    assert server.attempts == attempts


async def test_idempotent_reads_are_retried_after_a_timeout() -> None:
    server = Server(RequestTimeout("slow"), TransportError("connection reset"), ok({"nodes": []}))
    async with client(server) as hsc:
        assert await hsc.list_nodes() == []
    assert server.attempts == 3


async def test_the_client_enforces_its_timeout_on_any_transport() -> None:
    async def slow(request: Request) -> Response:
        await asyncio.sleep(5)
        return ok({})

    hsc = HeadscaleClient(URL, KEY, transport=MockTransport(slow), backoff=0, timeout=0.05)
    started = asyncio.get_running_loop().time()
    with pytest.raises(RequestTimeout, match=r"longer than 0\.05s"):
        await hsc.list_nodes()
    assert asyncio.get_running_loop().time() - started < 1.0  # 3 attempts of 0.05 s


# -- requests and parsing ---------------------------------------------------------------------

NODE = {
    "id": "3", "machineKey": "mkey:aa", "nodeKey": "nodekey:bb", "discoKey": "discokey:cc",
    "ipAddresses": ["100.64.0.3", "fd7a:115c:a1e0::3"], "name": "agent-1", "user": None,
    "lastSeen": "2026-07-01T10:00:00.123456789Z", "expiry": None,
    "preAuthKey": {"id": "7", "key": "hskey-auth-qgdKq91l8l54-***"},
    "createdAt": "2026-07-01T09:59:59Z", "registerMethod": "REGISTER_METHOD_AUTH_KEY", "givenName": "agent-1",
    "online": True, "approvedRoutes": ["10.0.0.0/24"], "availableRoutes": ["10.0.0.0/24", "10.1.0.0/24"],
    "subnetRoutes": [], "tags": ["tag:agent"],
}


async def test_nodes_parse_ids_timestamps_and_routes() -> None:
    server = Server(ok({"node": NODE}))
    async with client(server) as hsc:
        node = await hsc.get_node(3)
    assert server.requests[0].url == f"{URL}/api/v1/node/3"
    assert node.id == "3" and node.pre_auth_key_id == "7"
    assert node.last_seen == dt.datetime(2026, 7, 1, 10, 0, 0, 123456, tzinfo=dt.UTC)
    assert node.created_at is not None and node.created_at.tzinfo is not None
    assert node.expiry is None and node.user is None and node.is_tagged
    assert node.available_routes == ("10.0.0.0/24", "10.1.0.0/24")
    assert node.approved_routes == ("10.0.0.0/24",)


async def test_add_approved_routes_unions_with_the_current_list() -> None:
    after = {**NODE, "approvedRoutes": ["10.0.0.0/24", "10.1.0.0/24"]}
    server = Server(ok({"node": NODE}), ok({"node": after}), ok({"node": after}))
    async with client(server) as hsc:
        node = await hsc.add_approved_routes("3", ["10.1.0.0/24", "10.1.0.0/24"])
        assert server.body() == {"routes": ["10.0.0.0/24", "10.1.0.0/24"]}
        assert node.approved_routes == ("10.0.0.0/24", "10.1.0.0/24")
        await hsc.add_approved_routes(node, ["10.0.0.0/24"])  # already approved: read only
    assert [r.method for r in server.requests] == ["GET", "POST", "GET"]


async def test_keys_are_created_with_an_expiration_and_parsed() -> None:
    pak = {"user": None, "id": "7", "key": "hskey-auth-qgdKq91l8l54-" + "x" * 64, "reusable": True,
           "ephemeral": True, "used": False, "expiration": "2099-01-01T00:00:00Z",
           "createdAt": "2026-07-01T09:59:59.5Z", "aclTags": ["tag:agent"]}
    api_keys = {"apiKeys": [{"id": "1", "prefix": "hskey-api-AbCdEfGhIjKl-***", "expiration": "2099-01-01T00:00:00Z",
                             "createdAt": "2026-07-01T00:00:00Z", "lastSeen": None}]}
    server = Server(ok({"preAuthKey": pak}), ok({"apiKey": KEY}), ok(api_keys), ok(api_keys))
    async with client(server) as hsc:
        key = await hsc.create_preauth_key(acl_tags=["tag:agent"], reusable=True, ephemeral=True,
                                           expiration=dt.timedelta(minutes=30))
        body = server.body()
        assert body["aclTags"] == ["tag:agent"] and body["reusable"] and body["ephemeral"] and "user" not in body
        sent = dt.datetime.fromisoformat(body["expiration"])
        assert body["expiration"].endswith("Z")
        assert abs(sent - (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=30))) < dt.timedelta(seconds=5)
        assert key.id == "7" and key.user is None and key.acl_tags == ("tag:agent",)
        assert key.expiration == dt.datetime(2099, 1, 1, tzinfo=dt.UTC)
        new = await hsc.create_api_key(expiration=dt.datetime(2099, 1, 1, tzinfo=dt.UTC))
        assert server.body(1) == {"expiration": "2099-01-01T00:00:00Z"}
        listed = await hsc.list_api_keys()
    secret, info = new
    assert secret == KEY and info == listed[0] and new.id == "1", "the id comes from the list"
    assert listed[0].prefix == new.prefix == "hskey-api-AbCdEfGhIjKl-***"
    assert listed[0].created_at == dt.datetime(2026, 7, 1, tzinfo=dt.UTC) and listed[0].last_seen is None


async def test_naive_expiration_is_refused_locally() -> None:
    server = Server(ok({}))
    async with client(server) as hsc:
        with pytest.raises(ValueError, match="timezone-aware"):
            await hsc.create_api_key(expiration=dt.datetime(2099, 1, 1))
    assert server.attempts == 0


async def test_api_key_secret_never_travels_in_a_path_or_expire_body() -> None:
    server = Server(ok({}))
    async with client(server) as hsc:
        await hsc.delete_api_key(KEY)
        await hsc.expire_api_key(prefix=KEY)
        await hsc.expire_api_key(key_id=4)
        with pytest.raises(ValueError):
            await hsc.expire_api_key()
    assert server.requests[0].url == f"{URL}/api/v1/apikey/AbCdEfGhIjKl"
    assert server.body(1) == {"prefix": "AbCdEfGhIjKl"}
    assert server.body(2) == {"id": "4"}


async def test_headers_auth_and_version_without_key() -> None:
    server = Server(ok({"version": "v0.29.2", "commit": "unknown", "go": {"version": "go1.26.8"}, "dirty": False}),
                    ok({"databaseConnectivity": True}))
    async with client(server) as hsc:
        version = await hsc.version()
        health = await hsc.health()
    assert version == "v0.29.2"
    assert health.database_connectivity
    assert "Authorization" not in server.requests[0].headers
    assert server.requests[1].headers["Authorization"] == f"Bearer {KEY}"


async def test_closed_client_refuses_calls() -> None:
    hsc = client(Server(ok({})))
    await hsc.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await hsc.list_nodes()


# -- secrecy -----------------------------------------------------------------------------------


def assert_no_key(texts: Sequence[str]) -> None:
    for text in texts:
        assert KEY not in text and SECRET not in text, text


async def test_no_key_in_reprs_exceptions_or_logs() -> None:
    echo = grpc(500, 13, f"internal: bad token {KEY}")  # a server that echoes the key
    server = Server(Response(401, {}, b"Unauthorized"), echo, ConnectError("refused"))
    hsc = client(server)
    texts = [repr(hsc), str(hsc), repr(server.requests)]
    assert "hskey-api-AbCdEfGhIjKl-***" in repr(hsc) and URL in repr(hsc)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(hs.HeadscaleError) as info:
                await hsc.list_api_keys()
            texts += [str(info.value), repr(info.value), repr(info.value.__cause__)]
    texts += [repr(r) for r in server.requests]
    texts += [repr(entry) for entry in logs]
    assert any(e.get("status") == 401 and e.get("path") == "/api/v1/apikey" for e in logs)
    assert any(e["log_level"] == "info" and e["event"] == "headscale retry" for e in logs)
    assert all(e.get("logger_name") == "headscale" for e in logs)
    new = hs.NewApiKey(key=KEY, info=hs.ApiKey(id="1", prefix=hs.mask_key(KEY), expiration=None,
                                               created_at=None, last_seen=None))
    texts += [repr(new), str(new), hs.mask_key(KEY)]
    assert_no_key(texts)
    await hsc.aclose()


def test_public_surface_exports_every_error_and_model() -> None:
    from tailnet_operator.headscale import _errors, _models

    assert len(set(hs.__all__)) == len(hs.__all__)
    for name in hs.__all__:
        assert hasattr(hs, name), name
    for module in (_errors, _models):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__ and not name.startswith("_"):
                assert name in hs.__all__, name
    assert issubclass(hs.PolicyRejected, hs.InvalidRequest)
    assert issubclass(hs.AlreadyExists, hs.Conflict)
    assert issubclass(hs.TLSVerificationError, hs.TransportError)
