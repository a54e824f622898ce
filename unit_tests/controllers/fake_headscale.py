"""A Headscale API in memory, behind the real client's ``MockTransport`` seam (test tooling).

It serves what the reconcilers call: ``/version``, API keys (list, create, expire), pre-auth keys
(create, list, expire), nodes (list, get, delete, rename, approve routes) and the policy (get, check, put), with
bearer-key authentication. Limits: no users, no policy validation beyond ``reject_policy``, and no retries
(clients are built with ``attempts=1``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from datetime import datetime

from tailnet_operator.headscale import ConnectError, HeadscaleClient, MockTransport, Request, Response
from tailnet_operator.headscale import TLSVerificationError as TLSError
from tailnet_operator.runtime import Clock
from tailnet_operator.types import JSON

VERSION = "v0.29.2"


def _time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Key:
    id: str
    key: str
    created: datetime
    expiration: datetime
    expired: bool = False

    @property
    def prefix(self) -> str:
        return self.key[: len("hskey-api-") + 12] + "-***"


@dataclass
class FakeHeadscale:
    clock: Clock
    keys: dict[str, Key] = field(default_factory=dict)
    nodes: list[JSON] = field(default_factory=list)
    policy: str = ""
    reject_policy: str = ""
    """A non-empty message makes policy check and put fail with it."""
    down: str = ""
    """"connect" or "tls" makes every request fail at the transport."""
    refuse: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    """``METHOD path`` -> (HTTP status, gRPC code, message) to answer that request with."""
    calls: list[str] = field(default_factory=list)
    """``METHOD path`` of every request, in order."""
    policy_writes: int = 0
    version: str = VERSION
    """What ``/version`` reports (the client adapts to it)."""
    expire_new_api_keys: bool = False
    """Hand out API keys that no call accepts (a server that mints broken keys)."""
    preauth_keys: dict[str, JSON] = field(default_factory=dict)
    """id -> the pre-auth key as the API shows it (``key`` in full; ``expired`` when expired)."""

    def preauth_live(self, key: str) -> bool:
        return any(k["key"] == key and not k.get("expired") for k in self.preauth_keys.values())

    def add_key(self, *, expired: bool = False) -> str:
        """A key Headscale knows (as ``headscale apikeys create`` makes); returns its full value."""
        key = f"hskey-api-{secrets.token_hex(6)}-{secrets.token_hex(16)}"
        now = self.clock.utcnow()
        number = str(len(self.keys) + 1)
        self.keys[number] = Key(number, key, now, now.replace(year=now.year + 1), expired)
        return key

    def live(self, key: str) -> bool:
        return any(k.key == key and not k.expired for k in self.keys.values())

    def factory(self, url: str, api_key: str, ca_bundle: str | None) -> HeadscaleClient:
        return HeadscaleClient(url, api_key, transport=MockTransport(self.handle), attempts=1)

    # -- the API ----------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        path = request.url.split("://", 1)[1].split("/", 1)[1]
        path = "/" + path.split("?", 1)[0]
        self.calls.append(f"{request.method} {path}")
        if self.down == "connect":
            raise ConnectError(f"cannot connect to {request.url}: connection refused")
        if self.down == "tls":
            raise TLSError(f"TLS verification failed for {request.url}")
        if f"{request.method} {path}" in self.refuse:
            return _error(*self.refuse[f"{request.method} {path}"])
        if path == "/version":
            return _ok({"version": self.version})
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if not self.live(bearer):
            return _error(401, 16, "Unauthorized")
        body = json.loads(request.body) if request.body else {}
        route = (request.method, path)
        if route == ("GET", "/api/v1/apikey"):
            return _ok({"apiKeys": [{"id": k.id, "prefix": k.prefix, "createdAt": _time(k.created),
                                     "expiration": _time(self.clock.utcnow() if k.expired else k.expiration)}
                                    for k in self.keys.values()]})
        if route == ("POST", "/api/v1/apikey"):
            key = self.add_key()
            created = self.keys[str(len(self.keys))]
            created.expiration = datetime.fromisoformat(body["expiration"].replace("Z", "+00:00"))
            created.expired = self.expire_new_api_keys
            return _ok({"apiKey": key})
        if route == ("POST", "/api/v1/apikey/expire"):
            target = self.keys.get(str(body.get("id")))
            if target is None:
                return _error(404, 5, "api key not found")
            target.expired = True
            return _ok({})
        if path.startswith("/api/v1/preauthkey"):
            return self._preauth(route, body)
        if route == ("GET", "/api/v1/node"):
            return _ok({"nodes": self.nodes})
        if request.method == "GET" and path.startswith("/api/v1/node/"):
            return _ok({"node": self._node(path.split("/")[4])})
        if request.method == "DELETE" and path.startswith("/api/v1/node/"):
            found = [n for n in self.nodes if n["id"] == path.split("/")[4]]
            if not found:
                return _error(404, 5, "node not found")
            self.nodes.remove(found[0])
            return _ok({})
        if request.method == "POST" and path.startswith("/api/v1/node/") and "/rename/" in path:
            return self._rename(path.split("/")[4], path.split("/rename/", 1)[1])
        if request.method == "POST" and path.endswith("/approve_routes"):
            node = self._node(path.split("/")[4])
            node["approvedRoutes"] = list(body["routes"])
            return _ok({"node": node})
        if route == ("GET", "/api/v1/policy"):
            if not self.policy:
                return _error(500, 2, "acl policy not found")
            return _ok({"policy": self.policy, "updatedAt": _time(self.clock.utcnow())})
        if route == ("POST", "/api/v1/policy/check"):
            return _error(500, 2, self.reject_policy) if self.reject_policy else _ok({})
        if route == ("PUT", "/api/v1/policy"):
            if self.reject_policy:
                return _error(500, 2, self.reject_policy)
            self.policy = body["policy"]
            self.policy_writes += 1
            return _ok({"policy": self.policy, "updatedAt": _time(self.clock.utcnow())})
        return _error(404, 5, f"no route {request.method} {path}")

    def _preauth(self, route: tuple[str, str], body: JSON) -> Response:
        if route == ("POST", "/api/v1/preauthkey"):
            number = str(len(self.preauth_keys) + 1)
            key = {"id": number, "key": f"hskey-auth-{secrets.token_hex(6)}-{secrets.token_hex(16)}",
                   "reusable": body["reusable"], "ephemeral": body["ephemeral"], "aclTags": body["aclTags"],
                   "expiration": body["expiration"], "createdAt": _time(self.clock.utcnow())}
            self.preauth_keys[number] = key
            return _ok({"preAuthKey": key})
        if route == ("GET", "/api/v1/preauthkey"):
            return _ok({"preAuthKeys": list(self.preauth_keys.values())})
        if route == ("POST", "/api/v1/preauthkey/expire"):
            if found := self.preauth_keys.get(str(body.get("id"))):
                found["expired"] = True
                found["expiration"] = _time(self.clock.utcnow())
            return _ok({})
        return _error(404, 5, f"no route {route}")

    def _rename(self, node_id: str, new_name: str) -> Response:
        """Headscale's rename: a node's given name, refused when another node holds it."""
        found = [n for n in self.nodes if n["id"] == node_id]
        if not found:
            return _error(404, 5, "node not found")
        if any(n.get("givenName") == new_name and n["id"] != node_id for n in self.nodes):
            return _error(500, 2, f"renaming node: name is not unique: {new_name}")
        found[0]["givenName"] = new_name
        return _ok({"node": found[0]})

    def _node(self, node_id: str) -> JSON:
        return next(n for n in self.nodes if n["id"] == node_id)


def _ok(doc: JSON) -> Response:
    return Response(200, {"content-type": "application/json"}, json.dumps(doc).encode())


def _error(status: int, code: int, message: str) -> Response:
    return Response(status, {"content-type": "application/json"},
                    json.dumps({"code": code, "message": message, "details": []}).encode())
