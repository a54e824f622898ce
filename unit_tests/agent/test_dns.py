"""Names through the tailnet's DNS configuration: extra records, split-DNS routes, the DNS codec,
and a resolver that asks a (fake) resolver on the tailnet over TCP."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from typing import Any

import pytest

from tailnet_agent.contract.clock import FakeClock
from tailnet_agent.control import netmap as nm
from tailnet_agent.dns import (
    DnsError,
    Resolver,
    decode_answer,
    encode_query,
    extra_record,
    lookup_static,
    resolver_endpoint,
    split_route,
)

from .test_projection import ROUTER, netmap


def dns_map(**dns: Any) -> nm.NetMap:
    return netmap([ROUTER], DNSConfig=dns)


def answer(query: bytes, ips: list[str], *, rcode: int = 0, ttl: int = 60) -> bytes:
    """A response to ``query``: the question echoed, one A or AAAA record per IP (name by pointer)."""
    qid = struct.unpack("!H", query[:2])[0]
    header = struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, len(ips), 0, 0)
    records = b""
    for ip in ips:
        packed = ipaddress.ip_address(ip).packed
        records += b"\xc0\x0c" + struct.pack("!HHIH", 1 if len(packed) == 4 else 28, 1, ttl, len(packed)) + packed
    return header + query[12:] + records


def test_static_lookup_order_literal_magicdns_extra_records() -> None:
    m = dns_map(ExtraRecords=[{"Name": "ledger.tailnet.example.internal", "Type": "AAAA", "Value": "fd00::5"},
                              {"Name": "Ledger.tailnet.example.internal.", "Type": "A", "Value": "198.18.5.9"}])
    assert lookup_static(m, "[fd00::1]") == "fd00::1"
    assert lookup_static(m, "router") == "100.64.0.2"
    assert extra_record(m, "LEDGER.tailnet.example.internal.") == "198.18.5.9"  # IPv4 first
    assert lookup_static(m, "other.example.internal") is None
    assert lookup_static(None, "router") is None


def test_split_route_takes_the_longest_covering_suffix() -> None:
    m = dns_map(Routes={"example.internal": [{"Addr": "100.64.0.2"}],
                        "tailnet.example.internal.": [{"Addr": "198.18.5.53:5353"}], "empty.internal": []})
    assert split_route(m, "ledger.tailnet.example.internal") == ("tailnet.example.internal", ("198.18.5.53:5353",))
    assert split_route(m, "db.example.internal") == ("example.internal", ("100.64.0.2",))
    assert split_route(m, "badexample.internal") is None
    assert split_route(m, "x.empty.internal") is None
    assert resolver_endpoint("198.18.5.53:5353") == ("198.18.5.53", 5353)
    assert resolver_endpoint("100.64.0.2") == ("100.64.0.2", 53)
    assert resolver_endpoint("https://dns.example/dns-query") is None


def test_codec_round_trip_and_errors() -> None:
    query = encode_query("Ledger.Example.Internal.", 0x1234)
    assert query[12:] == b"\x06ledger\x07example\x08internal\x00\x00\x01\x00\x01"
    assert decode_answer(answer(query, ["198.18.5.9", "198.18.5.10"], ttl=30), 0x1234) == (
        ["198.18.5.9", "198.18.5.10"], 30.0)
    with pytest.raises(DnsError, match="NXDOMAIN"):
        decode_answer(answer(query, [], rcode=3), 0x1234)
    with pytest.raises(DnsError, match="no A record"):
        decode_answer(answer(query, []), 0x1234)
    with pytest.raises(DnsError, match="does not match"):
        decode_answer(answer(query, ["1.2.3.4"]), 0x9999)
    with pytest.raises(DnsError, match="truncated"):
        decode_answer(answer(query, ["1.2.3.4"])[:-3] + b"", 0x1234)


class FakeTailnetDns:
    """A DNS-over-TCP server behind the fake dial; records which resolver was dialled."""

    def __init__(self, records: dict[str, str]) -> None:
        self.records = records
        self.dialled: list[tuple[str, int]] = []
        self.asked: list[int] = []

    async def dial(self, ip: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.dialled.append((ip, port))
        if ip == "100.64.0.99":
            raise ConnectionRefusedError(111, f"connection to {ip}:{port} refused")
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port_ = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port_)
        server.close()
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        query = await reader.readexactly(length)
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode())
            i += 1 + query[i]
        ip = self.records.get(".".join(labels))
        qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
        self.asked.append(qtype)
        version = 4 if qtype == 1 else 6
        found = [ip] if ip and ipaddress.ip_address(ip).version == version else []
        msg = answer(query, found, rcode=0 if ip else 3, ttl=1)  # a name with no record of the type: NODATA
        writer.write(struct.pack("!H", len(msg)) + msg)
        await writer.drain()
        writer.close()


async def test_resolver_asks_the_split_route_over_the_tailnet_and_caches() -> None:
    m = dns_map(Routes={"example.internal": [{"Addr": "100.64.0.99"}, {"Addr": "100.64.0.2"}]})
    server, clock = FakeTailnetDns({"ledger.example.internal": "198.18.5.9"}), FakeClock()
    resolver = Resolver(lambda: m, server.dial, clock)
    assert resolver.cached("ledger.example.internal") is None
    assert await resolver.resolve("ledger.example.internal") == "198.18.5.9"
    assert server.dialled == [("100.64.0.99", 53), ("100.64.0.2", 53)]  # the first refused; the next answered
    assert await resolver.resolve("Ledger.Example.Internal.") == "198.18.5.9"
    assert len(server.dialled) == 2, "cached for the TTL (at least 5 s)"
    clock.advance(6)
    assert await resolver.resolve("ledger.example.internal") == "198.18.5.9"
    assert len(server.dialled) == 4

    with pytest.raises(DnsError) as info:
        await resolver.resolve("gone.example.internal")
    assert str(info.value) == ("cannot resolve 'gone.example.internal' through the split-DNS route for "
                               "example.internal: 100.64.0.99: [Errno 111] connection to 100.64.0.99:53 refused; "
                               "100.64.0.2: no such name (NXDOMAIN)")
    cached = resolver.cached("gone.example.internal")
    assert cached is not None and cached.address is None and cached.error == str(info.value)


async def test_a_name_without_any_route_names_what_was_tried() -> None:
    resolver = Resolver(lambda: dns_map(), FakeTailnetDns({}).dial, FakeClock())
    with pytest.raises(DnsError, match="not a MagicDNS name, no extra record, and no split-DNS route"):
        await resolver.resolve("ledger.tailnet.example.internal")
    no_map = Resolver(lambda: None, FakeTailnetDns({}).dial, FakeClock())
    with pytest.raises(DnsError, match="no netmap from control yet"):
        await no_map.resolve("ledger.tailnet.example.internal")


async def test_a_name_with_only_an_ipv6_address_resolves_to_it_after_the_a_query() -> None:
    m = dns_map(Routes={"example.internal": [{"Addr": "100.64.0.2"}]})
    server = FakeTailnetDns({"ledger.example.internal": "fd00:5::9", "db.example.internal": "198.18.5.7"})
    resolver = Resolver(lambda: m, server.dial, FakeClock())

    assert await resolver.resolve("ledger.example.internal") == "fd00:5::9"
    assert server.asked == [1, 28], "A first, then AAAA"
    assert await resolver.resolve("db.example.internal") == "198.18.5.7"
    assert server.asked == [1, 28, 1], "an A answer needs no AAAA query"
