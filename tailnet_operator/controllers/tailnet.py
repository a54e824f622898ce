"""The Tailnet reconciler: a working Headscale API key, minted and rotated by the operator.

The bootstrap key (a Secret the user owns) is read, never written, and used only to mint the
operator's own working key, kept in the Secret ``<tailnet>-headscale-api-key`` in the
operator's namespace (owned by the Tailnet). Everything else uses the working key.

Rotation at half the key's lifetime, in an order that survives a crash at any step:

1. create the new key (with the current working key; the bootstrap key if that fails);
2. prove it works with a call made with it;
3. store it, recording the old key's id as ``previous`` in the Secret;
4. expire the old key, then forget ``previous``.

A store (3) that may have landed but failed is not followed by another mint: the next attempt
stores the same key again (:mod:`.unconfirmed`); one that certainly wrote nothing expires the new
key. A create whose key was never seen (its answer lost, or a failure before the store) is
found again by the expiration it asked for, and expired once a working key is in place. A crash
after 1 leaves the new key behind (the record lives in the process; it is never used and expires
on its own: API keys carry no marker the orphan sweep could recognise); after 3, the next reconcile
finds ``previous`` and finishes step 4. A working key that Headscale rejects (expired or deleted
by hand) is replaced from the bootstrap key, with an Event saying so.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum

import structlog
from pydantic import ValidationError

from tailnet_operator.api.common import parse_go_duration
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import ApiKey, HeadscaleError, NotFound, Unauthorized
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime import (
    SECRET,
    Reader,
    Request,
    Result,
    Writer,
)
from tailnet_operator.types import JSON

from . import finalizer, periods
from .access import (
    ClientFactory,
    Connection,
    Deps,
    Problem,
    StoredKey,
    TailnetRun,
    default_client_factory,
    problem_from,
    working_key_secret_name,
)
from .cleanup import Cleanup
from .conditions import Cond, Status, invalid_spec_message, rfc3339
from .keyrecord import finish, store_new
from .kinds import TAILNET
from .status import StatusWriter
from .unconfirmed import Unconfirmed, Unseen

__all__ = [
    "FIELD_MANAGER",
    "ClientFactory",
    "Problem",
    "StoredKey",
    "TailnetReconciler",
    "default_client_factory",
    "working_key_secret_name",
]

log = structlog.get_logger("controllers.tailnet")

FIELD_MANAGER = "tailnet-operator"
"""The Tailnet reconciler's field manager (the operator's main one)."""

RESYNC_SECONDS = periods.TAILNET_RESYNC

RETRY_SECONDS = periods.HEADSCALE_RETRY

FINALIZE_GIVE_UP = periods.CLEANUP_GIVE_UP


class KeySource(Enum):
    """Which key a new working key is minted with."""

    BOOTSTRAP = "bootstrap key"
    WORKING = "working key"


@dataclass(frozen=True)
class Run(TailnetRun):
    """One reconcile of one Tailnet, and where its Headscale is."""

    endpoint: Connection


class TailnetReconciler:
    """Reconciles one Tailnet: access to its Headscale, the working key and the Ready condition.

    Works with ``deps`` (the cache, Headscale access, Events, the clock) and writes through
    ``writer`` as :data:`FIELD_MANAGER`. ``after_store`` (called between storing a rotated key
    and expiring the old one) is a seam for tests that simulate a crash there.
    """

    def __init__(self, deps: Deps, writer: Writer, *,
                 after_store: Callable[[], Awaitable[None]] | None = None) -> None:
        self.reader, self.access, self.events, self.clock = deps.reader, deps.access, deps.events, deps.clock
        self.writer = writer
        self.status = StatusWriter(writer, deps.clock, field_manager=FIELD_MANAGER)
        self.after_store = after_store
        self.cleanup = Cleanup(deps.events, deps.clock)
        self.unconfirmed: Unconfirmed[StoredKey] = Unconfirmed()
        """Working keys minted whose Secret write may have landed, stored again before any other is minted."""
        self.unseen = Unseen()
        """Creates whose key may exist unstored, by the expiration they asked for; expired once seen."""

    @property
    def namespace(self) -> str:
        return self.access.namespace

    async def reconcile(self, request: Request) -> Result:
        obj = self.reader.get(TAILNET, request.name)
        if obj is None:
            return Result()
        if obj["metadata"].get("deletionTimestamp"):
            return await self._finalize(obj)
        try:
            tailnet = self.reader.get(Tailnet, request.name)
        except ValidationError as exc:
            await self.status.write(TAILNET, obj, [Cond("Ready", "False", "InvalidSpec", invalid_spec_message(exc))])
            return Result()  # nothing to retry until the spec changes
        assert tailnet is not None
        if outside := self.access.secrets_outside(tailnet):
            await self.status.write(TAILNET, obj, [Cond("Ready", "False", "SecretOutsideOperatorNamespace", outside)])
            return Result()  # nothing to retry until the spec changes
        await finalizer.hold(self.writer, TAILNET, obj)
        try:
            run = Run(obj, tailnet, self.access.endpoint(tailnet))
            stored, version = await self._ensure_access(run)
        except Problem as problem:
            await self.status.write(TAILNET, obj, _failure_conditions(problem))
            return Result(requeue_after=RETRY_SECONDS)
        rotation = rotation_due(stored, tailnet)
        fields = {
            "apiKey": {"id": stored.id, "prefix": stored.prefix, "createdAt": rfc3339(stored.created_at),
                       "expiresAt": rfc3339(stored.expires_at), "nextRotationAt": rfc3339(rotation)},
            "serverVersion": version,
            "lastContactTime": self._last_contact(obj),
        }
        message = f"working key {stored.prefix} valid until {rfc3339(stored.expires_at)}"
        await self.status.write(TAILNET, obj, [
            Cond("Ready", "True", "Connected", f"Headscale {version} reachable; {message}"),
            Cond("Reachable", "True", "Connected", f"Headscale {version} answered"),
            Cond("KeyValid", "True", "KeyValid", message),
            *_transport_conditions(tailnet),
        ], fields)
        wait = (rotation - self.clock.utcnow()).total_seconds()
        return Result(requeue_after=max(1.0, min(wait, RESYNC_SECONDS)))

    def _last_contact(self, obj: JSON) -> str:
        """Now, unless the recorded contact is younger than the resync period: a steady Tailnet
        costs one status write per resync, not one per reconcile."""
        now = self.clock.utcnow()
        last = (obj.get("status") or {}).get("lastContactTime")
        if last and (now - datetime.fromisoformat(last.replace("Z", "+00:00"))).total_seconds() < RESYNC_SECONDS:
            return str(last)
        return rfc3339(now)

    # -- access ---------------------------------------------------------------------------------

    async def _ensure_access(self, run: Run) -> tuple[StoredKey, str]:
        stored = self.access.stored_key(run.tailnet)
        held = self.unconfirmed.held(run.name)
        if (pending := self.unconfirmed.pending(run.name, stored_id=stored.id if stored else None)) is not None:
            stored = await self._store_unconfirmed(run, pending, stored)
        elif held is not None:
            await self._announce(run, held)  # the write that seemed to fail was stored
        if stored is not None:
            try:
                version = await self._verify(run, stored.key)
            except Unauthorized:
                await self.events.warning(
                    run.obj, "WorkingKeyRejected",
                    f"Headscale rejected the working key {stored.prefix}; minting a new one from the bootstrap key",
                    action="Authenticate")
                stored = None
            except HeadscaleError as exc:
                raise problem_from(exc, "checking the working key") from exc
        if stored is None:
            stored, version = await self._mint(run, KeySource.BOOTSTRAP)
            await self.events.normal(
                run.obj, "WorkingKeyMinted",
                f"minted working key {stored.prefix} from the bootstrap key, valid until "
                f"{rfc3339(stored.expires_at)}", action="Mint")
        if stored.previous_id:
            stored = await self._expire_previous(run, stored)
        if self.clock.utcnow() >= rotation_due(stored, run.tailnet):
            stored, version = await self._rotate(run, stored)
        await self._expire_unseen(run, stored)
        return stored, version

    async def _expire_unseen(self, run: Run, stored: StoredKey) -> None:
        """Expire the keys made by creates whose outcome went unseen (:class:`.Unseen`), but never
        the key in use or one whose store is uncertain; on failure, the next reconcile tries again."""
        asked = self.unseen.asked(run.name)
        if not asked:
            return
        keep = {stored.id} | ({held.id} if (held := self.unconfirmed.held(run.name)) else set())
        try:
            async with self.access.open(run.endpoint, stored.key) as hs:
                for key in Unseen.made_by(asked, await hs.list_api_keys(), keep=keep):
                    await hs.expire_api_key(key_id=key.id)
                    log.info("expired an API key minted by a create whose answer was not seen", key_id=key.id,
                             prefix=key.prefix)
        except HeadscaleError as exc:
            log.warning("could not expire the keys of creates whose answer was not seen", error=str(exc))
            return
        self.unseen.done(run.name, asked)

    async def _store_unconfirmed(self, run: Run, pending: StoredKey, stored: StoredKey | None) -> StoredKey | None:
        """Store again a key minted by an earlier attempt whose write may have landed (:mod:`.unconfirmed`),
        once Headscale is seen to accept it; the key to go on with."""
        try:
            await self._verify(run, pending.key)
        except Unauthorized:
            self.unconfirmed.forget(run.name)  # rejected (expired by hand?): nothing can use it, nothing to expire
            return stored
        except HeadscaleError as exc:
            raise problem_from(exc, "checking the working key minted before") from exc
        await store_new(self.unconfirmed, run.name, pending, lambda key: self._store(run, key), self._never_abandoned)
        await self._announce(run, pending)
        return pending

    async def _announce(self, run: Run, key: StoredKey) -> None:
        """The Event of a mint or rotation whose store first seemed to fail."""
        if key.previous_id:
            await self.events.normal(run.obj, "WorkingKeyRotated", f"rotated the working key to {key.prefix} "
                                     "(its Secret write had an uncertain outcome)", action="Rotate")
        else:
            await self.events.normal(run.obj, "WorkingKeyMinted", f"minted working key {key.prefix} from the "
                                     "bootstrap key (its Secret write had an uncertain outcome)", action="Mint")

    @staticmethod
    async def _never_abandoned(key: StoredKey) -> None:
        raise AssertionError(f"a key whose store was uncertain is never abandoned ({key.id})")

    async def _verify(self, run: Run, key: str) -> str:
        """A call made with ``key``: proves it works and returns the server's version."""
        async with self.access.open(run.endpoint, key) as hs:
            await hs.list_api_keys()
            return (await hs.features()).label

    async def _mint(self, run: Run, source: KeySource, previous: StoredKey | None = None) -> tuple[StoredKey, str]:
        """Create a key with the ``source`` key, prove it, store it; returns it and the server version."""
        if source is KeySource.BOOTSTRAP:
            with_key = bootstrap_key(self.reader, run.tailnet)
        else:
            assert previous is not None, "a working key mints its successor"
            with_key = previous.key
        lifetime = timedelta(seconds=parse_go_duration(run.tailnet.spec.api_key_lifetime))
        expiration = self.clock.utcnow() + lifetime
        self.unseen.asking(run.name, expiration)  # until stored: a failure from here on may leave the key
        try:
            async with self.access.open(run.endpoint, with_key) as hs:
                secret_key, info = await hs.create_api_key(expiration=expiration)
        except Unauthorized as exc:
            if source is KeySource.BOOTSTRAP:
                raise Problem("BootstrapKeyRejected",
                              "Headscale rejected the bootstrap API key; put a valid key (headscale apikeys "
                              f"create) in the Secret {bootstrap_ref(run.tailnet)}") from exc
            raise
        except HeadscaleError as exc:
            raise problem_from(exc, f"minting a working key with the {source.value}") from exc
        try:
            version = await self._verify(run, secret_key)
        except HeadscaleError as exc:
            raise problem_from(exc, "proving the new working key") from exc
        stored = self._stored(secret_key, info, lifetime, previous_id=previous.id if previous else "")

        async def abandon(key: StoredKey) -> None:  # an admin key nothing refers to: expire it, or retries leak
            await self._abandon(run, with_key, key.id)

        await store_new(self.unconfirmed, run.name, stored, lambda key: self._store(run, key), abandon)
        self.unseen.done(run.name, {expiration})
        return stored, version

    async def _abandon(self, run: Run, with_key: str, key_id: str) -> None:
        try:
            async with self.access.open(run.endpoint, with_key) as hs:
                await hs.expire_api_key(key_id=key_id)
        except HeadscaleError as exc:
            log.warning("could not expire a working key whose Secret was not written", key_id=key_id,
                        error=str(exc))

    async def _rotate(self, run: Run, old: StoredKey) -> tuple[StoredKey, str]:
        try:
            new, version = await self._mint(run, KeySource.WORKING, previous=old)
        except Unauthorized:
            new, version = await self._mint(run, KeySource.BOOTSTRAP, previous=old)
        await self.events.normal(run.obj, "WorkingKeyRotated", f"rotated the working key: {old.prefix} -> {new.prefix}",
                                 action="Rotate")
        if self.after_store is not None:
            await self.after_store()
        return await self._expire_previous(run, new), version

    async def _expire_previous(self, run: Run, stored: StoredKey) -> StoredKey:
        async def expire(key: StoredKey) -> None:
            try:
                async with self.access.open(run.endpoint, key.key) as hs:
                    await hs.expire_api_key(key_id=key.previous_id)
            except HeadscaleError as exc:
                if not _gone(exc):
                    raise problem_from(exc, "expiring the previous working key") from exc

        return await finish(stored, lambda key: self._store(run, key), expire)

    def _stored(self, key: str, info: ApiKey, lifetime: timedelta, *, previous_id: str) -> StoredKey:
        created = info.created_at or self.clock.utcnow()
        return StoredKey(key=key, id=info.id, prefix=info.prefix, created_at=created,
                         expires_at=info.expiration or created + lifetime, previous_id=previous_id)

    async def _store(self, run: Run, stored: StoredKey) -> None:
        await self.writer.apply(SECRET, stored.secret(owned_metadata(
            run.obj, name=working_key_secret_name(run.name), namespace=self.namespace, tailnet=run.name)))

    # -- deletion -------------------------------------------------------------------------------

    async def _finalize(self, obj: JSON) -> Result:
        if not finalizer.holds(obj):
            return Result()
        try:
            tailnet = self.reader.get(Tailnet, obj["metadata"]["name"])
        except ValidationError:
            tailnet = None
        if tailnet is None:
            await finalizer.release(self.writer, TAILNET, obj)  # no key can have been minted
            return Result()
        stored = self.access.stored_key(tailnet)
        if stored is not None:
            again = await self.cleanup.run(
                obj, lambda: self._expire_working_key(obj, tailnet, stored), what=f"the working key {stored.prefix}",
                reason="WorkingKeyNotExpired", hint="expire it by hand (headscale apikeys expire)",
                final=lambda exc: isinstance(exc, HeadscaleError) and _gone(exc))
            if again is not None:
                return again
        await finalizer.release(self.writer, TAILNET, obj)
        return Result()

    async def _expire_working_key(self, obj: JSON, tailnet: Tailnet, stored: StoredKey) -> None:
        async with self.access.open(self.access.endpoint(tailnet), stored.key) as hs:
            await hs.expire_api_key(key_id=stored.id)
        await self.events.normal(obj, "WorkingKeyExpired",
                                 f"expired the working key {stored.prefix} of the deleted Tailnet", action="Expire")


NETWORK_REASONS = frozenset({"Unreachable", "TLSError"})
"""Problems of reaching Headscale: the key's validity is unknown, Headscale is not reachable."""

LOCAL_REASONS = frozenset({"BootstrapSecretMissing", "BootstrapKeyMissing", "CASecretMissing"})
"""Problems found before any request: Headscale was not contacted, so its reachability is unknown."""


def _transport_conditions(tailnet: Tailnet) -> list[Cond]:
    """InsecureTransport, present (True, a warning) only while allowInsecureHTTP lets a URL be http://."""
    cleartext = [f"{field} {url}" for field, url in tailnet.spec.cleartext_urls()]
    if not cleartext:
        return []
    return [Cond("InsecureTransport", "True", "AllowInsecureHTTP",
                f"{', '.join(cleartext)}: the operator's admin key and the agents' control traffic cross the "
                "network in clear (allowInsecureHTTP: true); serve Headscale over https and unset it")]


def _failure_conditions(problem: Problem) -> list[Cond]:
    """Ready, KeyValid and Reachable for a reconcile that found no working access.

    Reachable says only what a request showed: True when Headscale answered (even with a
    refusal), False when it did not, Unknown when no request was made.
    """
    key_valid: Status
    reachable: Status
    if problem.reason in NETWORK_REASONS:
        key_valid, reachable = "Unknown", "False"
    elif problem.reason in LOCAL_REASONS:
        key_valid, reachable = "False", "Unknown"
    else:
        key_valid, reachable = "False", "True"
    return [Cond("Ready", "False", problem.reason, problem.message),
            Cond("KeyValid", key_valid, problem.reason, problem.message),
            Cond("Reachable", reachable, problem.reason, problem.message)]


def _gone(exc: HeadscaleError) -> bool:
    """The key is already expired or deleted, or the credential no longer exists."""
    return isinstance(exc, Unauthorized | NotFound)


def rotation_due(stored: StoredKey, tailnet: Tailnet) -> datetime:
    """Half the working key's lifetime (the Tailnet's ``apiKeyLifetime`` when Headscale gave none)."""
    lifetime = stored.expires_at - stored.created_at
    if lifetime <= timedelta(0):
        lifetime = timedelta(seconds=parse_go_duration(tailnet.spec.api_key_lifetime))
    return stored.created_at + lifetime / 2


def bootstrap_ref(tailnet: Tailnet) -> str:
    ref = tailnet.spec.bootstrap_key_secret_ref
    return f"{ref.namespace}/{ref.name} (key {ref.key})"


def bootstrap_key(reader: Reader, tailnet: Tailnet) -> str:
    """The bootstrap API key from the Secret the Tailnet names; :class:`Problem` when it is not there."""
    ref = tailnet.spec.bootstrap_key_secret_ref
    secret = reader.get(SECRET, ref.name, ref.namespace)
    if secret is None:
        raise Problem("BootstrapSecretMissing",
                      f"the bootstrap Secret {ref.namespace}/{ref.name} does not exist; create it with a "
                      f"Headscale API key under the key {ref.key}")
    raw = (secret.get("data") or {}).get(ref.key)
    if not raw:
        raise Problem("BootstrapKeyMissing", f"the bootstrap Secret {ref.namespace}/{ref.name} has no key {ref.key}")
    return base64.b64decode(raw).decode().strip()
