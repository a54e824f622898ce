"""Pieces every kind shares: the model base, Conditions, references and constrained strings.

Each constrained type validates in Python *and* carries the OpenAPI/CEL rule the apiserver
enforces, so the operator, the samples and the CRD can never disagree about what is valid.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

GROUP = "tailnet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Tailscale clients (tailcfg.CheckTag) need a letter after "tag:" and only letters, digits and
# dashes; Headscale's policy compares tags case-sensitively, so we also insist on lower case.
TAG_PATTERN = r"^tag:[a-z][a-z0-9-]*$"
# A tag, or a prefix of tags ending in ``*`` (``tag:shop-*``): what a tenant may use.
TAG_GLOB_PATTERN = r"^tag:[a-z][a-z0-9-]*\*?$"
# A DNS name, or ``*.`` then a DNS name (every name under it, any depth): what a tenant may serve.
DNS_NAME_GLOB_PATTERN = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# RFC 1035 label: what a Service name must be (starts with a letter).
DNS1035_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
GO_DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
URL_PATTERN = r"^https?://[^\s/?#]+([/?#]\S*)?$"
IMAGE_PATTERN = r"^[^\s]+$"
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"  # noqa: E501
# Longest textual IPv6 address (39) plus "/128".
CIDR_MAX_LENGTH = 43
IP_MAX_LENGTH = 39


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One ``x-kubernetes-validations`` entry; ``field_path`` points the error at a child."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def cel_string(text: str) -> str:
    """A CEL raw string literal, so regex backslashes need no second escaping."""
    if "'" in text:
        raise ValueError(f"cannot quote {text!r} as a CEL raw string")
    return f"r'{text}'"


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    """A ``json_schema_extra`` mapping carrying CEL rules."""
    return {"x-kubernetes-validations": list(rules)}


def duplicates(values: list[str]) -> list[str]:
    """The values that occur more than once, in first-seen order (mirrors CEL uniqueness rules)."""
    seen: set[str] = set()
    dups: list[str] = []
    for value in values:
        if value in seen and value not in dups:
            dups.append(value)
        seen.add(value)
    return dups


class ApiModel(BaseModel):
    """Base of every spec/status piece: camelCase on the wire, snake_case in Python.

    Unknown fields are rejected because the apiserver prunes them anyway: a stray field in a
    sample or in a test object is a typo, not data.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict the apiserver expects (absent optionals are omitted, not null)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- constrained strings ---------------------------------------------------------------------


def check_cidr(value: str) -> str:
    if "/" not in value:
        raise ValueError(f"{value!r} is not a CIDR: it needs a prefix length such as /24")
    try:
        iface = ipaddress.ip_interface(value)
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid CIDR") from exc
    if iface.ip != iface.network.network_address:
        raise ValueError(f"{value!r} has host bits set; use {iface.network}")
    return value


def _check_ip(value: str) -> str:
    if "%" in value:
        raise ValueError(f"{value!r}: zoned addresses are not allowed")
    try:
        ipaddress.ip_address(value)
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid IP address") from exc
    return value


_HOSTNAME_RE = re.compile(DNS_SUBDOMAIN_PATTERN)
NUMERIC_NAME_PATTERN = r"^[0-9]+(\.[0-9]+)*$"
"""A name whose labels are all digits: never a host name, most often a mistyped IPv4 address."""
NUMERIC_NAME_MESSAGE = (
    "is neither a valid IP address nor a DNS name: a name whose labels are all numeric is refused "
    "(a mistyped IPv4 address, e.g. a part over 255?)"
)
_NUMERIC_NAME_RE = re.compile(NUMERIC_NAME_PATTERN)


def _check_address(value: str) -> str:
    if _NUMERIC_NAME_RE.match(value):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} {NUMERIC_NAME_MESSAGE}") from None
        return value
    if _HOSTNAME_RE.match(value):
        return value
    return _check_ip(value)


def parse_go_duration(value: str) -> float:
    """Seconds in a Go duration string such as ``2160h`` or ``1h30m``."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    if not re.fullmatch(GO_DURATION_PATTERN, value):
        raise ValueError(f"{value!r} is not a Go duration such as 720h or 1h30m")
    return sum(
        float(num) * units[unit]
        for num, unit in re.findall(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)", value)
    )


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 100m or 64Mi")
    return value


_CIDR_RULES = [
    cel("isCIDR(self)", "must be a valid CIDR such as 192.168.50.0/24"),
    cel(
        "!isCIDR(self) || cidr(self) == cidr(self).masked()",
        "must not have host bits set: use the network address, e.g. 192.168.50.0/24",
    ),
]


def cidr_json_schema(*extra_rules: dict[str, str]) -> WithJsonSchema:
    """The CRD schema of a CIDR string, optionally with further CEL rules."""
    return WithJsonSchema(
        {
            "type": "string",
            "maxLength": CIDR_MAX_LENGTH,
            "x-kubernetes-validations": [*_CIDR_RULES, *extra_rules],
        }
    )


CIDR = Annotated[str, AfterValidator(check_cidr), cidr_json_schema()]
"""An IPv4 or IPv6 network in CIDR notation with no host bits set."""

IPAddress = Annotated[
    str,
    AfterValidator(_check_ip),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": IP_MAX_LENGTH,
            "x-kubernetes-validations": [cel("isIP(self)", "must be a valid IP address")],
        }
    ),
]

Address = Annotated[
    str,
    AfterValidator(_check_address),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 253,
            "x-kubernetes-validations": [
                cel(
                    f"isIP(self) || self.matches({cel_string(DNS_SUBDOMAIN_PATTERN)})",
                    "must be an IP address or a lower-case DNS name",
                ),
                cel(f"isIP(self) || !self.matches({cel_string(NUMERIC_NAME_PATTERN)})", NUMERIC_NAME_MESSAGE),
            ],
        }
    ),
]
"""An IP address or a DNS name reachable over the tailnet."""

Tag = Annotated[str, StringConstraints(pattern=TAG_PATTERN, max_length=63)]
"""A Tailscale ACL tag: ``tag:`` then a lower-case letter, then letters, digits or dashes."""

TagGlob = Annotated[str, StringConstraints(pattern=TAG_GLOB_PATTERN, max_length=63)]
"""A tag (``tag:shop-web``) or a prefix of tags (``tag:shop-*``)."""
DNSNameGlob = Annotated[str, StringConstraints(pattern=DNS_NAME_GLOB_PATTERN, max_length=253)]
"""A DNS name (``web.shop.example.internal``) or every name under one (``*.shop.example.internal``)."""

DNSLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, max_length=63)]
DNS1035Label = Annotated[str, StringConstraints(pattern=DNS1035_LABEL_PATTERN, max_length=63)]
DNSName = Annotated[str, StringConstraints(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]
ANY_HOST = "*"
"""The host name of an http expose that answers to any name no other host of its port answers to."""
HostName = Annotated[str, StringConstraints(pattern=r"^\*$|^\*\." + DNS_SUBDOMAIN_PATTERN[1:] + "|"
                                            + DNS_SUBDOMAIN_PATTERN, max_length=253)]
"""A host's DNS name, every name under one (``*.`` and the name), or :data:`ANY_HOST`."""
SecretKey = Annotated[str, StringConstraints(pattern=SECRET_KEY_PATTERN, max_length=253)]
HttpURL = Annotated[
    str,
    StringConstraints(pattern=URL_PATTERN, max_length=2048),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": URL_PATTERN,
            "maxLength": 2048,
            "x-kubernetes-validations": [
                cel("isURL(self) && url(self).getHost() != ''", "must be an absolute http(s) URL with a host")
            ],
        }
    ),
]
BoundedString = Annotated[str, StringConstraints(max_length=253)]
"""Free text in status lists, bounded so the object stays small."""
Image = Annotated[str, StringConstraints(pattern=IMAGE_PATTERN, min_length=1, max_length=512)]
Port = Annotated[int, Field(ge=1, le=65535, json_schema_extra={"format": "int32"})]
Generation = Annotated[int, Field(ge=0, json_schema_extra={"format": "int64"})]
Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]


def _rfc3339(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


Timestamp = Annotated[datetime, PlainSerializer(_rfc3339, return_type=str, when_used="json")]
"""A point in time, written as RFC 3339 in UTC with second precision like metav1.Time."""


# --- Conditions ------------------------------------------------------------------------------

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One aspect of the object's current state (the metav1.Condition shape)."""

    type: str = Field(
        description="Type of the condition in CamelCase, e.g. Ready.",
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: ConditionStatus = Field(description="Status of the condition: True, False or Unknown.")
    observed_generation: Generation | None = Field(
        default=None,
        description="The .metadata.generation the condition was set for; older means stale.",
    )
    last_transition_time: Timestamp = Field(
        description="When the condition last changed status (not when it was last checked).",
        json_schema_extra={"format": "date-time"},
    )
    reason: str = Field(
        description="A single CamelCase word naming why the condition has this status.",
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(
        description="A human-readable sentence with details; may be empty.", max_length=32768
    )


Conditions = Annotated[
    list[Condition],
    Field(
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
]


# --- references ------------------------------------------------------------------------------


class TailnetRef(ApiModel):
    """Names the cluster-scoped Tailnet this object belongs to."""

    name: DNSName = Field(description="Name of the Tailnet object.")


class NamespacedName(ApiModel):
    """Names an object in a given namespace."""

    namespace: DNSLabel = Field(description="Namespace of the object.")
    name: DNSName = Field(description="Name of the object.")


class SecretKeyRef(ApiModel):
    """A key in a Secret in a given namespace."""

    namespace: DNSLabel = Field(description="Namespace of the Secret.")
    name: DNSName = Field(description="Name of the Secret.")
    key: SecretKey = Field(description="Key within the Secret's data.")


class LocalSecretKeyRef(ApiModel):
    """A key in a Secret in the object's own namespace."""

    name: DNSName = Field(description="Name of the Secret.")
    key: SecretKey = Field(default="ca.crt", description="Key within the Secret's data. Defaults to ca.crt.")


class ObjectMeta(BaseModel):
    """The subset of metadata the operator reads; everything else is kept as-is."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    namespace: str | None = None
    generation: int | None = None
    uid: str | None = None
    resource_version: str | None = Field(default=None, alias="resourceVersion")
