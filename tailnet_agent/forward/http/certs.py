"""The certificate store: each virtual host's TLS context, re-read when its files change.

Files are checked by ``stat`` (before each handshake and for ``/status``), not watched, so a
kubelet symlink swap is seen without a watcher task: new handshakes get the new certificate, open
connections keep theirs. A file that does not load keeps the certificate in force and shows its
error on ``/status``.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from datetime import datetime

import structlog
from cryptography import x509

from tailnet_agent.contract.exposes import VirtualHost
from tailnet_agent.contract.status import HostEntry

log = structlog.get_logger("agent.http")


@dataclass
class _Loaded:
    stamp: tuple[object, ...] = ()
    context: ssl.SSLContext | None = None
    not_after: datetime | None = None
    error: str | None = None


class CertificateStore:
    """The TLS context of each virtual host, loaded from its files and re-loaded when they change."""

    def __init__(self, hosts: tuple[VirtualHost, ...]) -> None:
        self.hosts = hosts
        self._loaded = {host.name: _Loaded() for host in hosts}
        self.refresh()

    def refresh(self) -> None:
        """Load each host whose files changed (kubelet swaps a symlink: ``stat`` follows it)."""
        for host in self.hosts:
            state = self._loaded[host.name]
            try:
                stamp = tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, (host.cert_file,
                                                                                          host.key_file)))
            except OSError as exc:
                self._failed(host, state, (), f"cannot read {exc.filename}: {exc.strerror or exc}")
                continue
            if stamp == state.stamp:
                continue
            try:
                context = server_context()
                context.load_cert_chain(host.cert_file, host.key_file)
                with open(host.cert_file, "rb") as f:
                    not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._failed(host, state, stamp, f"cannot load {host.cert_file} and {host.key_file}: {exc}")
                continue
            if state.context is not None:
                log.info("certificate reloaded", host=host.name, not_after=not_after.isoformat())
            self._loaded[host.name] = _Loaded(stamp, context, not_after)

    def _failed(self, host: VirtualHost, state: _Loaded, stamp: tuple[object, ...], error: str) -> None:
        if error != state.error:
            log.error("certificate not loaded; the one in force stays", host=host.name, error=error)
        state.stamp, state.error = stamp, error

    def status(self) -> list[HostEntry]:
        """Each host's entry of ``/status`` (its files are checked for a change first)."""
        self.refresh()
        return [{"name": h.name, "alias": h.alias, "error": self._loaded[h.name].error,
                 "notAfter": _iso(self._loaded[h.name].not_after)} for h in self.hosts]

    def context(self, host: VirtualHost) -> ssl.SSLContext | None:
        """The host's TLS context; None while none could be loaded."""
        return self._loaded[host.name].context


def server_context() -> ssl.SSLContext:
    """A server context for TLS 1.2+ offering ``h2`` and ``http/1.1`` by ALPN (the listener's, which
    SNI replaces, and each host's)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


def _iso(when: datetime | None) -> str | None:
    return when.isoformat().replace("+00:00", "Z") if when else None
