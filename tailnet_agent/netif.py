"""The machine's interface addresses, reported as a node's local UDP endpoints."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's (primary) IPv4 address."""


def local_ipv4_addresses() -> list[str]:
    """The primary IPv4 address of each interface, loopback excluded (as tailscaled reports)."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            ip = socket.inet_ntoa(answer[20:24])
            if not ipaddress.ip_address(ip).is_loopback and ip not in found:
                found.append(ip)
    return found
