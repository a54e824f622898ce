"""The client against each Headscale minor's API shape (0.26 to 0.30), through MockTransport.

Each fake server answers by method and path the way that minor does (read from its sources):
0.26 has no ``/version`` nor health call, pre-auth keys are per user before 0.28, API keys are
expired by prefix before 0.28, and the policy check exists from 0.29.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tailnet_operator.headscale import (
    TAGGED_KEYS_USER,
    HeadscaleClient,
    MockTransport,
    NotFound,
    Request,
    Response,
    ServerFeatures,
    Unsupported,
    parse_version,
)

URL = "https://headscale.test:8443"
KEY = "abcdefg.legacysecretlegacysecretlegacysecret"
JSON = dict[str, Any]
Handler = Callable[[Request, JSON, dict[str, list[str]]], Response]


def ok(doc: JSON) -> Response:
    return Response(200, {"content-type": "application/json"}, json.dumps(doc).encode())


def grpc(status: int, code: int, message: str) -> Response:
    return Response(status, {"content-type": "application/json"},
                    json.dumps({"code": code, "message": message, "details": []}).encode())


NOT_FOUND = Response(404, {"content-type": "text/plain"}, b"404 page not found\n")


class Fake:
    """A Headscale of one version: routes ``(METHOD, path)`` to handlers; records every request."""

    def __init__(self, version: str | None, routes: dict[tuple[str, str], Handler]) -> None:
        self.routes = dict(routes)
        if version is not None:
            self.routes[("GET", "/version")] = lambda r, b, q: ok({"version": version})
        self.seen: list[tuple[str, str, JSON, dict[str, list[str]]]] = []

    def __call__(self, request: Request) -> Response:
        parts = urlsplit(request.url)
        body: JSON = json.loads(request.body) if request.body else {}
        query = parse_qs(parts.query)
        self.seen.append((request.method, parts.path, body, query))
        handler = self.routes.get((request.method, parts.path))
        return handler(request, body, query) if handler else NOT_FOUND

    def calls(self, method: str, path: str) -> list[tuple[JSON, dict[str, list[str]]]]:
        return [(b, q) for m, p, b, q in self.seen if (m, p) == (method, path)]


def client(fake: Fake) -> HeadscaleClient:
    return HeadscaleClient(URL, KEY, transport=MockTransport(fake), backoff=0)


@pytest.mark.parametrize(("reported", "minor", "grants", "by_id"), [
    ("", (0, 26), False, False),
    ("v0.27.1", (0, 27), False, False),
    ("v0.28.0", (0, 28), False, True),
    ("v0.29.2", (0, 29), True, True),
    ("v0.30.0", (0, 30), True, True),
    ("dev", (0, 30), True, True),
])
def test_features_follow_the_minor(reported: str, minor: tuple[int, int], grants: bool, by_id: bool) -> None:
    features = ServerFeatures.from_reported(reported)
    assert features.minor == minor
    assert features.grants is grants and features.policy_check is grants
    assert features.preauth_keys_by_id is by_id and features.tag_only_preauth_keys is by_id
    assert features.api_key_expire_by_id is by_id
    assert features.supported and not features.newer_than_known
    assert ServerFeatures.from_reported("v0.31.0").newer_than_known
    assert not ServerFeatures.from_reported("v0.25.1").supported
    assert parse_version("v0.29.2") == (0, 29, 2) and parse_version("dev") is None


async def test_026_without_version_endpoint_health_by_listing_keys() -> None:
    fake = Fake(None, {("GET", "/api/v1/apikey"): lambda r, b, q: ok({"apiKeys": []})})
    async with client(fake) as hs:
        assert (await hs.features()).minor == (0, 26)
        assert (await hs.health()).database_connectivity
        assert len(fake.calls("GET", "/version")) == 1  # asked once, then cached
        assert await hs.version() == ""
    assert fake.calls("GET", "/api/v1/health") == []


def _users(*names: str) -> Handler:
    return lambda r, b, q: ok({"users": [{"id": str(i + 1), "name": n} for i, n in enumerate(names)
                                         if "name" not in q or q["name"] == [n]]})


async def test_before_028_a_tag_only_key_is_made_under_the_tagged_devices_user() -> None:
    created: list[str] = []

    def create_user(r: Request, b: JSON, q: dict[str, list[str]]) -> Response:
        created.append(b["name"])
        return ok({"user": {"id": "7", "name": b["name"]}})

    fake = Fake("v0.27.1", {
        ("GET", "/api/v1/user"): lambda r, b, q: ok({"users": []}),
        ("POST", "/api/v1/user"): create_user,
        ("POST", "/api/v1/preauthkey"): lambda r, b, q: ok({"preAuthKey": {
            "id": "3", "key": "k" * 48, "aclTags": b["aclTags"], "user": {"id": b["user"], "name": TAGGED_KEYS_USER}}}),
    })
    async with client(fake) as hs:
        key = await hs.create_preauth_key(acl_tags=["tag:egress"], reusable=True)
    assert created == [TAGGED_KEYS_USER]
    (body, _), = fake.calls("POST", "/api/v1/preauthkey")
    assert body["user"] == "7" and body["aclTags"] == ["tag:egress"]
    assert key.acl_tags == ("tag:egress",)


async def test_from_028_a_tag_only_key_has_no_user() -> None:
    fake = Fake("v0.28.0", {("POST", "/api/v1/preauthkey"): lambda r, b, q: ok({"preAuthKey": {"id": "3"}})})
    async with client(fake) as hs:
        await hs.create_preauth_key(acl_tags=["tag:egress"])
    (body, _), = fake.calls("POST", "/api/v1/preauthkey")
    assert "user" not in body
    assert fake.calls("GET", "/api/v1/user") == []


async def test_before_028_pre_auth_keys_are_listed_per_user_and_expired_by_user_and_key() -> None:
    def list_keys(r: Request, b: JSON, q: dict[str, list[str]]) -> Response:
        if "user" not in q:
            return grpc(500, 2, "user not found")
        uid = q["user"][0]
        return ok({"preAuthKeys": [{"id": str(10 + int(uid)), "key": f"fullkey{uid}",
                                    "user": {"id": uid, "name": f"u{uid}"}}]})

    fake = Fake("v0.26.1", {
        ("GET", "/api/v1/user"): _users("alice", TAGGED_KEYS_USER),
        ("GET", "/api/v1/preauthkey"): list_keys,
        ("POST", "/api/v1/preauthkey/expire"): lambda r, b, q: ok({}),
    })
    async with client(fake) as hs:
        assert [k.id for k in await hs.list_preauth_keys()] == ["11", "12"]
        await hs.expire_preauth_key("12")
        await hs.expire_preauth_key("99")  # unknown: nothing to do, as 0.29 answers
        with pytest.raises(Unsupported, match=r"needs Headscale 0\.28"):
            await hs.delete_preauth_key("12")
    assert [b for b, _ in fake.calls("POST", "/api/v1/preauthkey/expire")] == [{"user": "2", "key": "fullkey2"}]
    assert fake.calls("DELETE", "/api/v1/preauthkey") == []


async def test_before_028_an_api_key_is_expired_by_its_prefix_looked_up_by_id() -> None:
    fake = Fake("v0.27.1", {
        ("GET", "/api/v1/apikey"): lambda r, b, q: ok({"apiKeys": [{"id": "4", "prefix": "zyxwvut"}]}),
        ("POST", "/api/v1/apikey/expire"): lambda r, b, q: ok({}),
    })
    async with client(fake) as hs:
        await hs.expire_api_key(key_id=4)
        with pytest.raises(NotFound):
            await hs.expire_api_key(key_id=5)
    assert [b for b, _ in fake.calls("POST", "/api/v1/apikey/expire")] == [{"prefix": "zyxwvut"}]


async def test_a_new_legacy_api_key_is_found_in_the_list_by_its_bare_prefix() -> None:
    fake = Fake("v0.26.1", {
        ("POST", "/api/v1/apikey"): lambda r, b, q: ok({"apiKey": "hijklmn.secretsecretsecret"}),
        ("GET", "/api/v1/apikey"): lambda r, b, q: ok({"apiKeys": [{"id": "9", "prefix": "hijklmn"}]}),
    })
    async with client(fake) as hs:
        new = await hs.create_api_key()
    assert new.id == "9"
    assert "secret" not in repr(new)


async def test_the_policy_check_is_skipped_before_029_and_sent_from_029() -> None:
    for version, checked in (("v0.28.0", False), ("v0.29.2", True)):
        fake = Fake(version, {("POST", "/api/v1/policy/check"): lambda r, b, q: ok({})})
        async with client(fake) as hs:
            assert await hs.check_policy("{}") is checked
        assert len(fake.calls("POST", "/api/v1/policy/check")) == int(checked)


async def test_030_problem_json_for_a_missing_policy_and_unknown_keys() -> None:
    def problem(status: int, detail: str, errors: list[JSON] | None = None) -> Response:
        body = {"type": "about:blank", "title": "x", "status": status, "detail": detail, "errors": errors or []}
        return Response(status, {"content-type": "application/problem+json"}, json.dumps(body).encode())

    fake = Fake("v0.30.0", {
        ("GET", "/api/v1/policy"): lambda r, b, q: problem(500, "loading ACL from database",
                                                          [{"message": "acl policy not found"}]),
        ("POST", "/api/v1/preauthkey/expire"): lambda r, b, q: problem(404, "pre-auth key not found"),
        ("DELETE", "/api/v1/preauthkey"): lambda r, b, q: problem(404, "pre-auth key not found"),
    })
    async with client(fake) as hs:
        assert (await hs.get_policy()).text == ""
        await hs.expire_preauth_key("5")
        await hs.delete_preauth_key("5")


def test_nodes_before_028_carry_forced_and_valid_tags() -> None:
    from tailnet_operator.headscale import Node
    old = Node.from_json({"id": "1", "forcedTags": ["tag:a"], "validTags": ["tag:b", "tag:a"],
                          "invalidTags": ["tag:c"]})
    assert old.tags == ("tag:a", "tag:b")
    assert Node.from_json({"id": "1", "tags": ["tag:x"], "forcedTags": ["tag:a"]}).tags == ("tag:x",)


async def test_the_version_asked_once_also_answers_what_the_server_offers() -> None:
    fake = Fake("v0.28.0", {})
    async with client(fake) as hs:
        assert await hs.version() == "v0.28.0"
        assert not (await hs.features()).grants
        await hs.features()
    assert len(fake.calls("GET", "/version")) == 1
