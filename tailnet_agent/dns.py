"""Names through the tailnet's DNS configuration, for targets that are not MagicDNS names.

A target such as ``ledger.tailnet.example.internal`` is answered the way tailscaled's resolver
would answer it for this node, in this order:

1. an IP literal or a MagicDNS name of a node in the netmap (:func:`~tailnet_agent.projection.resolve_name`);
2. the netmap's ``DNSConfig.ExtraRecords`` (Headscale's ``dns.extra_records``), A before AAAA;
3. the split-DNS route (``DNSConfig.Routes``, Headscale's ``dns.nameservers.split``) with the
   longest suffix that covers the name: an A query (DNS over TCP, RFC 7766), then an AAAA query
   when the name has no A record, to each of that route's resolvers in turn, dialled through the
   tailnet like any egress connection, since the resolver usually sits on a site LAN behind a
   subnet router.

Global resolvers are not asked: the agent has no exit node, and a name that reaches the internet's
DNS is not a tailnet name. Answers are cached for their TTL (clamped to 5-300 s); the last answer
or error per name stays readable without I/O for ``/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tailnet_agent.contract.clock import Clock
from tailnet_agent.control import NetMap
from tailnet_agent.projection import resolve_name

MIN_TTL = 5.0
MAX_TTL = 300.0
QUERY_TIMEOUT = 5.0
TYPE_A = 1
TYPE_CNAME = 5
TYPE_AAAA = 28
_ADDRESS_SIZE = {TYPE_A: 4, TYPE_AAAA: 16}


class DnsError(Exception):
    """A DNS answer that gives no address; ``str()`` says why, for a target's status message."""


class NoRecord(DnsError):
    """The name exists but has no record of the type asked (NODATA)."""


def normalize(name: str) -> str:
    return name.strip().rstrip(".").lower()


# -- the static part: literal, MagicDNS, extra records --------------------------------------------


def lookup_static(netmap: NetMap | None, name: str) -> str | None:
    """An IP for ``name`` without any query: literal, MagicDNS name, or extra record; else None."""
    literal = name.strip().strip("[]")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(literal))
    if netmap is None:
        return None
    if (ip := resolve_name(netmap, name)) is not None:
        return ip
    return extra_record(netmap, name)


def extra_record(netmap: NetMap, name: str) -> str | None:
    """The ExtraRecords value for ``name`` (case-insensitive, trailing dot ignored), IPv4 first."""
    wanted = normalize(name)
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for record, value in netmap.dns.extra_records.items():
        if normalize(record) == wanted:
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_address(value.strip()))
    return str(min(found, key=lambda a: a.version)) if found else None


def split_route(netmap: NetMap, name: str) -> tuple[str, tuple[str, ...]] | None:
    """The split-DNS route with the longest suffix covering ``name``: (suffix, resolver addresses)."""
    wanted = normalize(name)
    best: tuple[str, tuple[str, ...]] | None = None
    for suffix, resolvers in netmap.dns.routes.items():
        plain = normalize(suffix)
        covers = plain and (wanted == plain or wanted.endswith("." + plain)) and resolvers
        if covers and (best is None or len(plain) > len(best[0])):
            best = (plain, resolvers)
    return best


def resolver_endpoint(addr: str) -> tuple[str, int] | None:
    """``ip`` or ``ip:port`` (``[v6]:port``) of a plain DNS resolver; None for DoH/DoT URLs and names."""
    text = addr.strip()
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(text)), 53
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and 0 < int(port) < 65536:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(host.strip("[]"))), int(port)
    return None


# -- a minimal DNS codec --------------------------------------------------------------------------


def encode_query(name: str, query_id: int, qtype: int = TYPE_A) -> bytes:
    """A recursive query for ``name`` (one question, class IN)."""
    header = struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0)
    labels = b"".join(bytes([len(p)]) + p for p in (label.encode("idna") for label in normalize(name).split(".")))
    return header + labels + b"\x00" + struct.pack("!HH", qtype, 1)


def _skip_name(msg: bytes, offset: int) -> int:
    while True:
        if offset >= len(msg):
            raise DnsError("truncated DNS answer")
        length = msg[offset]
        if length & 0xC0 == 0xC0:
            return offset + 2
        if length == 0:
            return offset + 1
        offset += 1 + length


def decode_answer(msg: bytes, query_id: int, qtype: int = TYPE_A) -> tuple[list[str], float]:
    """The ``qtype`` (A or AAAA) records of a response to ``query_id`` and the smallest TTL; raises
    :class:`DnsError` (:class:`NoRecord` when the answer holds none of that type)."""
    if len(msg) < 12:
        raise DnsError("truncated DNS answer")
    rid, flags, qdcount, ancount = struct.unpack("!HHHH", msg[:8])
    if rid != query_id or not flags & 0x8000:
        raise DnsError("the resolver's answer does not match the query")
    rcode = flags & 0x000F
    if rcode == 3:
        raise DnsError("no such name (NXDOMAIN)")
    if rcode:
        raise DnsError(f"the resolver answered with error code {rcode}")
    offset = 12
    for _ in range(qdcount):
        offset = _skip_name(msg, offset) + 4
    addresses: list[str] = []
    ttl = MAX_TTL
    for _ in range(ancount):
        offset = _skip_name(msg, offset)
        if offset + 10 > len(msg):
            raise DnsError("truncated DNS answer")
        rtype, _cls, rttl, rdlength = struct.unpack("!HHIH", msg[offset:offset + 10])
        offset += 10
        if offset + rdlength > len(msg):
            raise DnsError("truncated DNS answer")
        if rtype == qtype and rdlength == _ADDRESS_SIZE[qtype]:
            addresses.append(str(ipaddress.ip_address(msg[offset:offset + rdlength])))
            ttl = min(ttl, float(rttl))
        offset += rdlength
    if not addresses:
        raise NoRecord("the resolver has no A or AAAA record for it" if qtype == TYPE_AAAA
                       else "the resolver has no A record for it")
    return addresses, ttl


# -- the resolver ---------------------------------------------------------------------------------

Dial = Callable[[str, int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass(frozen=True)
class Lookup:
    """The last outcome for one name: an address, or the error that explains why there is none."""

    address: str | None
    error: str | None
    expires: float
    """Clock time after which the name is asked again."""


class Resolver:
    """Resolves names as the module docstring says; ``dial`` opens TCP over the tailnet."""

    def __init__(self, netmap: Callable[[], NetMap | None], dial: Dial, clock: Clock) -> None:
        self._netmap = netmap
        self._dial = dial
        self._clock = clock
        self._cache: dict[str, Lookup] = {}
        self._ids = itertools.count(0x2A00)

    def cached(self, name: str) -> Lookup | None:
        """The static answer, or the last queried outcome (even if expired); None if never asked."""
        if (ip := lookup_static(self._netmap(), name)) is not None:
            return Lookup(ip, None, float("inf"))
        return self._cache.get(normalize(name))

    async def resolve(self, name: str) -> str:
        """An IP for ``name``; raises :class:`DnsError` with a message a person can act on."""
        netmap = self._netmap()
        if (ip := lookup_static(netmap, name)) is not None:
            return ip
        key = normalize(name)
        hit = self._cache.get(key)
        if hit is not None and hit.expires > self._clock.now():
            if hit.address is None:
                raise DnsError(hit.error or "does not resolve")
            return hit.address
        try:
            address, ttl = await self._query(netmap, name)
        except DnsError as exc:
            self._cache[key] = Lookup(None, str(exc), self._clock.now() + MIN_TTL)
            raise
        self._cache[key] = Lookup(address, None, self._clock.now() + min(max(ttl, MIN_TTL), MAX_TTL))
        return address

    async def _query(self, netmap: NetMap | None, name: str) -> tuple[str, float]:
        if netmap is None:
            raise DnsError(f"cannot resolve {name!r}: no netmap from control yet")
        route = split_route(netmap, name)
        if route is None:
            raise DnsError(f"cannot resolve {name!r}: not a MagicDNS name, no extra record, "
                           "and no split-DNS route in the tailnet's DNS configuration covers it")
        suffix, resolvers = route
        problems: list[str] = []
        for addr in resolvers:
            endpoint = resolver_endpoint(addr)
            if endpoint is None:
                problems.append(f"{addr}: not a plain DNS resolver address")
                continue
            try:
                addresses, ttl = await self._ask(endpoint, name)
            except (DnsError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                problems.append(f"{addr}: {exc or type(exc).__name__}")
                continue
            return addresses[0], ttl
        raise DnsError(f"cannot resolve {name!r} through the split-DNS route for {suffix}: " + "; ".join(problems))

    async def _ask(self, endpoint: tuple[str, int], name: str) -> tuple[list[str], float]:
        """The name's IPv4 addresses, else (no A record) its IPv6 ones."""
        try:
            return await self._ask_type(endpoint, name, TYPE_A)
        except NoRecord:
            return await self._ask_type(endpoint, name, TYPE_AAAA)

    async def _ask_type(self, endpoint: tuple[str, int], name: str, qtype: int) -> tuple[list[str], float]:
        query_id = next(self._ids) & 0xFFFF
        query = encode_query(name, query_id, qtype)
        async with asyncio.timeout(QUERY_TIMEOUT):
            reader, writer = await self._dial(*endpoint)
            try:
                writer.write(struct.pack("!H", len(query)) + query)
                await writer.drain()
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                return decode_answer(await reader.readexactly(length), query_id, qtype)
            finally:
                writer.close()
