"""Typed results of the Headscale API: small frozen dataclasses built from the REST JSON.

Ids stay strings, as on the wire (uint64 encoded as strings). Timestamps become aware UTC
datetimes; a JSON ``null`` becomes None. Secret keys are left out of every repr; use
:func:`mask_key` to show one.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tailnet_operator.types import JSON

API_KEY_PREFIX = "hskey-api-"
AUTH_KEY_PREFIX = "hskey-auth-"
_PUBLIC_PREFIX_CHARS = 12
"""Length of the public part of an ``hskey-*`` key: ``hskey-api-{12}-{64 secret}``."""


def mask_key(key: str) -> str:
    """The form Headscale itself lists a key in: the public prefix plus ``***``, never the secret.

    ``hskey-api-AbCdEfGhIjKl-<secret>`` gives ``hskey-api-AbCdEfGhIjKl-***``; a legacy
    ``abcdefg.<secret>`` key gives ``abcdefg.***``; anything else gives ``***``.
    """
    for kind in (API_KEY_PREFIX, AUTH_KEY_PREFIX):
        if key.startswith(kind):
            return f"{kind}{key[len(kind):len(kind) + _PUBLIC_PREFIX_CHARS]}-***"
    if "." in key:
        return f"{key.split('.', 1)[0]}.***"
    return "***"


def raw_api_key_prefix(value: str) -> str:
    """The bare public prefix (12 chars, or 7 for legacy keys) of a full key, masked form or prefix.

    The bare prefix is what goes into a URL: the secret must never travel in a path.
    """
    if value.startswith(API_KEY_PREFIX):
        return value[len(API_KEY_PREFIX):len(API_KEY_PREFIX) + _PUBLIC_PREFIX_CHARS]
    # Legacy keys: "abcdefg.<secret>"; 0.26/0.27 list the bare prefix, 0.28+ "abcdefg***".
    return value.split(".", 1)[0].removesuffix("***")


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 timestamp as an aware datetime (nanoseconds truncated); None for null or ""."""
    if not value:
        return None
    parsed = dt.datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


def _str_id(value: Any) -> str:
    return "" if value is None else str(value)


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value or ())


@dataclass(frozen=True)
class User:
    id: str
    name: str
    created_at: dt.datetime | None
    display_name: str = ""
    email: str = ""
    provider: str = ""
    provider_id: str = ""
    profile_pic_url: str = ""

    @classmethod
    def from_json(cls, doc: JSON) -> User:
        return cls(id=_str_id(doc.get("id")), name=str(doc.get("name") or ""),
                   created_at=parse_time(doc.get("createdAt")), display_name=str(doc.get("displayName") or ""),
                   email=str(doc.get("email") or ""), provider=str(doc.get("provider") or ""),
                   provider_id=str(doc.get("providerId") or ""),
                   profile_pic_url=str(doc.get("profilePicUrl") or ""))


@dataclass(frozen=True)
class ApiKey:
    """An API key as listed: ``prefix`` is Headscale's masked form (``hskey-api-{12}-***``)."""

    id: str
    prefix: str
    expiration: dt.datetime | None
    created_at: dt.datetime | None
    last_seen: dt.datetime | None

    @classmethod
    def from_json(cls, doc: JSON) -> ApiKey:
        return cls(id=_str_id(doc.get("id")), prefix=str(doc.get("prefix") or ""),
                   expiration=parse_time(doc.get("expiration")), created_at=parse_time(doc.get("createdAt")),
                   last_seen=parse_time(doc.get("lastSeen")))


class NewApiKey(NamedTuple):
    """A freshly created API key: ``key, info = await hs.create_api_key(...)``.

    ``key`` is shown only this once: store it now. ``info`` is the key as listed (id, masked
    prefix, timestamps). The repr masks the key.
    """

    key: str
    info: ApiKey

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def prefix(self) -> str:
        """The masked form, equal to :attr:`ApiKey.prefix` of the listed key."""
        return mask_key(self.key)

    def __repr__(self) -> str:
        return f"NewApiKey(key={mask_key(self.key)!r}, info={self.info!r})"


@dataclass(frozen=True)
class PreAuthKey:
    """A pre-auth key. ``key`` is complete only in the create response; lists show it masked.

    ``user`` is None for a tag-only key. Nodes that register with a tagged key get ``acl_tags``.
    """

    id: str
    key: str = field(repr=False)
    user: User | None
    reusable: bool
    ephemeral: bool
    used: bool
    expiration: dt.datetime | None
    created_at: dt.datetime | None
    acl_tags: tuple[str, ...]

    @property
    def masked_key(self) -> str:
        return mask_key(self.key)

    @classmethod
    def from_json(cls, doc: JSON) -> PreAuthKey:
        user = doc.get("user")
        return cls(id=_str_id(doc.get("id")), key=str(doc.get("key") or ""),
                   user=User.from_json(user) if user else None, reusable=bool(doc.get("reusable")),
                   ephemeral=bool(doc.get("ephemeral")), used=bool(doc.get("used")),
                   expiration=parse_time(doc.get("expiration")), created_at=parse_time(doc.get("createdAt")),
                   acl_tags=_strings(doc.get("aclTags")))


def _node_tags(doc: JSON) -> tuple[str, ...]:
    """``tags`` (0.28+), or before 0.28 the tags in force: ``forcedTags`` plus ``validTags``."""
    if "tags" in doc:
        return _strings(doc.get("tags"))
    return tuple(dict.fromkeys(_strings(doc.get("forcedTags")) + _strings(doc.get("validTags"))))


@dataclass(frozen=True)
class Node:
    """A machine in the tailnet.

    Routes: ``available_routes`` are what the node advertises, ``approved_routes`` what an admin
    or auto-approver allowed (a route is served only if it is in both), and ``subnet_routes``
    what is actually served. ``subnet_routes`` is filled in by list, not by get, in 0.29.
    ``user`` is None for tagged nodes in get (list shows the placeholder user ``tagged-devices``).
    """

    id: str
    name: str
    given_name: str
    user: User | None
    ip_addresses: tuple[str, ...]
    tags: tuple[str, ...]
    online: bool
    approved_routes: tuple[str, ...]
    available_routes: tuple[str, ...]
    subnet_routes: tuple[str, ...]
    last_seen: dt.datetime | None
    expiry: dt.datetime | None
    created_at: dt.datetime | None
    register_method: str = ""
    machine_key: str = ""
    node_key: str = ""
    pre_auth_key_id: str | None = None

    @property
    def is_tagged(self) -> bool:
        return bool(self.tags)

    @classmethod
    def from_json(cls, doc: JSON) -> Node:
        user = doc.get("user")
        pak = doc.get("preAuthKey")
        return cls(id=_str_id(doc.get("id")), name=str(doc.get("name") or ""),
                   given_name=str(doc.get("givenName") or ""), user=User.from_json(user) if user else None,
                   ip_addresses=_strings(doc.get("ipAddresses")), tags=_node_tags(doc),
                   online=bool(doc.get("online")), approved_routes=_strings(doc.get("approvedRoutes")),
                   available_routes=_strings(doc.get("availableRoutes")),
                   subnet_routes=_strings(doc.get("subnetRoutes")), last_seen=parse_time(doc.get("lastSeen")),
                   expiry=parse_time(doc.get("expiry")), created_at=parse_time(doc.get("createdAt")),
                   register_method=str(doc.get("registerMethod") or ""),
                   machine_key=str(doc.get("machineKey") or ""), node_key=str(doc.get("nodeKey") or ""),
                   pre_auth_key_id=_str_id(pak.get("id")) if isinstance(pak, dict) else None)


class Policy(NamedTuple):
    """The stored policy: ``text, updated_at = await hs.get_policy()``.

    ``text`` is the HuJSON exactly as last stored, ``""`` when none was ever stored (Headscale
    then allows all traffic); ``updated_at`` is None then, and in file mode.
    """

    text: str
    updated_at: dt.datetime | None

    @classmethod
    def from_json(cls, doc: JSON) -> Policy:
        return cls(text=str(doc.get("policy") or ""), updated_at=parse_time(doc.get("updatedAt")))


@dataclass(frozen=True)
class Health:
    """``GET /api/v1/health``: the key was accepted and the database answers."""

    database_connectivity: bool
