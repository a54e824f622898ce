"""Which Headscale servers this control client can talk to, by capability version.

Headscale refuses a client whose capability version (``tailcfg.CurrentCapabilityVersion``, sent
in the Noise prologue, ``/key?v=`` and every register and map request) is below its
``capver.MinSupportedCapabilityVersion``: it closes the Noise connection before the early
payload and answers register and map with HTTP 400 "unsupported client version". Nothing
tells the client why the connection dropped, so before connecting the client asks the
server's version (``GET /version``, unauthenticated, Headscale 0.27+; 0.26 answers 404) and
compares with the table below, read from each release's ``hscontrol/capver``.

* Server older than :data:`OLDEST_HEADSCALE` (0.26): :class:`UnsupportedServer` "too old".
* Server whose minimum is above our version: :class:`UnsupportedServer` "too new for this agent".
* A server newer than the table: connect anyway and log that it is untested; a refusal then
  becomes :class:`UnsupportedServer` through :func:`refusal`.
"""

from __future__ import annotations

import re

from .errors import RegistrationError

MIN_CAPABILITY_VERSION = {
    (0, 26): 88,   # tailscale v1.62
    (0, 27): 90,   # v1.64
    (0, 28): 106,  # v1.74
    (0, 29): 113,  # v1.80
    (0, 30): 113,  # v1.80 (unreleased; main as of 0.29.2)
}
"""Headscale minor -> the lowest capability version it accepts."""

OLDEST_HEADSCALE = min(MIN_CAPABILITY_VERSION)
NEWEST_HEADSCALE = max(MIN_CAPABILITY_VERSION)

TAILSCALE_OF_CAPVER = {88: "v1.62", 90: "v1.64", 106: "v1.74", 113: "v1.80", 115: "v1.82", 116: "v1.84",
                       123: "v1.86", 125: "v1.88", 130: "v1.90", 131: "v1.92", 133: "v1.96", 138: "v1.98"}
"""Capability version -> the tailscale release that introduced it (for messages)."""

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


class UnsupportedServer(RegistrationError):
    """The server and this agent have no capability version in common; retrying will not help."""


def _tailscale(capver: int) -> str:
    return TAILSCALE_OF_CAPVER.get(capver, f"capability version {capver}")


def _minor(reported: str) -> tuple[int, int] | None:
    """``v0.29.2`` -> (0, 29); "" (no ``/version``: Headscale 0.26) -> (0, 26); None if unparsable."""
    if not reported:
        return OLDEST_HEADSCALE
    match = _VERSION.search(reported)
    return (int(match[1]), int(match[2])) if match else None


def check_server(reported: str, capability_version: int) -> str:
    """Raise :class:`UnsupportedServer` when the server cannot take this client; else return a
    note for the log ("" when the server is in the tested range or its version is unknown)."""
    minor = _minor(reported)
    label = reported or "0.26 (no /version endpoint)"
    if minor is None:
        return ""
    supported = f"this agent supports Headscale {OLDEST_HEADSCALE[0]}.{OLDEST_HEADSCALE[1]} to " \
                f"{NEWEST_HEADSCALE[0]}.{NEWEST_HEADSCALE[1]}"
    if minor < OLDEST_HEADSCALE:
        raise UnsupportedServer(f"Headscale {label} is too old: {supported}; upgrade Headscale")
    minimum = MIN_CAPABILITY_VERSION.get(minor)
    if minimum is not None and capability_version < minimum:
        raise UnsupportedServer(
            f"Headscale {label} is too new for this agent: it accepts capability version {minimum} "
            f"(tailscale {_tailscale(minimum)}) and newer, this agent speaks {capability_version} "
            f"({_tailscale(capability_version)}); upgrade the agent")
    if minor > NEWEST_HEADSCALE:
        return f"Headscale {label} is newer than the versions this agent was tested with ({supported})"
    return ""


def refusal(status: int, body: bytes, capability_version: int, *, path: str) -> UnsupportedServer | None:
    """The error for Headscale's answer to a client below its minimum, or None for other answers."""
    text = body.decode(errors="replace").strip()
    if status != 400 or "unsupported client version" not in text:
        return None
    return UnsupportedServer(
        f"Headscale refused this agent's capability version {capability_version} "
        f"({_tailscale(capability_version)}) on {path}: {text[:200]}; the server is too new for this agent: "
        "upgrade the agent")
