"""Base policy + derived entries -> the document the operator publishes (and, in Apply, writes).

Rules, all in service of "the base wins and nothing is removed":

* The base is copied as is: no key is removed, reordered or rewritten, unknown blocks and fields
  stay where they are. Derived entries go after the base's own, in the sorted order of
  :class:`~tailnet_operator.policy.derive.Derived`; a missing block is added at the end.
* ``tagOwners``: a tag the base already owns is left alone, whatever its owners.
* ``autoApprovers.routes``: a route key the base already has is left alone (a derived approver it
  lacks is reported in ``skipped``, since that router stays unapproved). A route the base already
  approves for the tag through a wider prefix is not repeated.
* ``grants``: a derived grant is added only when the base's grants and acls do not already allow
  every port of it. When the base has neither ``acls`` nor ``grants`` Headscale allows all
  traffic, and adding a grant would turn that into deny-all-but-this, so nothing is added (and
  the skip is reported). A grant to a DNS name is added only if ``hosts`` defines the name.

* A Headscale older than 0.29 has no ``grants`` (``render(..., grants=False)``): each derived
  grant is written as the ``acls`` entry that allows the same (``accept``, its ``src``, ``proto:
  tcp``, ``dst`` ``<address>:<port>``), and a base that has a ``grants`` block of its own is
  reported in ``unsupported`` (that server cannot apply it; the caller must not write it).

The same check ("does the policy already give the CRs this?") drives :func:`missing`, so a
rendered document never reports anything missing except what was skipped.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tailnet_operator.policy.cache import ParsedPolicies
from tailnet_operator.policy.derive import (
    PARSE_CACHE_SIZE,
    Derived,
    Grant,
    IPNetwork,
    RouteApproval,
    TagOwner,
    parse_address,
)
from tailnet_operator.policy.hujson import (
    JSONObject,
    PolicyParseError,
    TextMemo,
    canonical_text,
    find_key,
    parse_hujson,
    validate_structure,
)
from tailnet_operator.policy.patch import Block, Entry, Layout, Patch, one_line, strings

# In Headscale 0.29 "*" means the tailnet's own ranges, not every address (headscale-api.md §2).
_TAILNET_RANGES: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("100.64.0.0/10"),
    ipaddress.ip_network("fd7a:115c:a1e0::/48"),
)


@dataclass(frozen=True)
class Skipped:
    """A derived entry that was not added although the policy lacks it, why, and the CRs it came from."""

    kind: Literal["route", "grant"]
    entry: str
    reason: str
    sources: tuple[str, ...] = ()
    """e.g. ``("TailnetSite branch",)``; empty when the derivation named no source."""


@dataclass(frozen=True)
class Added:
    """What a render appended to the base, for status and events."""

    tag_owners: tuple[TagOwner, ...] = ()
    routes: tuple[RouteApproval, ...] = ()
    grants: tuple[Grant, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.tag_owners or self.routes or self.grants)


@dataclass(frozen=True)
class Rendered:
    """The rendered policy: ``text`` (the base's HuJSON with the entries inserted, or canonical JSON
    when rendered from a document alone), the same as ``document``, and the text's sha256 ``hash``."""

    text: str
    document: JSONObject = field(compare=False, hash=False)
    hash: str
    added: Added
    skipped: tuple[Skipped, ...] = ()
    grants_as_acls: bool = False
    """The server has no grants: ``added.grants`` went into ``acls`` as equivalent entries."""
    unsupported: tuple[str, ...] = ()
    """Blocks of the base the server cannot understand (``grants`` before Headscale 0.29)."""


@dataclass(frozen=True)
class Missing:
    """What the CRs need but a live policy lacks, and a HuJSON snippet a person can merge."""

    tag_owners: tuple[TagOwner, ...] = ()
    routes: tuple[RouteApproval, ...] = ()
    grants: tuple[Grant, ...] = ()
    notes: tuple[str, ...] = ()
    snippet: str = ""

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(owner.tag for owner in self.tag_owners)

    @property
    def empty(self) -> bool:
        return not (self.tag_owners or self.routes or self.grants)


# --- reading a policy ------------------------------------------------------------------------


def _member(obj: Mapping[str, Any], name: str, default: Any) -> Any:
    key = find_key(obj, name)
    return default if key is None else obj[key]


def _as_network(text: Any) -> IPNetwork | None:
    return _network_of(text) if isinstance(text, str) else None


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _network_of(text: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        return None


class _Approvals:
    """``autoApprovers.routes`` by network, for "does some key equal to or containing this route
    list this approver?" (Headscale's rule) without walking every key for every route."""

    def __init__(self, routes: Mapping[str, Any]) -> None:
        self._by_network: dict[IPNetwork, list[Any]] = {}
        self._lengths: dict[int, set[int]] = {4: set(), 6: set()}
        for key, approvers in routes.items():
            self.add(key, approvers)

    def add(self, key: str, approvers: Any) -> None:
        network = _as_network(key)
        if network is not None:
            self._by_network.setdefault(network, []).append(approvers)
            self._lengths[network.version].add(network.prefixlen)

    def approved(self, route: IPNetwork, approver: str) -> bool:
        bits = route.max_prefixlen
        address = int(route.network_address)
        for length in self._lengths[route.version]:
            if length > route.prefixlen:
                continue
            supernet = ipaddress.ip_network((address >> (bits - length) << (bits - length), length))
            if any(approver in approvers for approvers in self._by_network.get(supernet, ())):
                return True
        return False


class Replay:
    """Which routes a node advertised the operator approves on it: ``policy`` is the rendered
    document (what Headscale enforces), ``derived`` what the CRs asked for.

    A route is approved for a node when one of the node's tags is a derived approver of it (a
    site's router tag, the gateway's tag for its range and egress host routes) *and* the policy's
    ``autoApprovers.routes`` approve it for that same tag (an equal or wider key listing the tag,
    Headscale's rule). A derived approval the render left out because the base wins is never
    replayed: the base's approvers decide that route.
    """

    def __init__(self, policy: Mapping[str, Any], derived: Derived) -> None:
        routes = _member(_member(policy, "autoApprovers", {}), "routes", {})
        self._policy = _Approvals(routes if isinstance(routes, Mapping) else {})
        self._derived = _Approvals({entry.route: entry.approvers for entry in derived.routes})

    def routes(self, tags: Iterable[str], available: Iterable[str], approved: Iterable[str]) -> list[str]:
        """What to add to the node's approved routes: sorted, empty when there is nothing to replay."""
        node_tags = sorted(set(tags))
        out = []
        for route in sorted(set(available) - set(approved)):
            network = _as_network(route)
            if network is not None and any(self._derived.approved(network, tag) and self._policy.approved(network, tag)
                                           for tag in node_tags):
                out.append(route)
        return out


def routes_to_approve(policy: Mapping[str, Any], derived: Derived, tags: Iterable[str], available: Iterable[str],
                      approved: Iterable[str]) -> list[str]:
    """Routes a node advertises, not yet approved, that the rendered ``policy`` approves for one of its
    tags as a derived approval asked (see :class:`Replay`).

    What Headscale's auto-approval would have granted had the policy existed when the node
    advertised them (it only approves on advertisement): site routes, the gateway's routes and
    load-balancer range, egress host routes. Sorted; empty when there is nothing to replay.
    """
    return Replay(policy, derived).routes(tags, available, approved)


def _port_spec_covers(spec: str, port: int) -> bool:
    for part in spec.split(","):
        part = part.strip()
        if part == "*":
            return True
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            continue
        if first <= port <= last:
            return True
    return False


def _ip_covers(entries: Sequence[str], port: int) -> bool:
    """Whether a grant's ``ip`` list allows TCP ``port`` ("*", "tcp:443", "80-90", "tcp:*")."""
    for entry in entries:
        if entry == "*":
            return True
        proto, colon, ports = entry.rpartition(":")
        if colon and proto.lower() not in ("tcp", "6"):
            continue
        if _port_spec_covers(ports, port):
            return True
    return False


def _dst_covers(entry: str, dst: str, hosts: Mapping[str, Any]) -> bool:
    address = parse_address(dst)
    if address is None:
        return entry == dst
    if entry == "*":
        return any(address in r for r in _TAILNET_RANGES if r.version == address.version)
    network = _as_network(entry) or _as_network(hosts.get(entry))
    return network is not None and network.version == address.version and address in network


_TAG_SOURCES = ("*", "autogroup:tagged")
"""Source entries that match every tagged node (besides the tag itself)."""


_Rule = tuple[bool, Sequence[Any], Sequence[Any]]
"""(is a grant, dst entries, ip entries) of one rule that can allow traffic."""
_Index = dict[str, list[_Rule]]


def _file_grant(index: _Index, grant: Any) -> None:
    if find_key(grant, "via") is not None:
        return  # restricted to particular routers: not a general allowance
    _file(index, _member(grant, "src", []), (True, _member(grant, "dst", []), _member(grant, "ip", [])))


def _file_acl(index: _Index, acl: Any) -> None:
    if _member(acl, "action", "accept") != "accept" or _member(acl, "proto", "") not in ("", "tcp", "6"):
        return  # allows nothing a derived grant needs
    _file(index, _member(acl, "src", []), (False, _member(acl, "dst", []), ()))


def _file(index: _Index, sources: Sequence[Any], rule: _Rule) -> None:
    for source in dict.fromkeys(s for s in sources if isinstance(s, str)):
        index.setdefault(source, []).append(rule)


class _Rules:
    """The parts of a policy that decide whether a grant is already given.

    Rules are filed by source entry: only a rule whose ``src`` names the tag, ``*`` or
    ``autogroup:tagged`` can allow a tagged node anything, so a question about one tag looks at
    those rules only, not at the thousands written for users and groups.
    """

    def __init__(self, grants: Sequence[Any], acls: Sequence[Any], hosts: Mapping[str, Any], *,
                 index: _Index | None = None) -> None:
        self.hosts = hosts
        self._index = index if index is not None else self.index_of(grants, acls)
        self._added: _Index = {}

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> _Rules:
        return cls(_member(doc, "grants", []), _member(doc, "acls", []), _member(doc, "hosts", {}))

    @staticmethod
    def index_of(grants: Sequence[Any], acls: Sequence[Any]) -> _Index:
        """The rules filed by source entry (read-only once built: a render of one base reuses it)."""
        index: _Index = {}
        for grant in grants:
            _file_grant(index, grant)
        for acl in acls:
            _file_acl(index, acl)
        return index

    def add(self, rule: dict[str, Any], *, grant: bool) -> None:
        """File a rule the render appended (a grant, or an ``acls`` entry); later questions see it."""
        if grant:
            _file_grant(self._added, rule)
        else:
            _file_acl(self._added, rule)

    def allows(self, tag: str, dst: str, port: int) -> bool:
        for source in (tag, *_TAG_SOURCES):
            for is_grant, destinations, ip in (*self._index.get(source, ()), *self._added.get(source, ())):
                if is_grant:
                    if any(_dst_covers(d, dst, self.hosts) for d in destinations) and _ip_covers(ip, port):
                        return True
                    continue
                for entry in destinations:
                    alias, _, ports = entry.rpartition(":")
                    if _dst_covers(alias.strip("[]"), dst, self.hosts) and _port_spec_covers(ports, port):
                        return True
        return False

    def covers(self, grant: Grant) -> bool:
        ports = [int(p.rpartition(":")[2]) for p in grant.ip]
        return all(self.allows(s, d, p) for s in grant.src for d in grant.dst for p in ports)


def _label(grant: Grant) -> str:
    return f"{', '.join(grant.src)} -> {', '.join(grant.dst)} {', '.join(grant.ip)}"


def _allow_all(doc: Mapping[str, Any]) -> bool:
    return find_key(doc, "acls") is None and find_key(doc, "grants") is None


def _undefined_hosts(grant: Grant, hosts: Mapping[str, Any]) -> list[str]:
    return [d for d in grant.dst if parse_address(d) is None and d not in hosts]


def _hosts_reason(names: list[str]) -> str:
    return (
        f"{', '.join(names)} is a DNS name; a grant can only name it through a hosts entry, e.g. "
        f'"hosts": {{"{names[0]}": "<its IP>"}}'
    )


# --- render ----------------------------------------------------------------------------------


def acl_entry(grant: Grant) -> dict[str, Any]:
    """The ``acls`` entry that allows what a derived grant allows (TCP ports to its destinations)."""
    ports = [entry.rpartition(":")[2] for entry in grant.ip]
    return {"action": "accept", "src": list(grant.src), "proto": "tcp",
            "dst": [f"{dst}:{port}" for dst in grant.dst for port in ports]}


def render(base: Mapping[str, Any], derived: Derived, *, memo: TextMemo | None = None,
           grants: bool = True, text: str | None = None) -> Rendered:
    """Append the derived entries the base lacks; see the module docstring for the rules.

    The result's ``document`` shares the base's objects (treat both as read-only). With ``text``,
    the HuJSON ``base`` was parsed from, the rendered text is that text with the added entries
    inserted (comments and layout kept, see :mod:`~tailnet_operator.policy.patch`); without it,
    canonical JSON. ``memo``, a :class:`TextMemo` of ``base`` (see
    :class:`~tailnet_operator.policy.cache.ParsedPolicies`), keeps what a render of that base
    reuses: the layout of its text, the canonical text of its objects. ``grants=False`` renders
    for a server without grants (Headscale before 0.29).

    Raises PolicyParseError if a block Headscale knows has the wrong JSON type.
    """
    _check_base(base, memo)
    # Copy on write: the render shares every object of the base it does not add to (the base
    # is read-only), so rendering costs what is added, and a memo of the base's text applies.
    doc: JSONObject = dict(base)
    skipped: list[Skipped] = []
    added = Added(
        tuple(_add_tag_owners(doc, derived)),
        tuple(_add_route_approvals(doc, derived, skipped)),
        tuple(_add_grants(doc, derived, skipped, memo=memo, grants=grants)),
    )
    out = _rendered_text(doc, base, derived, added, memo=memo, grants=grants, text=text)
    return Rendered(
        text=out,
        document=doc,
        hash=hashlib.sha256(out.encode()).hexdigest(),
        added=added,
        skipped=tuple(skipped),
        grants_as_acls=not grants and bool(added.grants),
        unsupported=() if grants or find_key(doc, "grants") is None else ("grants",),
    )


def _check_base(base: Mapping[str, Any], memo: TextMemo | None) -> None:
    """Validate the base once per memo: a render of an unchanged base skips the walk."""
    if memo is None:
        validate_structure(base, source="base policy")
    elif memo.document is not base:
        raise ValueError("the text memo is of another document than this base")
    elif not memo.cache.get("valid"):
        validate_structure(base, source="base policy")
        memo.cache["valid"] = True


def _own_copy(parent: JSONObject, name: str) -> tuple[str | None, JSONObject]:
    """The key of block ``name`` in ``parent`` (None when absent) and a copy of it put in its place,
    so the render adds to its own object and the base's stays as it was (copy on write)."""
    key = find_key(parent, name)
    block: JSONObject = dict(parent[key]) if key is not None else {}
    if key is not None:
        parent[key] = block
    return key, block


def _add_tag_owners(doc: JSONObject, derived: Derived) -> list[TagOwner]:
    """``tagOwners``: each derived tag the base does not own yet (a tag it owns is left alone)."""
    owners_key, owners = _own_copy(doc, "tagOwners")
    added = [entry for entry in derived.tag_owners if entry.tag not in owners]
    for entry in added:
        owners[entry.tag] = list(entry.owners)
    if owners_key is None and added:
        doc["tagOwners"] = owners
    return added


def _add_route_approvals(doc: JSONObject, derived: Derived, skipped: list[Skipped]) -> list[RouteApproval]:
    """``autoApprovers.routes``: each derived approver no equal or wider key grants yet; a route the
    base lists for others is left to the base (and reported in ``skipped``)."""
    approvers_key, auto = _own_copy(doc, "autoApprovers")
    routes_key, routes = _own_copy(auto, "routes")
    listed = {net: key for key in routes if (net := _as_network(key)) is not None}
    approvals = _Approvals(routes)
    added: list[RouteApproval] = []
    for approval in derived.routes:
        network = _network_of(approval.route)
        assert network is not None  # derived routes are CIDRs
        lacking = tuple(a for a in approval.approvers if not approvals.approved(network, a))
        if not lacking:
            continue
        if network in listed:
            skipped.append(_route_skipped(approval, lacking, listed[network], routes, derived))
            continue
        routes[approval.route] = list(lacking)
        approvals.add(approval.route, routes[approval.route])
        listed[network] = approval.route
        added.append(RouteApproval(approval.route, lacking))
    if added:
        if routes_key is None:
            auto["routes"] = routes
        if approvers_key is None:
            doc["autoApprovers"] = auto
    return added


def _route_skipped(approval: RouteApproval, lacking: tuple[str, ...], key: str, routes: JSONObject,
                   derived: Derived) -> Skipped:
    """Why a derived approver of a route the base already lists is not added."""
    who = ", ".join(lacking)
    return Skipped(
        "route",
        approval.route,
        f"the base already lists {key} for {', '.join(routes[key]) or 'no approver'}; the base "
        f"wins, so {who} is not added and routes it advertises stay unapproved. To have them "
        f"approved, add {who} to that entry's approvers in the base policy",
        derived.sources(approval),
    )


def _add_grants(doc: JSONObject, derived: Derived, skipped: list[Skipped], *, memo: TextMemo | None,
                grants: bool) -> list[Grant]:
    """``grants`` (``acls`` without grants): each derived grant the policy does not allow yet; none
    when the base allows all traffic (a grant would deny everything else)."""
    if not derived.grants:
        return []
    if _allow_all(doc):
        reason = (
            "the base has neither acls nor grants, so Headscale allows all traffic; adding a grant would deny "
            "everything else"
        )
        skipped.extend(Skipped("grant", _label(g), reason, derived.sources(g)) for g in derived.grants)
        return []
    target = "grants" if grants else "acls"
    target_key = find_key(doc, target)
    # Copy on write: the list the render appends to is its own; the base's stays as it was.
    entries: list[Any] = list(doc[target_key]) if target_key is not None else []
    if target_key is not None:
        doc[target_key] = entries
    rules = _base_rules(doc, memo)
    added: list[Grant] = []
    for grant in derived.grants:
        if undefined := _undefined_hosts(grant, rules.hosts):
            skipped.append(Skipped("grant", _label(grant), _hosts_reason(undefined), derived.sources(grant)))
        elif not rules.covers(grant):
            rule = grant.to_json() if grants else acl_entry(grant)
            entries.append(rule)
            rules.add(rule, grant=grants)
            added.append(grant)
    if target_key is None and added:
        doc[target] = entries
    return added


def _base_rules(doc: JSONObject, memo: TextMemo | None) -> _Rules:
    """The rules of the base, filed once per base when a memo keeps them."""
    base_grants, acls = _member(doc, "grants", []), _member(doc, "acls", [])
    index = None
    if memo is not None:
        index = memo.cache.get("rules")
        if index is None:
            index = memo.cache["rules"] = _Rules.index_of(base_grants, acls)
    return _Rules(base_grants, acls, _member(doc, "hosts", {}), index=index)


def _rendered_text(doc: JSONObject, base: Mapping[str, Any], derived: Derived, added: Added, *,
                   memo: TextMemo | None, grants: bool, text: str | None) -> str:
    """The base's own text with ``added`` inserted, or canonical JSON when there is no text (or it is
    not the text the base was parsed from)."""
    out = None
    if text is not None:
        out = _patched(_layout(text, memo), base, derived, added, grants=grants)
    if out is None:
        out = canonical_text(doc, memo=memo)
    return out


def _layout(text: str, memo: TextMemo | None) -> Layout:
    """The layout of the base's text, kept in the memo while the text is the same."""
    if memo is None:
        return Layout(text)
    layout = memo.cache.get("layout")
    if not isinstance(layout, Layout) or layout.text != text.removeprefix("\ufeff"):
        layout = memo.cache["layout"] = Layout(text)
    return layout


def _grant_text(grant: Grant) -> str:
    """``one_line(grant.to_json())``, straight from the grant."""
    return f'{{"src": {strings(grant.src)}, "dst": {strings(grant.dst)}, "ip": {strings(grant.ip)}}}'


class _Mismatch(Exception):
    """The text lacks a block the document has: it is not the text the base was parsed from."""


def _patched(layout: Layout, base: Mapping[str, Any], derived: Derived, added: Added, *,
             grants: bool) -> str | None:
    """The base's text with ``added`` inserted; None if the text does not have the blocks the
    document has (a text other than the one ``base`` was parsed from)."""
    try:
        return _patch(layout, base, derived, added, grants=grants)
    except _Mismatch:
        return None


def _block(layout: Layout, key: str | None, parent_key: str | None = None) -> Block | None:
    """The block of member ``key`` (of the root, or of the root's ``parent_key``); None when the
    document has no such member."""
    if key is None:
        return None
    parent = layout.root if parent_key is None else layout.root.members.get(parent_key)
    block = parent.members.get(key) if parent is not None else None
    if block is None:
        raise _Mismatch(key)
    return block


def _patch(layout: Layout, base: Mapping[str, Any], derived: Derived, added: Added, *, grants: bool) -> str:
    sources, unit = derived.sources, layout.unit
    patch = Patch(layout)
    at_root: list[Entry] = []

    owners = [Entry.member(o.tag, o.owners, sources(o)) for o in added.tag_owners]
    if owners:
        block = _block(layout, find_key(base, "tagOwners"))
        if block is None:
            at_root.append(Entry.block("tagOwners", "{", owners, unit, "added: the base has no tagOwners"))
        else:
            patch.append(block, owners)

    routes = [Entry.member(r.route, r.approvers, sources(r)) for r in added.routes]
    if routes:
        approvers_key = find_key(base, "autoApprovers")
        approvers = _block(layout, approvers_key)
        if approvers is None or approvers_key is None:
            inner = Entry.block("routes", "{", routes, unit, "added: the base has no autoApprovers.routes")
            at_root.append(Entry.block("autoApprovers", "{", [inner], unit, "added: the base has no autoApprovers"))
        else:
            routes_block = _block(layout, find_key(base[approvers_key], "routes"), approvers_key)
            if routes_block is None:
                patch.append(approvers, [Entry.block("routes", "{", routes, unit,
                                                     "added: the base has no autoApprovers.routes")])
            else:
                patch.append(routes_block, routes)

    target = "grants" if grants else "acls"
    rules = [Entry.item(_grant_text(g) if grants else one_line(acl_entry(g)), sources(g)) for g in added.grants]
    if rules:
        block = _block(layout, find_key(base, target))
        if block is None:
            at_root.append(Entry.block(target, "[", rules, unit, f"added: the base has no {target}"))
        else:
            patch.append(block, rules)

    patch.append(layout.root, at_root)
    return patch.text()


# --- missing ---------------------------------------------------------------------------------

_SNIPPET_HEADER = (
    "// Added by tailnet-operator: policy entries its TailnetEgress, TailnetIngress, TailnetSite and",
    "// TailnetGateway objects need but the live Headscale policy lacks. Merge each block into the",
    "// block of the same name in your policy (entries you already have take precedence).",
)


def _live_document(live: str | Mapping[str, Any] | None) -> JSONObject:
    if live is None:
        return {}
    if isinstance(live, str):
        return parse_hujson(live, source="live policy") if live.strip() else {}
    validate_structure(live, source="live policy")
    return dict(live)


def missing(live: str | Mapping[str, Any] | None, derived: Derived) -> Missing:
    """What ``derived`` needs that the live policy lacks (None or "" means no policy at all).

    Raises PolicyParseError if the live text cannot be read.
    """
    doc = _live_document(live)
    owners = _member(doc, "tagOwners", {})
    routes = _member(_member(doc, "autoApprovers", {}), "routes", {})
    rules = _Rules.of(doc)
    notes: list[str] = []

    tag_owners = tuple(entry for entry in derived.tag_owners if entry.tag not in owners)
    lacking_routes: list[RouteApproval] = []
    listed = {net: key for key in routes if (net := _as_network(key)) is not None}
    approvals = _Approvals(routes)
    for approval in derived.routes:
        network = _network_of(approval.route)
        assert network is not None  # derived routes are CIDRs
        lacking = tuple(a for a in approval.approvers if not approvals.approved(network, a))
        if lacking:
            lacking_routes.append(RouteApproval(approval.route, lacking))
            if network in listed:
                notes.append(f"{listed[network]} is already listed: add {', '.join(lacking)} to its approvers")
    grants: list[Grant] = []
    if not _allow_all(doc):
        for grant in derived.grants:
            if rules.covers(grant):
                continue
            grants.append(grant)
            if undefined := _undefined_hosts(grant, rules.hosts):
                notes.append(_hosts_reason(undefined))
    return Missing(
        tag_owners=tag_owners,
        routes=tuple(lacking_routes),
        grants=tuple(grants),
        notes=tuple(notes),
        snippet=_snippet(tag_owners, lacking_routes, grants, notes),
    )


def _snippet(
    tag_owners: Sequence[TagOwner], routes: Sequence[RouteApproval], grants: Sequence[Grant], notes: Sequence[str]
) -> str:
    if not (tag_owners or routes or grants):
        return ""
    body: JSONObject = {}
    if tag_owners:
        body["tagOwners"] = {entry.tag: list(entry.owners) for entry in tag_owners}
    if routes:
        body["autoApprovers"] = {"routes": {entry.route: list(entry.approvers) for entry in routes}}
    if grants:
        body["grants"] = [grant.to_json() for grant in grants]
    header = [*_SNIPPET_HEADER, *(f"// Note: {note}" for note in notes)]
    return "\n".join(header) + "\n" + canonical_text(body)


# --- diff ------------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    """JSON equality: key order and formatting do not matter, but true is not 1."""
    if a is b:
        return True  # shared with the base (renders of one base share its objects)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def diff_needed(live: str | Mapping[str, Any] | None, rendered: Rendered, *,
                parsed: ParsedPolicies | None = None) -> bool:
    """Whether writing ``rendered`` would change the live policy's meaning-bearing data.

    Comments, formatting and key order alone never cause a write (every PUT adds a DB row in
    Headscale). A live text that cannot be parsed counts as different: the render replaces it.
    ``parsed`` reuses the document of a live text seen (or written) before.
    """
    if isinstance(live, str) and live == rendered.text:
        return False  # the live policy is this very render (the steady state)
    try:
        if parsed is not None and isinstance(live, str) and live.strip():
            doc = parsed.parse(live, source="live policy")
        else:
            doc = _live_document(live)
    except PolicyParseError:
        return True
    if live is None or (isinstance(live, str) and not live.strip()):
        return True
    return not _same(doc, rendered.document)
