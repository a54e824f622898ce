"""The async Headscale REST client (``/api/v1``, Headscale 0.26 to 0.30).

The calls whose shape differs between Headscale minors ask :meth:`HeadscaleClient.features`
first (one ``GET /version``, cached) and adapt; ``_versions`` has the table. An operation a
server cannot do at all raises :class:`Unsupported` before anything is sent.

Every call is one logical operation made of at most ``attempts`` HTTP attempts (default 3),
each bounded by ``timeout`` seconds (default 10), with exponential backoff between them.

Retry rule (``_should_retry``), in order:

1. :class:`ConnectError`: the request was never sent, so it is retried for every call.
2. :class:`TLSVerificationError`: a trust problem does not heal; never retried.
3. :class:`RequestTimeout` or a connection that broke mid-request: retried only for idempotent
   calls (reads, PUT, DELETE, expire, approve, set tags), because a create may already have
   happened.
4. :class:`ServerError` with ``transient`` (502/503/504, a non-Headscale body, gRPC
   Unavailable/DeadlineExceeded/ResourceExhausted/Aborted, a 2xx answer that is not a JSON
   object): retried for idempotent calls; for creates only on 502/503, which a proxy sends when
   Headscale never saw the request. A create whose answer was cut is not repeated: its key may
   exist, unrecorded, and the orphan sweep expires it (``_ownership``).
5. Everything else is Headscale's own answer and is raised at once. This includes the 0.29
   validation failures that arrive as HTTP 500 with gRPC code 2 (policy errors, bad prefixes)
   or 13 (duplicate names): repeating them only repeats the answer.

An answer that is a normal outcome is not a failure: an empty policy store (0.29's 500 "acl policy
not found") is logged at debug and read as the empty policy.

Logs go to the structlog logger ``headscale`` (``logger_name="headscale"`` on each line) with
method, path, status, attempt and elapsed milliseconds. Nothing logged, raised or repr'd
contains the API key: requests hide their headers, error bodies are scrubbed of the key, and
the client shows the key only in Headscale's masked form.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, urlencode, urlsplit

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from tailnet_agent.contract.clock import Clock, RealClock
from tailnet_operator.types import JSON

from ._errors import (
    APIError,
    ConnectError,
    HeadscaleError,
    NotFound,
    RequestTimeout,
    ServerError,
    TLSVerificationError,
    TransportError,
    Unsupported,
    error_from_response,
)
from ._models import (
    ApiKey,
    Health,
    NewApiKey,
    Node,
    Policy,
    PreAuthKey,
    User,
    mask_key,
    parse_time,
    raw_api_key_prefix,
)
from ._ownership import check_marker
from ._transport import AiohttpTransport, Request, Transport
from ._versions import ServerFeatures, minor_text

DEFAULT_TIMEOUT = 10.0
"""Seconds one HTTP attempt may take, connect to last byte."""

DEFAULT_ATTEMPTS = 3
"""HTTP attempts per call, the first included; 1 disables retries."""

DEFAULT_BACKOFF = 0.5
"""Seconds before the second attempt; doubled before each later one (0.5 s, then 1 s)."""

MAX_BACKOFF = 5.0
"""Upper bound, in seconds, of one wait between attempts."""

RENAME_SPACING = 0.05
"""Seconds :meth:`HeadscaleClient.rename_nodes` gives its first requests to reach Headscale before
it sends the last: enough for them to arrive first (with a connection to open), short against the
500 ms of Headscale's node-write batches, so that the last one most often joins their batch."""

DEFAULT_API_KEY_LIFETIME = dt.timedelta(days=90)
"""Lifetime of a new API key when none is given (the Headscale CLI's default)."""

TAGGED_KEYS_USER = "tagged-devices"
"""Before 0.28 every pre-auth key belongs to a user: a tag-only key is made under this one (created
when missing), as Headscale 0.28+ itself lists tagged nodes."""

DEFAULT_PREAUTH_KEY_LIFETIME = dt.timedelta(hours=1)
"""Lifetime of a new pre-auth key when none is given (the Headscale CLI's default)."""

Expiration = dt.datetime | dt.timedelta
"""An aware datetime, or a timedelta from now. Headscale treats a missing expiration as already
expired, so the client always sends one."""

_GATEWAY_REFUSED = (502, 503)
_log = structlog.get_logger("headscale", logger_name="headscale")


def _rfc3339(value: Expiration) -> str:
    when = dt.datetime.now(dt.UTC) + value if isinstance(value, dt.timedelta) else value
    if when.tzinfo is None:
        raise ValueError("expiration must be timezone-aware (or a timedelta from now)")
    return when.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def _segment(value: str | int) -> str:
    return quote(str(value), safe="")


def _should_retry(exc: BaseException, *, idempotent: bool) -> bool:
    """The retry rule of the module docstring, numbered the same way."""
    if isinstance(exc, ConnectError):
        return True
    if isinstance(exc, TLSVerificationError):
        return False
    if isinstance(exc, TransportError):
        return idempotent
    if isinstance(exc, ServerError) and exc.transient:
        return idempotent or exc.status in _GATEWAY_REFUSED
    return False


def _no_policy(exc: APIError) -> bool:
    """The answer of a server whose policy store is empty: 0.29 a 500 "acl policy not found" (which
    maps to NotFound), 0.30 a problem+json 500 whose errors carry the cause. Not a failure."""
    if not isinstance(exc, NotFound | ServerError):
        return False
    return "policy not found" in exc.message or any("policy not found" in str(d) for d in exc.details)


class RequestObserver(Protocol):
    """Receives one call per attempt: ``path`` as sent (with IDs), ``code`` the HTTP status or
    ``<error>`` when no answer came back."""

    def request_done(self, *, method: str, path: str, code: str, seconds: float) -> None: ...


class HeadscaleClient:
    """Async client of one Headscale server. Use ``async with HeadscaleClient(url, key) as hs``.

    ``url`` is the server's base URL (``https://headscale.example:443``; a path prefix is kept).
    ``api_key`` is sent as ``Authorization: Bearer``. ``ca_bundle`` is the CA that signed the
    server certificate, as PEM text or a file path; None trusts the system roots.
    ``timeout``, ``attempts`` and ``backoff`` default to :data:`DEFAULT_TIMEOUT`,
    :data:`DEFAULT_ATTEMPTS` and :data:`DEFAULT_BACKOFF`.

    ``transport`` replaces the network (tests pass a :class:`MockTransport`); the caller owns it.
    ``observer`` is told about every attempt (the operator's Headscale API metrics).
    By default the client owns one aiohttp session, opened on the first call and closed by
    :meth:`aclose`. A closed client cannot be reused.

    ``server_version`` (``"v0.29.2"``; ``""`` for a 0.26 without ``/version``) skips asking the
    server which version it runs, for callers that already know.

    ``clock``: what the waits between attempts go through (the real one by default; a
    ``FakeClock`` in tests, so that a retry is observable without waiting).

    ``owner_tag`` is the marker of the installation the client acts for
    (:func:`~._ownership.installation_tag`): the pre-auth keys the operator makes for its CRs carry
    it, and the orphan sweep considers only what carries it. The operator's
    ``HeadscaleAccess`` sets it from the Tailnet; reading it when nobody did raises ValueError.
    """

    def __init__(self, url: str, api_key: str, *, ca_bundle: str | Path | None = None,
                 timeout: float = DEFAULT_TIMEOUT, attempts: int = DEFAULT_ATTEMPTS,
                 backoff: float = DEFAULT_BACKOFF, transport: Transport | None = None,
                 server_version: str | None = None, observer: RequestObserver | None = None,
                 owner_tag: str | None = None, clock: Clock | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"Headscale URL must be http(s)://host[:port], got {url!r}")
        if timeout <= 0 or attempts < 1 or backoff < 0:
            raise ValueError("timeout must be > 0, attempts >= 1 and backoff >= 0")
        if not api_key:
            raise ValueError("an API key is required")
        self.url = url.rstrip("/")
        self._api_key = api_key
        self._key_bytes = api_key.encode()
        self._timeout = timeout
        self._attempts = attempts
        self._backoff = backoff
        self._clock: Clock = clock or RealClock()
        self._owned: AiohttpTransport | None = None
        if transport is None:
            self._owned = AiohttpTransport(ca_bundle=ca_bundle)
            transport = self._owned
        self._transport: Transport = transport
        self._observer = observer
        self._closed = False
        self._features = ServerFeatures.from_reported(server_version) if server_version is not None else None
        self._owner_tag = check_marker(owner_tag) if owner_tag is not None else None

    @property
    def owner_tag(self) -> str:
        """The installation's marker (see the class docstring)."""
        if self._owner_tag is None:
            raise ValueError("this Headscale client acts for no installation: it has no owner tag to mark keys "
                             "with (the operator's HeadscaleAccess sets it from the Tailnet's uid)")
        return self._owner_tag

    @owner_tag.setter
    def owner_tag(self, tag: str) -> None:
        self._owner_tag = check_marker(tag)

    def __repr__(self) -> str:
        return f"HeadscaleClient(url={self.url!r}, api_key={mask_key(self._api_key)!r})"

    async def __aenter__(self) -> HeadscaleClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client's own aiohttp session (an injected transport is left open)."""
        self._closed = True
        if self._owned is not None:
            await self._owned.aclose()

    # -- server --------------------------------------------------------------------------------

    async def health(self) -> Health:
        """``GET /api/v1/health``: proves the key is accepted and the database answers.

        0.26 has no health call: listing the API keys proves the same there."""
        if not (await self.features()).health_endpoint:
            await self.list_api_keys()
            return Health(database_connectivity=True)
        doc = await self._call("GET", "/api/v1/health")
        return Health(database_connectivity=bool(doc.get("databaseConnectivity")))

    async def version(self) -> str:
        """The server's version, e.g. ``v0.29.2``, from ``GET /version`` (0.27+, unauthenticated: the
        key is not sent); "" from a server without that endpoint (0.26). Builds outside a release
        report what ``go install`` recorded."""
        try:
            doc = await self._call("GET", "/version", auth=False)
        except NotFound:
            reported = ""
        else:
            reported = str(doc.get("version") or "")
        self._features = ServerFeatures.from_reported(reported)  # what features() would ask again
        return reported

    async def features(self) -> ServerFeatures:
        """What this server's API offers (by its version; asked once, then cached)."""
        if self._features is None:
            await self.version()
        assert self._features is not None
        return self._features

    async def _require(self, feature: str, minimum: tuple[int, int]) -> None:
        """Raise Unsupported unless the server is at least the ``minimum`` minor."""
        features = await self.features()
        if features.minor < minimum:
            raise Unsupported(feature, server=features.label, minimum=minor_text(minimum))

    # -- API keys ------------------------------------------------------------------------------

    async def create_api_key(self, *, expiration: Expiration = DEFAULT_API_KEY_LIFETIME) -> NewApiKey:
        """A new API key; its full value is returned only here.

        Headscale answers with the key alone, so the key is then looked up in the list to return
        its id (needed to expire it later) and timestamps. If it is not listed, ``info.id`` is "";
        if that list call fails, its error is raised and the new key is left to expire unused.
        """
        when = _rfc3339(expiration)
        doc = await self._call("POST", "/api/v1/apikey", body={"expiration": when}, idempotent=False)
        key = str(doc["apiKey"])
        prefix = mask_key(key)
        bare = raw_api_key_prefix(key)
        listed = next((k for k in await self.list_api_keys() if raw_api_key_prefix(k.prefix) == bare), None)
        info = listed or ApiKey(id="", prefix=prefix, expiration=parse_time(when), created_at=None, last_seen=None)
        return NewApiKey(key=key, info=info)

    async def list_api_keys(self) -> list[ApiKey]:
        """All API keys, expired ones included, with their masked prefixes."""
        doc = await self._call("GET", "/api/v1/apikey")
        return [ApiKey.from_json(k) for k in doc.get("apiKeys") or ()]

    async def expire_api_key(self, *, prefix: str | None = None, key_id: str | int | None = None) -> None:
        """Expire one key, named by exactly one of ``prefix`` (a full key, masked or bare prefix) or ``key_id``.

        Only the bare prefix is sent, never a secret. Before 0.28 keys are expired by prefix only: the
        id is looked up in the list first (an unknown id raises NotFound).
        """
        if (prefix is None) == (key_id is None):
            raise ValueError("give exactly one of prefix or key_id")
        if key_id is not None and not (await self.features()).api_key_expire_by_id:
            listed = next((k for k in await self.list_api_keys() if k.id == str(key_id)), None)
            if listed is None:
                raise NotFound(f"API key {key_id} not found", status=404, method="POST", path="/api/v1/apikey/expire")
            prefix, key_id = listed.prefix, None
        body = {"prefix": raw_api_key_prefix(prefix)} if prefix is not None else {"id": str(key_id)}
        await self._call("POST", "/api/v1/apikey/expire", body=body)

    async def delete_api_key(self, prefix: str) -> None:
        """Delete a key by prefix (a full key, masked or bare prefix; only the bare prefix is sent)."""
        await self._call("DELETE", f"/api/v1/apikey/{_segment(raw_api_key_prefix(prefix))}")

    # -- pre-auth keys -------------------------------------------------------------------------

    async def create_preauth_key(self, *, expiration: Expiration = DEFAULT_PREAUTH_KEY_LIFETIME,
                                 user: str | int | None = None, acl_tags: Sequence[str] = (),
                                 reusable: bool = False, ephemeral: bool = False) -> PreAuthKey:
        """A new pre-auth key; ``key`` holds its full value only in this result.

        ``user`` is a user *id*. With ``acl_tags`` the key is tag-only and ``user`` may be None;
        Headscale requires one of the two. Tags must start with ``tag:`` and be lowercase.

        Before 0.28 every key needs a user: a tag-only key is made under :data:`TAGGED_KEYS_USER`
        (created when missing), and its nodes carry the tags as forced tags.
        """
        body: JSON = {"expiration": _rfc3339(expiration), "reusable": reusable, "ephemeral": ephemeral,
                      "aclTags": list(acl_tags)}
        if user is None and acl_tags and not (await self.features()).tag_only_preauth_keys:
            user = await self._tagged_keys_user()
        if user is not None:
            body["user"] = str(user)
        doc = await self._call("POST", "/api/v1/preauthkey", body=body, idempotent=False)
        return PreAuthKey.from_json(doc["preAuthKey"])

    async def list_preauth_keys(self) -> list[PreAuthKey]:
        """Every pre-auth key, expired ones included; keys are masked (0.28+; before, they are listed
        per user, in full)."""
        if not (await self.features()).preauth_keys_by_id:
            keys: list[PreAuthKey] = []
            for owner in await self.list_users():
                doc = await self._call("GET", "/api/v1/preauthkey", query={"user": owner.id})
                keys += [PreAuthKey.from_json(k) for k in doc.get("preAuthKeys") or ()]
            return keys
        doc = await self._call("GET", "/api/v1/preauthkey")
        return [PreAuthKey.from_json(k) for k in doc.get("preAuthKeys") or ()]

    async def expire_preauth_key(self, key_id: str | int) -> None:
        """Set the key's expiration to now; nodes that already joined stay. Unknown ids succeed
        (0.26 to 0.29; 0.30 answers NotFound, which is swallowed too).

        Before 0.28 a key is expired by its user and full value, looked up by id first."""
        if not (await self.features()).preauth_keys_by_id:
            found = next((k for k in await self.list_preauth_keys() if k.id == str(key_id)), None)
            if found is not None and found.user is not None:
                await self._call("POST", "/api/v1/preauthkey/expire", body={"user": found.user.id, "key": found.key})
            return
        with contextlib.suppress(NotFound):
            await self._call("POST", "/api/v1/preauthkey/expire", body={"id": str(key_id)})

    async def delete_preauth_key(self, key_id: str | int) -> None:
        """Delete the key; nodes that used it stay. Unknown ids succeed. 0.28+ (raises Unsupported)."""
        await self._require("deleting a pre-auth key", (0, 28))
        with contextlib.suppress(NotFound):
            await self._call("DELETE", "/api/v1/preauthkey", query={"id": str(key_id)})

    async def _tagged_keys_user(self) -> str:
        found = await self.list_users(name=TAGGED_KEYS_USER)
        if found:
            return found[0].id
        try:
            return (await self.create_user(TAGGED_KEYS_USER)).id
        except APIError:
            found = await self.list_users(name=TAGGED_KEYS_USER)  # made by a concurrent call
            if not found:
                raise
            return found[0].id

    # -- users ---------------------------------------------------------------------------------

    async def list_users(self, *, name: str | None = None, user_id: str | int | None = None,
                         email: str | None = None) -> list[User]:
        """Users, optionally filtered by exact name, id or email."""
        query = {k: str(v) for k, v in (("name", name), ("id", user_id), ("email", email)) if v is not None}
        doc = await self._call("GET", "/api/v1/user", query=query)
        return [User.from_json(u) for u in doc.get("users") or ()]

    async def create_user(self, name: str, *, display_name: str = "", email: str = "",
                          picture_url: str = "") -> User:
        """A new user; a taken name raises AlreadyExists."""
        body = {"name": name, "displayName": display_name, "email": email, "pictureUrl": picture_url}
        doc = await self._call("POST", "/api/v1/user", body=body, idempotent=False)
        return User.from_json(doc["user"])

    async def delete_user(self, user_id: str | int) -> None:
        """Delete a user by id; an unknown id raises NotFound."""
        await self._call("DELETE", f"/api/v1/user/{_segment(user_id)}")

    # -- nodes ---------------------------------------------------------------------------------

    async def list_nodes(self, *, user: str | None = None) -> list[Node]:
        """All nodes, or those of one user *name*. Only list fills ``subnet_routes``."""
        doc = await self._call("GET", "/api/v1/node", query={"user": user} if user is not None else None)
        return [Node.from_json(n) for n in doc.get("nodes") or ()]

    async def get_node(self, node_id: str | int) -> Node:
        """One node; an unknown id raises NotFound."""
        doc = await self._call("GET", f"/api/v1/node/{_segment(node_id)}")
        return Node.from_json(doc["node"])

    async def delete_node(self, node_id: str | int) -> None:
        await self._call("DELETE", f"/api/v1/node/{_segment(node_id)}")

    async def rename_node(self, node_id: str | int, new_name: str) -> Node:
        """Set the node's given name (its MagicDNS label) to ``new_name``; returns the renamed node.
        Headscale refuses a name another node holds, so free it first."""
        doc = await self._call("POST", f"/api/v1/node/{_segment(node_id)}/rename/{_segment(new_name)}")
        return Node.from_json(doc["node"])

    async def rename_nodes(self, first: Sequence[tuple[str | int, str]], last: tuple[str | int, str], *,
                           last_name: str | None = None) -> list[Node]:
        """Rename the nodes of ``first``, then ``last`` to a name one of them frees, with no moment
        in which a peer's netmap has no node of that name (as far as Headscale allows); returns the
        renamed nodes in that order. ``last_name``: the current name of ``last``'s node.

        Headscale (0.27 on) applies node writes in batches, in the order they arrived, on a clock
        of its own (``tuning.node_store_batch_timeout``, 500 ms by default: a ticker, reset after
        each batch), and sends its peers the changes of one interval in one map update
        (``tuning.batch_change_delay``, 800 ms). Renames in consecutive batches leave a map update
        between them that shows the name on no node. So the renames are sent together, ``last``
        :data:`RENAME_SPACING` after the others so that it arrives after them, and, when
        ``last_name`` is given and ``first`` is not empty, right after a batch: a rename of
        ``last``'s node to the name it has (a write that changes nothing) is answered once its
        batch is applied, so the next batch is then furthest away. Should ``last`` be refused
        anyway (it overtook the others, or the server writes each rename on its own, as 0.26
        does), it is sent again once they are done; a refusal of one of ``first`` is raised."""
        async def attempt(node_id: str | int, name: str) -> Node | HeadscaleError:
            try:
                return await self.rename_node(node_id, name)
            except HeadscaleError as exc:
                return exc

        if last_name is not None and first:
            await self.rename_node(last[0], last_name)
        async with asyncio.TaskGroup() as group:
            freeing = [group.create_task(attempt(node_id, name)) for node_id, name in first]
            await self._clock.sleep(RENAME_SPACING)  # the first requests arrive before the last
            taking = group.create_task(attempt(*last))
        renamed = [task.result() for task in freeing]
        if refused := next((r for r in renamed if isinstance(r, HeadscaleError)), None):
            raise refused
        taken = taking.result()
        if isinstance(taken, HeadscaleError):
            _log.debug("rename sent again after the names it needs were freed", node=str(last[0]), error=str(taken))
            taken = await self.rename_node(*last)
        return [*(r for r in renamed if isinstance(r, Node)), taken]

    async def approve_routes(self, node_id: str | int, routes: Sequence[str]) -> Node:
        """Set the node's approved routes to exactly ``routes``: it REPLACES the list (``[]`` clears it).

        To add routes, use :meth:`add_approved_routes`.
        """
        doc = await self._call("POST", f"/api/v1/node/{_segment(node_id)}/approve_routes",
                               body={"routes": list(routes)})
        return Node.from_json(doc["node"])

    async def add_approved_routes(self, node: Node | str | int, routes: Iterable[str]) -> Node:
        """Approve ``routes`` in addition to those already approved; returns the updated node.

        The current list is read fresh (a passed Node may be stale); nothing is written when every
        route is already approved. Not atomic: Headscale has no compare-and-set, so an approval
        made by someone else between the read and the write is lost.
        """
        current = await self.get_node(node.id if isinstance(node, Node) else node)
        wanted = list(current.approved_routes)
        wanted += [r for r in dict.fromkeys(routes) if r not in current.approved_routes]
        if len(wanted) == len(current.approved_routes):
            return current
        return await self.approve_routes(current.id, wanted)

    # -- policy --------------------------------------------------------------------------------

    async def get_policy(self) -> Policy:
        """The stored policy as ``(text, updated_at)``; ``("", None)`` when none was ever stored
        (0.29 answers that case with a 500 "acl policy not found"; Headscale then allows all)."""
        try:
            doc = await self._call("GET", "/api/v1/policy", expected=_no_policy)
        except APIError as exc:
            if _no_policy(exc):
                return Policy(text="", updated_at=None)
            raise
        return Policy.from_json(doc)

    async def check_policy(self, text: str) -> bool:
        """Validate ``text`` and run its ``tests`` against the live nodes, storing nothing (0.29+).

        Raises PolicyRejected with Headscale's message. Returns False, sending nothing, when the
        server has no check (before 0.29): there :meth:`set_policy` is the only validation.
        """
        if not (await self.features()).policy_check:
            return False
        await self._call("POST", "/api/v1/policy/check", body={"policy": text}, policy=True)
        return True

    async def set_policy(self, text: str) -> Policy:
        """Store ``text`` (HuJSON) as the policy; a refused policy raises PolicyRejected and leaves
        the live one unchanged. Needs ``policy.mode: database``. Every call adds a database row,
        so don't store an unchanged policy in a loop."""
        return Policy.from_json(await self._call("PUT", "/api/v1/policy", body={"policy": text}, policy=True))

    # -- the request engine --------------------------------------------------------------------

    async def _call(self, method: str, path: str, *, body: JSON | None = None,
                    query: Mapping[str, str] | None = None, idempotent: bool = True, policy: bool = False,
                    auth: bool = True, expected: Callable[[APIError], bool] | None = None) -> JSON:
        """One operation with retries; returns the decoded JSON object of the success answer.

        ``expected`` says which failure answers are a normal outcome the caller handles (logged at
        debug, not as a failed request)."""
        if self._closed:
            raise RuntimeError("HeadscaleClient is closed; create a new one")
        target = f"{path}?{urlencode(query)}" if query else path
        headers = {"Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        request = Request(method=method, url=self.url + target, headers=headers, body=data, timeout=self._timeout)

        def log_retry(state: RetryCallState) -> None:
            _log.info("headscale retry", method=method, path=target, attempt=state.attempt_number + 1,
                      delay_s=round(state.upcoming_sleep, 3))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._backoff, max=MAX_BACKOFF),
            retry=retry_if_exception(lambda exc: _should_retry(exc, idempotent=idempotent)),
            before_sleep=log_retry,
            sleep=self._clock.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._attempt(request, target, attempt.retry_state.attempt_number, policy=policy,
                                           expected=expected)
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def _attempt(self, request: Request, target: str, number: int, *, policy: bool,
                       expected: Callable[[APIError], bool] | None = None) -> JSON:
        loop = asyncio.get_running_loop()
        started = loop.time()
        log = _log.bind(method=request.method, path=target, attempt=number)
        try:
            try:
                # The client's own deadline, so that every transport honours the timeout.
                async with asyncio.timeout(self._timeout):
                    response = await self._transport.handle(request)
            except TimeoutError as exc:
                raise RequestTimeout(f"{request.method} {request.url} took longer than {self._timeout:g}s") from exc
        except TransportError as exc:
            log.warning("headscale request failed", error=type(exc).__name__, reason=str(exc),
                        elapsed_ms=round((loop.time() - started) * 1000))
            if self._observer is not None:
                self._observer.request_done(method=request.method, path=target, code="<error>",
                                            seconds=loop.time() - started)
            raise
        elapsed_ms = round((loop.time() - started) * 1000)
        if self._observer is not None:
            self._observer.request_done(method=request.method, path=target, code=str(response.status),
                                        seconds=loop.time() - started)
        if 200 <= response.status < 300:
            log.debug("headscale request", status=response.status, elapsed_ms=elapsed_ms)
            return self._decode(response.body, request, target)
        error = error_from_response(response.status, response.headers,
                                    response.body.replace(self._key_bytes, b"***"),
                                    method=request.method, path=target, policy=policy)
        if expected is not None and expected(error):
            log.debug("headscale answer", status=response.status, error=type(error).__name__, reason=error.message,
                      elapsed_ms=elapsed_ms)
            raise error
        log.warning("headscale request failed", status=response.status, error=type(error).__name__,
                    grpc_code=error.grpc_code, reason=error.message, elapsed_ms=elapsed_ms)
        raise error

    @staticmethod
    def _decode(body: bytes, request: Request, target: str) -> JSON:
        if not body.strip():
            return {}
        try:
            doc = json.loads(body)
        except ValueError as exc:
            # a cut or garbled answer (a proxy, a restart mid-answer): another attempt may get a whole one
            # never the body itself: a cut create answer holds a new key
            raise ServerError(f"answer is not JSON ({len(body)} bytes: {exc})", transient=True,
                              status=200, method=request.method, path=target) from exc
        if not isinstance(doc, dict):
            raise ServerError("answer is not a JSON object", transient=True, status=200,
                              method=request.method, path=target)
        return doc

