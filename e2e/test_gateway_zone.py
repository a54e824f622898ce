"""The gateway's zone as CoreDNS serves it: the real CoreDNS binary (the pinned build) with the
Corefile and the zone file the gateway renders, queried over UDP on 127.0.0.1.

Names of the zone answer with their address, every other name of the zone is NXDOMAIN with the
zone's SOA (an authoritative answer clients cache negatively), names outside the zone are not
answered from it, and a new zone file is served within the reload interval.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from hack import binaries
from hack.localenv import Environment, ManagedProcess, free_port, wait_until
from tailnet_operator.resources import gateway as build

pytestmark = [pytest.mark.integration]

ZONE = "corp.example"


class ZoneServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()

    def write(self, entries: dict[str, str]) -> None:
        zone = self.directory / build.ZONE_FILE
        staged = zone.with_suffix(".new")
        staged.write_text(build.zone_file(ZONE, entries))
        staged.replace(zone)  # what the kubelet's atomic ConfigMap update amounts to for a reader

    def query(self, name: str, kind: str = "A") -> dns.message.Message:
        return dns.query.udp(dns.message.make_query(name, kind), "127.0.0.1", port=self.port, timeout=2)


@pytest.fixture
def zone_server(tmp_path: Path, environment: Environment) -> Iterator[ZoneServer]:
    server = ZoneServer(tmp_path)
    server.write({"db.corp.example": "198.19.128.54", "shop.corp.example": "100.64.0.5"})
    (tmp_path / build.COREFILE).write_text(build.corefile(
        ZONE, directory=str(tmp_path), port=server.port, health_port=free_port(), ready_port=free_port()))
    process = ManagedProcess("coredns-zone", [binaries.binary("coredns"), "-conf", tmp_path / build.COREFILE],
                             log_dir=environment.log_dir, run_id=environment.run_id)
    process.start()
    try:
        wait_until(lambda: server.query(f"db.{ZONE}"), timeout=30, what="CoreDNS answering")
        yield server
    finally:
        process.stop()


def _addresses(answer: dns.message.Message) -> list[str]:
    return [rr.to_text() for rrset in answer.answer for rr in rrset]


def test_names_of_the_zone_answer_and_others_are_nxdomain_with_the_soa(zone_server: ZoneServer) -> None:
    found = zone_server.query(f"db.{ZONE}")
    assert found.rcode() == dns.rcode.NOERROR and _addresses(found) == ["198.19.128.54"]
    assert found.flags & dns.flags.AA, "the gateway is the zone's authority"
    assert _addresses(zone_server.query(f"shop.{ZONE}")) == ["100.64.0.5"]

    missing = zone_server.query(f"nothing.{ZONE}")
    assert missing.rcode() == dns.rcode.NXDOMAIN
    assert [rrset.rdtype for rrset in missing.authority] == [dns.rdatatype.SOA]

    outside = zone_server.query("db.elsewhere.example")
    assert outside.rcode() == dns.rcode.REFUSED and not outside.answer


def test_a_new_zone_file_is_served_without_a_restart(zone_server: ZoneServer) -> None:
    zone_server.write({"db.corp.example": "198.19.128.99", "api.corp.example": "198.19.128.77"})

    wait_until(lambda: _addresses(zone_server.query(f"api.{ZONE}")) == ["198.19.128.77"], timeout=30,
               what="the new name served after the reload")
    assert _addresses(zone_server.query(f"db.{ZONE}")) == ["198.19.128.99"]
    assert zone_server.query(f"shop.{ZONE}").rcode() == dns.rcode.NXDOMAIN
