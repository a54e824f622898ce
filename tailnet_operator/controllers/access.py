"""Headscale access for a Tailnet: its API URL, its CA bundle and the working key, in one place.

Every reconciler that talks to a Tailnet's Headscale composes one :class:`HeadscaleAccess`
(the Tailnet reconciler, which keeps the working key, and every other one, which only uses
it). The ``factory`` is the seam to the network: production opens a
:class:`~tailnet_operator.headscale.HeadscaleClient` over aiohttp; tests hand it one over a
``MockTransport``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import ValidationError

from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import (
    HeadscaleClient,
    HeadscaleError,
    RequestObserver,
    TransportError,
    installation_tag,
)
from tailnet_operator.names import working_key_secret_name
from tailnet_operator.runtime import SECRET, Clock, EventRecorder, Reader
from tailnet_operator.types import JSON

from .keyrecord import KeyRecord
from .kinds import TAILNET

__all__ = [
    "ClientFactory",
    "Connection",
    "Deps",
    "HeadscaleAccess",
    "NoAccess",
    "Problem",
    "StoredKey",
    "TailnetRun",
    "default_client_factory",
    "live_tailnet",
    "name_of",
    "problem_from",
    "working_key_secret_name",
]

KEY_FIELD = "apiKey"

ClientFactory = Callable[[str, str, str | None], HeadscaleClient]
"""(url, api key, CA bundle PEM or None) -> a Headscale client."""


def default_client_factory(url: str, api_key: str, ca_bundle: str | None) -> HeadscaleClient:
    return HeadscaleClient(url, api_key, ca_bundle=ca_bundle)


def observed_client_factory(observer: RequestObserver) -> ClientFactory:
    """The default factory, with every request reported to ``observer`` (the operator's metrics)."""

    def factory(url: str, api_key: str, ca_bundle: str | None) -> HeadscaleClient:
        return HeadscaleClient(url, api_key, ca_bundle=ca_bundle, observer=observer)

    return factory


def name_of(model: Any) -> str:
    """metadata.name of a parsed object (always set on objects read from the API)."""
    return str(model.metadata.name)


@dataclass
class Problem(Exception):
    """Why there is no working access, as a condition reason and a message for people."""

    reason: str
    message: str


def problem_from(exc: HeadscaleError, what: str) -> Problem:
    if isinstance(exc, TransportError):
        if exc.tls:
            return Problem("TLSError", f"TLS to Headscale failed while {what}: {exc}. Check caBundle/caSecretRef")
        return Problem("Unreachable", f"Headscale did not answer while {what}: {exc}")
    return Problem("HeadscaleError", f"Headscale refused {what}: {exc}")


class NoAccess(Exception):
    """The Tailnet reconciler has not stored a working key yet (or the CA cannot be read)."""


@dataclass(frozen=True, kw_only=True)
class StoredKey(KeyRecord):
    """The working key as the operator's Secret records it (:mod:`.keyrecord`)."""

    DATA_FIELD: ClassVar[str] = KEY_FIELD


@dataclass(frozen=True)
class Connection:
    """Where and how to reach one Tailnet's Headscale: URL, CA bundle (None: system roots), key, and
    the installation's marker (from the Tailnet's uid; None for a Tailnet that has none)."""

    url: str
    ca: str | None
    key: str = ""
    owner_tag: str | None = None


class HeadscaleAccess:
    """Opens Headscale clients for Tailnets, reading their Secrets from ``reader`` (the cache).

    ``namespace`` is the operator's, where the working keys live.
    """

    def __init__(self, reader: Reader, namespace: str, factory: ClientFactory = default_client_factory) -> None:
        self.reader = reader
        self.namespace = namespace
        self._factory = factory

    def endpoint(self, tailnet: Tailnet) -> Connection:
        """URL and CA of ``tailnet``'s Headscale, without a key; raises :class:`Problem` (CASecretMissing)."""
        uid = tailnet.metadata.uid
        return Connection(str(tailnet.spec.api_url or tailnet.spec.login_url), self._ca_bundle(tailnet),
                          owner_tag=installation_tag(uid) if uid else None)

    def agent_ca(self, tailnet: Tailnet) -> str | None:
        """The CA bundle agents trust for ``tailnet``'s Headscale (None: the system's, or a CA
        Secret that is missing, which the Tailnet's own status reports)."""
        try:
            return self.endpoint(tailnet).ca
        except Problem:
            return None

    def stored_key(self, tailnet: Tailnet) -> StoredKey | None:
        """The working key the Tailnet reconciler keeps in the operator's namespace, if any."""
        name = working_key_secret_name(name_of(tailnet))
        return StoredKey.from_secret(self.reader.get(SECRET, name, self.namespace))

    def working(self, tailnet: Tailnet) -> Connection:
        """The connection with the working key; raises :class:`NoAccess` when there is none yet."""
        stored = self.stored_key(tailnet)
        if stored is None:
            raise NoAccess("the Tailnet has no working API key yet; see its Ready condition")
        try:
            endpoint = self.endpoint(tailnet)
        except Problem as problem:
            raise NoAccess(problem.message) from problem
        return Connection(endpoint.url, endpoint.ca, stored.key, endpoint.owner_tag)

    def open(self, connection: Connection, key: str | None = None) -> HeadscaleClient:
        """A client for ``connection`` (with ``key`` instead of its own when given), acting for the
        connection's installation (its ``owner_tag``); use ``async with``."""
        client = self._factory(connection.url, key or connection.key, connection.ca)
        if connection.owner_tag is not None:
            client.owner_tag = connection.owner_tag
        return client

    def secrets_outside(self, tailnet: Tailnet) -> str:
        """Why the Tailnet's Secret references may not be read ("" when they may): only Secrets of the
        operator's namespace, so creating a Tailnet never reads (and sends to its URL) another's."""
        refs = [("bootstrapKeySecretRef", tailnet.spec.bootstrap_key_secret_ref),
                ("caSecretRef", tailnet.spec.ca_secret_ref)]
        outside = [f"{field} names {ref.namespace}/{ref.name}" for field, ref in refs
                   if ref is not None and ref.namespace != self.namespace]
        if not outside:
            return ""
        return (f"{'; '.join(outside)}: a Tailnet may name Secrets of the operator's namespace {self.namespace} "
                "only; nothing was read. Create the Secret there and point the reference at it")

    def _ca_bundle(self, tailnet: Tailnet) -> str | None:
        if tailnet.spec.ca_bundle:
            return tailnet.spec.ca_bundle
        ref = tailnet.spec.ca_secret_ref
        if ref is None:
            return None
        if outside := self.secrets_outside(tailnet):
            raise Problem("SecretOutsideOperatorNamespace", outside)
        secret = self.reader.get(SECRET, ref.name, ref.namespace)
        raw = (secret or {}).get("data", {}).get(ref.key)
        if not raw:
            raise Problem("CASecretMissing", f"the CA Secret {ref.namespace}/{ref.name} has no key {ref.key}")
        return base64.b64decode(raw).decode()


@dataclass(frozen=True)
class Deps:
    """What every reconciler of a Tailnet's resources works with, besides its own Writer."""

    reader: Reader
    """The cache."""
    access: HeadscaleAccess
    events: EventRecorder
    clock: Clock


@dataclass(frozen=True)
class TailnetRun:
    """One reconcile of one Tailnet: the object as cached (events, owners, status) and as parsed."""

    obj: JSON
    tailnet: Tailnet

    @property
    def name(self) -> str:
        return name_of(self.tailnet)


def live_tailnet(reader: Reader, name: str) -> TailnetRun | None:
    """The Tailnet to reconcile: None when it is gone, being deleted, or invalid (the Tailnet
    reconciler reports InvalidSpec; nothing else has anything to work from)."""
    obj = reader.get(TAILNET, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return None
    try:
        tailnet = reader.get(Tailnet, name)
    except ValidationError:
        return None
    return None if tailnet is None else TailnetRun(obj, tailnet)
