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


IF_INET6 = "/proc/net/if_inet6"
"""Linux: every IPv6 address of the machine, one per line (address, index, prefix, scope, flags, name)."""
SCOPE_GLOBAL = 0x00
UNUSABLE_FLAGS = 0x08 | 0x20 | 0x40
"""IFA_F_DADFAILED, IFA_F_DEPRECATED, IFA_F_TENTATIVE: an address not (or no longer) to send from."""
TAILNET_ULA = ipaddress.IPv6Network("fd7a:115c:a1e0::/48")
"""The tailnet's own IPv6 range: never an endpoint (as tailscaled leaves it out)."""


def usable_ipv6_addresses(if_inet6: str) -> list[str]:
    """The global-scope IPv6 addresses (public and ULA) of ``if_inet6``'s content that a peer could
    send to, tailscaled's rule: no loopback, link-local, tentative or deprecated address, nothing of
    the tailnet's range."""
    found: list[str] = []
    for line in if_inet6.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        try:
            ip = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            scope, flags = int(fields[3], 16), int(fields[4], 16)
        except ValueError:
            continue
        if scope != SCOPE_GLOBAL or flags & UNUSABLE_FLAGS or ip.is_loopback or ip in TAILNET_ULA:
            continue
        if str(ip) not in found:
            found.append(str(ip))
    return found


def local_ipv6_addresses() -> list[str]:
    """:func:`usable_ipv6_addresses` of this machine (none where IPv6 is off)."""
    try:
        with open(IF_INET6, encoding="ascii") as lines:
            return usable_ipv6_addresses(lines.read())
    except OSError:
        return []
