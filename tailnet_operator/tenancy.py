"""Who may use a Tailnet from which namespace, and with which tags and DNS names.

The cluster admin declares it on the Tailnet (``spec.tenants``); a TailnetIngress is the only
kind a tenant creates, so it is the only kind judged here. The rules, as the admin reads them:

* A namespace named by no entry gets nothing (the safe default, also for a Tailnet without
  ``tenants``).
* A tag is available when an entry naming the namespace lists it, or a prefix of it
  (``tag:shop-*``). A *reserved* tag (one an egress, a gateway or a site router uses, or a grant
  source or route approver of the policy) is available only when listed by its exact name: a
  prefix never hands a tenant the platform's identities.
* A DNS name is available when it lies in one of the Tailnet's zones and an entry naming the
  namespace lists it, or a ``*.`` name above it.
* A name belongs to the first holder: an egress alias first, then ingresses ordered by
  creation time (then namespace and name, so every restart decides the same). A later
  claimant is refused, whatever the order the operator happens to see them in.
* A shared address (``spec.sharedAddress``) is available when it lies in one of the
  ``sharedAddresses`` ranges of an entry naming the namespace and in none of the Tailnet's
  ``reservedNetworks``; it belongs to its first holder as a name does.

Everything here is pure: the callers gather the Tailnet, the reserved tags and the claims, and
act on the :class:`Refusal` (a condition reason and a message that says what to ask for).
The same rules are enforced at admission by the ValidatingAdmissionPolicy
``tailnet-ingress-tenancy`` (manifests/chart/tailnet-operator/templates/admission.yaml), for the
parts that need no other object: namespace, tag and names.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tailnet_agent.contract.addresses import host_route
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.tailnet import Tailnet, TailnetTenant

__all__ = [
    "Claim",
    "Refusal",
    "claim_order",
    "claimed",
    "first_holders",
    "is_address",
    "judge",
    "name_allowed",
    "policy_reserved_tags",
    "shared_address_holders",
    "shared_routes",
    "shares_tag",
    "tag_allowed",
    "taken",
]


@dataclass(frozen=True)
class Refusal:
    """Why an ingress may not use the Tailnet as it asks: a condition reason and a message."""

    reason: str
    message: str


def tag_allowed(pattern: str, tag: str) -> bool:
    """Whether ``pattern`` (a tag, or a prefix ending in ``*``) lets a tenant use ``tag``."""
    return tag.startswith(pattern[:-1]) if pattern.endswith("*") else tag == pattern


def name_allowed(pattern: str, name: str) -> bool:
    """Whether ``pattern`` (a name, or ``*.`` and a name for every name under it) covers ``name``."""
    name, pattern = name.lower().rstrip("."), pattern.lower().rstrip(".")
    return name.endswith(pattern[1:]) if pattern.startswith("*.") else name == pattern


def in_zone(name: str, zone: str) -> bool:
    """Whether ``name`` is ``zone`` or under it (case and a trailing dot ignored)."""
    name, zone = name.lower().rstrip("."), zone.lower().rstrip(".")
    return name == zone or name.endswith("." + zone)


def _entries(tailnet: Tailnet, namespace: str) -> list[TailnetTenant]:
    return [t for t in tailnet.spec.tenants or [] if namespace in t.namespaces]


def shares_tag(tailnet: Tailnet, owner: str, namespace: str, tag: str) -> bool:
    """Whether ``namespace`` may put its Services behind the node of ``owner``'s namespace, which
    uses ``tag`` (an HTTPRoute of one namespace on a Gateway of another): it may use the tag
    itself. A prefix counts only when the owner also has the tag by a prefix only: then the owner's
    own judgment proved the tag reserved by nothing, which this function cannot see."""
    if namespace == owner:
        return True
    mine = [p for entry in _entries(tailnet, namespace) for p in entry.tags]
    if tag in mine:
        return True
    theirs = [p for entry in _entries(tailnet, owner) for p in entry.tags]
    return tag not in theirs and any(tag_allowed(p, tag) for p in mine)


def judge(ingress: TailnetIngress, tailnet: Tailnet, *, reserved: Iterable[str],
          names: Iterable[str]) -> Refusal | None:
    """Whether the namespace of ``ingress`` may use ``tailnet`` with its tag and ``names`` (the
    names it would write to the hosts file); None when it may."""
    namespace, tailnet_name = str(ingress.metadata.namespace), str(tailnet.metadata.name)
    entries = _entries(tailnet, namespace)
    if not entries:
        return Refusal("NamespaceNotTenant", (
            f"namespace {namespace} is not a tenant of the Tailnet {tailnet_name}; nothing was created on the "
            f"tailnet. To use it, {_ask('it', tailnet_name)} (an entry with namespaces: [{namespace}] and the "
            "tags and dnsNames it may use)"))
    tag = ingress.spec.tag
    patterns = [p for entry in entries for p in entry.tags]
    exact = tag in patterns
    if tag in set(reserved) and not exact:
        return Refusal("TagReserved", (
            f"{tag} is used by an egress, a gateway, a site router or the policy's grants and approvals, so "
            f"a tenant may use it only when the Tailnet {tailnet_name} lists it by its exact name for "
            f"namespace {namespace}; nothing was created on the tailnet. Choose another tag of "
            f"{', '.join(sorted(patterns))}, or {_ask(tag, tailnet_name)} by name"))
    if not exact and not any(tag_allowed(p, tag) for p in patterns):
        return Refusal("TagNotAllowed", (
            f"namespace {namespace} may use the tags {', '.join(sorted(patterns))} on the Tailnet "
            f"{tailnet_name}, not {tag}; nothing was created on the tailnet. Choose one of those, or "
            f"{_ask(tag, tailnet_name)}"))
    if (refusal := _address_refusal(ingress, tailnet, entries, namespace)) is not None:
        return refusal
    return _names_refusal(tailnet, entries, namespace, list(names))


def _address_refusal(ingress: TailnetIngress, tailnet: Tailnet, entries: list[TailnetTenant],
                     namespace: str) -> Refusal | None:
    if ingress.spec.shared_address is None:
        return None
    address, tailnet_name = ipaddress.ip_address(ingress.spec.shared_address), str(tailnet.metadata.name)
    reserved = [n for n in tailnet.spec.reserved_networks or [] if address in ipaddress.ip_network(n)]
    if reserved:
        return Refusal("SharedAddressReserved", (
            f"the sharedAddress {address} lies in the Tailnet {tailnet_name}'s reservedNetworks "
            f"({', '.join(reserved)}); nothing was created on the tailnet. Choose an address outside them"))
    ranges = [r for entry in entries for r in entry.shared_addresses or []]
    if not any(address in ipaddress.ip_network(r) for r in ranges):
        allowed = f"shared addresses from {', '.join(sorted(ranges))}" if ranges else "no shared addresses"
        return Refusal("SharedAddressNotAllowed", (
            f"namespace {namespace} may use {allowed} on the Tailnet {tailnet_name}, not {address}; nothing "
            f"was created on the tailnet. Choose an address in those ranges, or "
            f"{_ask('a range holding it', tailnet_name)} (sharedAddresses)"))
    return None


def claimed(ingress: TailnetIngress, names: Iterable[str]) -> tuple[str, ...]:
    """What an ingress claims against every other object: its ``names`` and its shared address."""
    shared = () if ingress.spec.shared_address is None else (str(ipaddress.ip_address(ingress.spec.shared_address)),)
    return (*names, *shared)


def shared_address_holders(ingresses: Iterable[TailnetIngress]) -> list[TailnetIngress]:
    """The ingresses that hold their shared address (its first claimant, by :func:`claim_order`), so
    only their tag is approved for it; a later claimant is refused (``SharedAddressTaken``)."""
    holders: dict[str, TailnetIngress] = {}
    ranked = sorted((i for i in ingresses if i.spec.shared_address is not None),
                    key=lambda i: claim_order({"metadata": i.metadata.model_dump(by_alias=True, mode="json")}))
    for ingress in ranked:
        holders.setdefault(str(ipaddress.ip_address(str(ingress.spec.shared_address))), ingress)
    return list(holders.values())


def shared_routes(ingresses: Iterable[TailnetIngress], tailnet: Tailnet) -> dict[str, set[str]]:
    """``{shared-address route: the tags of the ingresses claiming it}`` (for :func:`policy_reserved_tags`),
    of the ingresses whose namespace the Tailnet grants that address: a claim the admin did not grant
    never unreserves a tag."""
    routes: dict[str, set[str]] = {}
    for ingress in ingresses:
        entries = _entries(tailnet, str(ingress.metadata.namespace))
        if ingress.spec.shared_address is not None and entries and _address_refusal(
                ingress, tailnet, entries, str(ingress.metadata.namespace)) is None:
            routes.setdefault(host_route(ingress.spec.shared_address), set()).add(ingress.spec.tag)
    return routes


def is_address(claim: str) -> bool:
    """Whether a claimed string is a shared address (the rest are DNS names)."""
    try:
        ipaddress.ip_address(claim)
    except ValueError:
        return False
    return True


def _ask(what: str, tailnet: str) -> str:
    return f"ask the cluster admin to add {what} to spec.tenants of the Tailnet {tailnet}"


def _names_refusal(tailnet: Tailnet, entries: list[TailnetTenant], namespace: str,
                   names: list[str]) -> Refusal | None:
    if tailnet.spec.dns is None:
        return None  # no hosts file: no name is written anywhere
    zones = [str(z) for z in tailnet.spec.dns.zones]
    outside = [n for n in names if not any(in_zone(n, z) for z in zones)]
    if outside:
        return Refusal("DNSNameOutsideZones", (
            f"{', '.join(outside)} {'is' if len(outside) == 1 else 'are'} not in the Tailnet's DNS zones "
            f"({', '.join(zones)}); nothing was created on the tailnet. Use names under those zones"))
    patterns = [p for entry in entries for p in entry.dns_names or []]
    denied = [n for n in names if not any(name_allowed(p, n) for p in patterns)]
    if denied:
        allowed = f"the names {', '.join(sorted(patterns))}" if patterns else "no DNS names"
        return Refusal("DNSNameNotAllowed", (
            f"namespace {namespace} may use {allowed} on the Tailnet {tailnet.metadata.name}, not "
            f"{', '.join(denied)}; nothing was created on the tailnet. Use an allowed name, or "
            f"{_ask('the name', str(tailnet.metadata.name))} (dnsNames)"))
    return None


@dataclass(frozen=True, order=True)
class Claim:
    """Who claims names, in the order that decides between claimants (lowest first)."""

    rank: tuple[int, str, str, str]
    """(0 for an egress, 1 for an ingress; creation time; namespace; name)."""
    names: tuple[str, ...]

    @property
    def holder(self) -> str:
        kind = "TailnetEgress" if self.rank[0] == 0 else "TailnetIngress"
        return f"{kind} {self.rank[2]}/{self.rank[3]}"


def claim_order(obj: Mapping[str, Any], *, egress: bool = False) -> tuple[int, str, str, str]:
    """The rank of an object as stored: its kind, then ``creationTimestamp``, namespace and name
    (RFC 3339 in UTC sorts as text)."""
    meta = obj.get("metadata") or {}
    return (0 if egress else 1, str(meta.get("creationTimestamp") or ""), str(meta.get("namespace") or ""),
            str(meta.get("name") or ""))


def first_holders(claims: Iterable[Claim]) -> dict[str, Claim]:
    """``{name: the claim that holds it}``: every name goes to its lowest-ranked claimant."""
    holders: dict[str, Claim] = {}
    for claim in sorted(claims):
        for name in claim.names:
            holders.setdefault(name.lower().rstrip("."), claim)
    return holders


def taken(names: Iterable[str], mine: tuple[int, str, str, str], holders: Mapping[str, Claim]) -> Refusal | None:
    """The refusal of a claimant ranked ``mine`` whose ``names`` (or shared address, :func:`claimed`)
    another claimant holds."""
    clashes = [(n, holders[n]) for n in (x.lower().rstrip(".") for x in names)
               if n in holders and holders[n].rank != mine]
    if not clashes:
        return None
    if addresses := [(n, c) for n, c in clashes if is_address(n)]:
        described = "; ".join(f"{n} is held by {c.holder}" for n, c in addresses)
        return Refusal("SharedAddressTaken", (
            f"the sharedAddress {described}; nothing was created on the tailnet. An address belongs to "
            "whoever claimed it first (ingresses by creation time): choose another address"))
    described = "; ".join(f"{n} is held by {c.holder}" for n, c in clashes)
    return Refusal("DNSNameTaken", (
        f"{described}; nothing was created on the tailnet. A name belongs to whoever claimed it first "
        "(egress aliases, then ingresses by creation time): choose another name"))


def policy_reserved_tags(policy: Mapping[str, Any], *, shared: Mapping[str, set[str]] | None = None) -> set[str]:
    """Tags a parsed policy uses as grant or ACL sources and as route or exit-node approvers.

    ``shared`` maps each ingress's shared-address route (``198.18.5.10/32``) to the tags of the
    ingresses claiming it: a route approved for those tags alone is what the operator renders for
    them (:func:`shared_routes`), not a platform identity, so it reserves nothing (else an ingress
    given a shared address would find its own tag reserved on its next pass)."""
    tags: set[str] = set()
    for section in ("grants", "acls"):
        for rule in policy.get(section) or []:
            if isinstance(rule, Mapping):
                tags.update(s for s in rule.get("src") or [] if isinstance(s, str) and s.startswith("tag:"))
    approvers = policy.get("autoApprovers") or {}
    if isinstance(approvers, Mapping):
        for route, approved in (approvers.get("routes") or {}).items():
            found = {a for a in approved or [] if isinstance(a, str) and a.startswith("tag:")}
            if shared and found <= shared.get(str(route), set()):
                continue
            tags.update(found)
        tags.update(a for a in approvers.get("exitNode") or [] if isinstance(a, str) and a.startswith("tag:"))
    return tags
