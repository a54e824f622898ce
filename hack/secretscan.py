"""Finding secret material in text: log lines, Events, status, metrics.

Two nets. The values a test knows it created (API keys, pre-auth keys, private keys, TLS keys)
are looked for as they are and in the encodings a careless log line would use (hex, standard
and URL-safe base64, Tailscale's ``privkey:`` form). Patterns catch the key formats in general:
a full Headscale key (``hskey-api-<12>-<secret>`` / ``hskey-auth-<12>-<secret>``; the masked
``...-***`` form is allowed), ``privkey:<hex>``, and PEM private key blocks.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PATTERNS: Mapping[str, re.Pattern[str]] = {
    "Headscale API key": re.compile(r"hskey-api-[A-Za-z0-9_-]{12}-[A-Za-z0-9_-]{16,}"),
    "Headscale pre-auth key": re.compile(r"hskey-auth-[A-Za-z0-9_-]{12}-[A-Za-z0-9_-]{16,}"),
    "Tailscale private key": re.compile(r"privkey:[0-9a-f]{64}"),
    "PEM private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
}
MIN_SECRET_LEN = 16
"""Known values shorter than this are not searched for (too likely to occur by chance)."""


@dataclass(frozen=True)
class Finding:
    source: str
    """Where the text came from (a log, an Event, a status)."""
    what: str
    """Which secret or pattern matched."""
    excerpt: str
    """The matching line, cut to 160 characters."""


def encodings(value: str | bytes) -> set[str]:
    """``value`` and its hex, base64 and Tailscale text forms (for raw 32-byte keys)."""
    raw = value.encode() if isinstance(value, str) else value
    forms = {raw.hex(), base64.b64encode(raw).decode().rstrip("="),
             base64.urlsafe_b64encode(raw).decode().rstrip("=")}
    if isinstance(value, str):
        forms.add(value)
    if len(raw) == 32:
        forms.add(f"privkey:{raw.hex()}")
    return {form for form in forms if len(form) >= MIN_SECRET_LEN}


class SecretScanner:
    """``scan(source, lines)`` records findings; ``lines_checked`` counts every line seen."""

    def __init__(self, known: Mapping[str, str | bytes]) -> None:
        self._known = {form: name for name, value in known.items() for form in encodings(value)}
        self.findings: list[Finding] = []
        self.lines_checked = 0

    @property
    def forms(self) -> int:
        """How many strings (secrets in their encodings) are looked for."""
        return len(self._known)

    def add(self, name: str, value: str | bytes) -> None:
        for form in encodings(value):
            self._known[form] = name

    def scan(self, source: str, lines: Iterable[str]) -> list[Finding]:
        found: list[Finding] = []
        for line in lines:
            self.lines_checked += 1
            for form, name in self._known.items():
                if form in line:
                    found.append(Finding(source, name, line.replace(form, f"<{name}>")[:160]))
            for name, pattern in PATTERNS.items():
                if pattern.search(line):
                    found.append(Finding(source, name, pattern.sub(f"<{name}>", line)[:160]))
        self.findings.extend(found)
        return found

    def scan_text(self, source: str, text: str) -> list[Finding]:
        return self.scan(source, text.splitlines())

    def add_pem(self, name: str, pem: str) -> None:
        """Every base64 line of a PEM private key, so a fragment of it is found too."""
        for line in pem.splitlines():
            if not line.startswith("-----") and len(line) >= MIN_SECRET_LEN:
                self._known[line.strip()] = name
