"""The Tailnet reconciler: a working Headscale API key, minted and rotated by the operator.

The bootstrap key (a Secret the user owns) is read, never written, and used only to mint the
operator's own working key, kept in the Secret ``<tailnet>-headscale-api-key`` in the
operator's namespace (owned by the Tailnet). Everything else uses the working key.

Rotation at half the key's lifetime, in an order that survives a crash at any step:

1. create the new key (with the current working key; the bootstrap key if that fails);
2. prove it works with a call made with it;
3. store it, recording the old key's id as ``previous`` in the Secret;
4. expire the old key, then forget ``previous``.

A crash after 1 leaves the old key in place (the new one is never used and expires on its
own); after 3, the next reconcile finds ``previous`` and finishes step 4. A working key that
Headscale rejects (expired or deleted by hand) is replaced from the bootstrap key, with an
Event saying so.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from pydantic import ValidationError

from tailnet_operator.api.common import parse_go_duration
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import (
    ApiKey,
    HeadscaleClient,
    HeadscaleError,
    NotFound,
    TransportError,
    Unauthorized,
)
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime.cache import SharedCache
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.controller import Request, Result
from tailnet_operator.runtime.events import EventRecorder
from tailnet_operator.runtime.finalizers import FINALIZER, add_finalizer, has_finalizer, remove_finalizer
from tailnet_operator.runtime.kinds import SECRET

from . import conditions
from .conditions import Cond
from .kinds import TAILNET

log = structlog.get_logger("controllers.tailnet")

RESYNC_SECONDS = 300.0
"""Reachability is checked at least this often, even with no change and no rotation due."""

RETRY_SECONDS = 10.0
"""How soon a Tailnet that cannot reach Headscale is tried again."""

FINALIZE_GIVE_UP = timedelta(minutes=5)
"""How long a deleted Tailnet waits to expire its key before it lets go anyway (with a Warning)."""

KEY_FIELD = "apiKey"
ANNOTATION = "tailnet.dev/"


def working_key_secret_name(tailnet: str) -> str:
    return f"{tailnet}-headscale-api-key"


@dataclass(frozen=True)
class StoredKey:
    """The working key as the operator's Secret records it."""

    key: str
    id: str
    prefix: str
    created_at: datetime
    expires_at: datetime
    previous_id: str = ""

    @classmethod
    def from_secret(cls, secret: JSON | None) -> StoredKey | None:
        if not secret:
            return None
        raw = (secret.get("data") or {}).get(KEY_FIELD)
        if not raw:
            return None
        annotations = secret.get("metadata", {}).get("annotations") or {}
        try:
            return cls(
                key=base64.b64decode(raw).decode(),
                id=annotations[f"{ANNOTATION}key-id"],
                prefix=annotations.get(f"{ANNOTATION}key-prefix", ""),
                created_at=datetime.fromisoformat(annotations[f"{ANNOTATION}key-created"]),
                expires_at=datetime.fromisoformat(annotations[f"{ANNOTATION}key-expires"]),
                previous_id=annotations.get(f"{ANNOTATION}previous-key-id", ""),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class Problem(Exception):
    """Why there is no working access, as a condition reason and a message for people."""

    reason: str
    message: str


def _problem_from(exc: HeadscaleError, what: str) -> Problem:
    if isinstance(exc, TransportError):
        if exc.tls:
            return Problem("TLSError", f"TLS to Headscale failed while {what}: {exc}. Check caBundle/caSecretRef")
        return Problem("Unreachable", f"Headscale did not answer while {what}: {exc}")
    return Problem("HeadscaleError", f"Headscale refused {what}: {exc}")


ClientFactory = Callable[[str, str, str | None], HeadscaleClient]
"""(url, api key, CA bundle PEM or None) -> a Headscale client."""


def default_client_factory(url: str, api_key: str, ca_bundle: str | None) -> HeadscaleClient:
    return HeadscaleClient(url, api_key, ca_bundle=ca_bundle)


class TailnetScoped:
    """What the reconcilers of a Tailnet share: the API client and cache, the operator's
    namespace, the event recorder, a Headscale client factory and the wall clock.

    ``now`` returns aware UTC; tests replace it (and ``headscale``) to move time or the network.
    """

    def __init__(self, *, client: Client, cache: SharedCache, namespace: str, events: EventRecorder,
                 headscale: ClientFactory = default_client_factory,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.client = client
        self.cache = cache
        self.namespace = namespace
        self.events = events
        self._headscale = headscale
        self._now = now

    @staticmethod
    def _api_url(tailnet: Tailnet) -> str:
        return str(tailnet.spec.api_url or tailnet.spec.login_url)

    def _stored_key(self, tailnet: Tailnet) -> StoredKey | None:
        """The working key the Tailnet reconciler keeps in the operator's namespace, if any."""
        return StoredKey.from_secret(self.cache.get(SECRET, working_key_secret_name(_name(tailnet)), self.namespace))

    def _ca_bundle(self, tailnet: Tailnet) -> str | None:
        if tailnet.spec.ca_bundle:
            return tailnet.spec.ca_bundle
        ref = tailnet.spec.ca_secret_ref
        if ref is None:
            return None
        secret = self.cache.get(SECRET, ref.name, ref.namespace)
        raw = (secret or {}).get("data", {}).get(ref.key)
        if not raw:
            raise Problem("CASecretMissing", f"the CA Secret {ref.namespace}/{ref.name} has no key {ref.key}")
        return base64.b64decode(raw).decode()


class TailnetReconciler(TailnetScoped):
    """Reconciles one Tailnet: access to its Headscale, the working key and the Ready condition.

    ``after_store`` (called between storing a rotated key and expiring the old one) is a seam
    for tests that simulate a crash there.
    """

    _after_store: Callable[[], Awaitable[None]] | None = None

    async def reconcile(self, request: Request) -> Result:
        obj = self.cache.get(TAILNET, request.name)
        if obj is None:
            return Result()
        if obj["metadata"].get("deletionTimestamp"):
            return await self._finalize(obj)
        try:
            tailnet = Tailnet.model_validate(obj)
        except ValidationError as exc:
            message = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            await self._apply_status(obj, {}, [Cond("Ready", "False", "InvalidSpec", message)])
            return Result()  # nothing to retry until the spec changes
        if not has_finalizer(obj, FINALIZER):
            await add_finalizer(self.client, TAILNET, obj, FINALIZER)
        status: dict[str, Any] = {}
        try:
            stored, version = await self._ensure_access(obj, tailnet)
        except Problem as problem:
            await self._apply_status(obj, status, [
                Cond("Ready", "False", problem.reason, problem.message),
                Cond("KeyValid", "Unknown" if problem.reason in ("Unreachable", "TLSError") else "False",
                     problem.reason, problem.message),
                Cond("Reachable", "False" if problem.reason in ("Unreachable", "TLSError") else "True",
                     problem.reason, problem.message),
            ])
            return Result(requeue_after=RETRY_SECONDS)
        rotation = self._rotation_due(stored, tailnet)
        status.update({
            "apiKey": {"id": stored.id, "prefix": stored.prefix, "createdAt": conditions.rfc3339(stored.created_at),
                       "expiresAt": conditions.rfc3339(stored.expires_at),
                       "nextRotationAt": conditions.rfc3339(rotation)},
            "serverVersion": version,
            "lastContactTime": conditions.rfc3339(self._now()),
        })
        message = f"working key {stored.prefix} valid until {conditions.rfc3339(stored.expires_at)}"
        await self._apply_status(obj, status, [
            Cond("Ready", "True", "Connected", f"Headscale {version} reachable; {message}"),
            Cond("Reachable", "True", "Connected", f"Headscale {version} answered"),
            Cond("KeyValid", "True", "KeyValid", message),
        ])
        wait = (rotation - self._now()).total_seconds()
        return Result(requeue_after=max(1.0, min(wait, RESYNC_SECONDS)))

    # -- access ---------------------------------------------------------------------------------

    async def _ensure_access(self, obj: JSON, tailnet: Tailnet) -> tuple[StoredKey, str]:
        url = self._api_url(tailnet)
        ca = self._ca_bundle(tailnet)
        stored = self._stored_key(tailnet)
        if stored is not None:
            try:
                version = await self._verify(url, stored.key, ca)
            except Unauthorized:
                await self.events.warning(
                    obj, "WorkingKeyRejected",
                    f"Headscale rejected the working key {stored.prefix}; minting a new one from the bootstrap key",
                    action="Authenticate")
                stored = None
            except HeadscaleError as exc:
                raise _problem_from(exc, "checking the working key") from exc
        if stored is None:
            stored, version = await self._mint(obj, tailnet, url, ca, self._bootstrap_key(tailnet), "bootstrap key")
            await self.events.normal(
                obj, "WorkingKeyMinted",
                f"minted working key {stored.prefix} from the bootstrap key, valid until "
                f"{conditions.rfc3339(stored.expires_at)}", action="Mint")
        if stored.previous_id:
            stored = await self._expire_previous(obj, tailnet, url, ca, stored)
        if self._now() >= self._rotation_due(stored, tailnet):
            stored, version = await self._rotate(obj, tailnet, url, ca, stored)
        return stored, version

    async def _verify(self, url: str, key: str, ca: str | None) -> str:
        """A call made with ``key``: proves it works and returns the server's version."""
        async with self._headscale(url, key, ca) as hs:
            await hs.list_api_keys()
            return await hs.version()

    async def _mint(self, obj: JSON, tailnet: Tailnet, url: str, ca: str | None, with_key: str, what: str,
                    previous: StoredKey | None = None) -> tuple[StoredKey, str]:
        """Create a key with ``with_key``, prove it, store it; returns it and the server version."""
        lifetime = timedelta(seconds=parse_go_duration(tailnet.spec.api_key_lifetime))
        try:
            async with self._headscale(url, with_key, ca) as hs:
                secret_key, info = await hs.create_api_key(expiration=self._now() + lifetime)
        except Unauthorized as exc:
            if what == "bootstrap key":
                raise Problem("BootstrapKeyRejected",
                              "Headscale rejected the bootstrap API key; put a valid key (headscale apikeys "
                              f"create) in the Secret {self._bootstrap_ref(tailnet)}") from exc
            raise
        except HeadscaleError as exc:
            raise _problem_from(exc, f"minting a working key with the {what}") from exc
        try:
            version = await self._verify(url, secret_key, ca)
        except HeadscaleError as exc:
            raise _problem_from(exc, "proving the new working key") from exc
        stored = self._stored(secret_key, info, lifetime, previous_id=previous.id if previous else "")
        await self._store(obj, tailnet, stored)
        return stored, version

    async def _rotate(self, obj: JSON, tailnet: Tailnet, url: str, ca: str | None,
                      old: StoredKey) -> tuple[StoredKey, str]:
        try:
            new, version = await self._mint(obj, tailnet, url, ca, old.key, "working key", previous=old)
        except Unauthorized:
            new, version = await self._mint(obj, tailnet, url, ca, self._bootstrap_key(tailnet), "bootstrap key",
                                            previous=old)
        await self.events.normal(obj, "WorkingKeyRotated", f"rotated the working key: {old.prefix} -> {new.prefix}",
                                 action="Rotate")
        if self._after_store is not None:
            await self._after_store()
        return await self._expire_previous(obj, tailnet, url, ca, new), version

    async def _expire_previous(self, obj: JSON, tailnet: Tailnet, url: str, ca: str | None,
                               stored: StoredKey) -> StoredKey:
        try:
            async with self._headscale(url, stored.key, ca) as hs:
                await hs.expire_api_key(key_id=stored.previous_id)
        except HeadscaleError as exc:
            if not _gone(exc):
                raise _problem_from(exc, "expiring the previous working key") from exc
        done = StoredKey(stored.key, stored.id, stored.prefix, stored.created_at, stored.expires_at)
        await self._store(obj, tailnet, done)
        return done

    def _stored(self, key: str, info: ApiKey, lifetime: timedelta, *, previous_id: str) -> StoredKey:
        created = info.created_at or self._now()
        return StoredKey(key=key, id=info.id, prefix=info.prefix, created_at=created,
                         expires_at=info.expiration or created + lifetime, previous_id=previous_id)

    async def _store(self, obj: JSON, tailnet: Tailnet, stored: StoredKey) -> None:
        annotations = {
            f"{ANNOTATION}key-id": stored.id,
            f"{ANNOTATION}key-prefix": stored.prefix,
            f"{ANNOTATION}key-created": stored.created_at.isoformat(),
            f"{ANNOTATION}key-expires": stored.expires_at.isoformat(),
        }
        if stored.previous_id:
            annotations[f"{ANNOTATION}previous-key-id"] = stored.previous_id
        await self.client.apply(SECRET, {
            "metadata": owned_metadata(obj, name=working_key_secret_name(_name(tailnet)), namespace=self.namespace,
                                       tailnet=_name(tailnet), annotations=annotations),
            "type": "Opaque",
            "data": {KEY_FIELD: base64.b64encode(stored.key.encode()).decode()},
        })

    def _rotation_due(self, stored: StoredKey, tailnet: Tailnet) -> datetime:
        lifetime = stored.expires_at - stored.created_at
        if lifetime <= timedelta(0):
            lifetime = timedelta(seconds=parse_go_duration(tailnet.spec.api_key_lifetime))
        return stored.created_at + lifetime / 2

    # -- inputs ---------------------------------------------------------------------------------

    def _bootstrap_ref(self, tailnet: Tailnet) -> str:
        ref = tailnet.spec.bootstrap_key_secret_ref
        return f"{ref.namespace}/{ref.name} (key {ref.key})"

    def _bootstrap_key(self, tailnet: Tailnet) -> str:
        ref = tailnet.spec.bootstrap_key_secret_ref
        secret = self.cache.get(SECRET, ref.name, ref.namespace)
        if secret is None:
            raise Problem("BootstrapSecretMissing",
                          f"the bootstrap Secret {ref.namespace}/{ref.name} does not exist; create it with a "
                          f"Headscale API key under the key {ref.key}")
        raw = (secret.get("data") or {}).get(ref.key)
        if not raw:
            raise Problem("BootstrapKeyMissing",
                          f"the bootstrap Secret {ref.namespace}/{ref.name} has no key {ref.key}")
        return base64.b64decode(raw).decode().strip()

    # -- status and deletion --------------------------------------------------------------------

    async def _apply_status(self, obj: JSON, fields: dict[str, Any], conds: list[Cond]) -> None:
        current = obj.get("status") or {}
        merged = conditions.merge(current.get("conditions"), conds, generation=obj["metadata"]["generation"],
                                  now=self._now())
        mine = conditions.only(merged, {c.type for c in conds})
        desired = {**fields, "observedGeneration": obj["metadata"]["generation"], "conditions": mine}
        if _unchanged(current, desired):
            return
        await self.client.apply_status(TAILNET, {"metadata": {"name": obj["metadata"]["name"]}, "status": desired})

    async def _finalize(self, obj: JSON) -> Result:
        if not has_finalizer(obj, FINALIZER):
            return Result()
        try:
            tailnet = Tailnet.model_validate(obj)
        except ValidationError:
            await remove_finalizer(self.client, TAILNET, obj, FINALIZER)  # no key can have been minted
            return Result()
        stored = self._stored_key(tailnet)
        if stored is not None:
            url = self._api_url(tailnet)
            try:
                async with self._headscale(url, stored.key, self._ca_bundle(tailnet)) as hs:
                    await hs.expire_api_key(key_id=stored.id)
                await self.events.normal(obj, "WorkingKeyExpired",
                                         f"expired the working key {stored.prefix} of the deleted Tailnet",
                                         action="Expire")
            except (HeadscaleError, Problem) as exc:
                deleted = datetime.fromisoformat(obj["metadata"]["deletionTimestamp"].replace("Z", "+00:00"))
                if not (isinstance(exc, HeadscaleError) and _gone(exc)) and self._now() - deleted < FINALIZE_GIVE_UP:
                    log.info("cannot expire the working key yet", tailnet=_name(tailnet), error=str(exc))
                    return Result(requeue_after=RETRY_SECONDS)
                await self.events.warning(obj, "WorkingKeyNotExpired",
                                          f"could not expire the working key {stored.prefix}: {exc}; "
                                          "expire it by hand (headscale apikeys expire)", action="Expire")
        await remove_finalizer(self.client, TAILNET, obj, FINALIZER)
        return Result()


def _gone(exc: HeadscaleError) -> bool:
    """The key is already expired or deleted, or the credential no longer exists."""
    return isinstance(exc, Unauthorized | NotFound)


def _unchanged(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether applying ``desired`` would change nothing worth a write.

    ``lastContactTime`` alone is refreshed only once it is older than the resync period, so a
    steady Tailnet costs one status write per resync, not one per reconcile.
    """
    def strip(status: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in status.items() if k != "lastContactTime"}

    last = current.get("lastContactTime")
    fresh = desired.get("lastContactTime")
    if fresh and (not last or (datetime.fromisoformat(fresh.replace("Z", "+00:00"))
                               - datetime.fromisoformat(last.replace("Z", "+00:00"))).total_seconds()
                  >= RESYNC_SECONDS):
        return False

    mine = {c["type"] for c in desired.get("conditions", [])}
    have = dict(current)
    have["conditions"] = [c for c in current.get("conditions") or [] if c["type"] in mine]
    return all(strip(have).get(k) == v for k, v in strip(desired).items())


def _name(model: Any) -> str:
    """metadata.name of a parsed object (always set on objects read from the API)."""
    return str(model.metadata.name)
