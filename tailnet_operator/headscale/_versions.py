"""What each Headscale minor's REST API can do, as read from its sources (docs/compatibility.md).

The client asks ``GET /version`` once (0.27+; 0.26 answers 404, so a 404 means 0.26) and
adapts the few calls whose shape differs:

========================  =====  =====  =====  =====  =====
feature                   0.26   0.27   0.28   0.29   0.30
========================  =====  =====  =====  =====  =====
``GET /version``          no     yes    yes    yes    yes
``GET /api/v1/health``    no     yes    yes    yes    yes
API key expire by id      no     no     yes    yes    yes
tag-only pre-auth keys    no     no     yes    yes    yes
pre-auth keys by id       no     no     yes    yes    yes
  (list all, expire/delete by id; before: per user, expire by user + key, no delete)
node ``tags``             no     no     yes    yes    yes
  (before: ``forcedTags`` + ``validTags``)
``POST /policy/check``    no     no     no     yes    yes
policy ``grants``         no     no     no     yes    yes
RFC 7807 errors           no     no     no     no     yes
========================  =====  =====  =====  =====  =====
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST_SUPPORTED = (0, 26)
"""The oldest Headscale minor the client (and so the operator) supports."""
NEWEST_KNOWN = (0, 30)
"""The newest Headscale minor whose API the client was written against."""

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``v0.29.2`` -> ``(0, 29, 2)``; None for anything without a version (``dev``, "")."""
    match = _VERSION.search(text)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


@dataclass(frozen=True)
class ServerFeatures:
    """What one Headscale server's API offers, derived from its version.

    ``reported`` is what ``/version`` said ("" when the server has no ``/version``, i.e. 0.26).
    A server reporting no parsable version (a development build) is taken as the newest known.
    """

    minor: tuple[int, int]
    reported: str = ""

    @classmethod
    def from_reported(cls, reported: str) -> ServerFeatures:
        if not reported:
            return cls(OLDEST_SUPPORTED, "")
        parsed = parse_version(reported)
        return cls(parsed[:2] if parsed else NEWEST_KNOWN, reported)

    @property
    def label(self) -> str:
        return self.reported or f"v{self.minor[0]}.{self.minor[1]} (no /version endpoint)"

    @property
    def supported(self) -> bool:
        return self.minor >= OLDEST_SUPPORTED

    @property
    def newer_than_known(self) -> bool:
        return self.minor > NEWEST_KNOWN

    @property
    def health_endpoint(self) -> bool:
        return self.minor >= (0, 27)

    @property
    def api_key_expire_by_id(self) -> bool:
        return self.minor >= (0, 28)

    @property
    def tag_only_preauth_keys(self) -> bool:
        return self.minor >= (0, 28)

    @property
    def preauth_keys_by_id(self) -> bool:
        return self.minor >= (0, 28)

    @property
    def policy_check(self) -> bool:
        return self.minor >= (0, 29)

    @property
    def grants(self) -> bool:
        return self.minor >= (0, 29)


def minor_text(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"
