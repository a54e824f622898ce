"""A mounted list file (egress targets, ingress exposes), followed while the agent runs, so a change
never restarts the pod.

Kubernetes updates a mounted ConfigMap or Secret by writing a new timestamped directory and swapping
the ``..data`` symlink; the file's path stays the same and its content changes at once. Following
that with inotify needs the directory watched and the symlink dance understood; reading the file
every ``interval`` seconds and comparing a content hash needs neither and costs one small read.
A file that does not parse keeps the targets in force: the error is logged, counted and shown on
``/status`` until a good file replaces it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import structlog

from tailnet_agent.contract.clock import Clock
from tailnet_agent.contract.environment import TARGETS_FILE
from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.contract.targets import Target, parse_targets

log = structlog.get_logger("agent.targets")

DEFAULT_INTERVAL = 2.0


class Named(Protocol):
    """An entry of a followed list: entries are told apart by name."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)


@dataclass(frozen=True)
class TargetsDiff(Generic[N]):
    """What a new list changes, by entry name."""

    added: tuple[N, ...] = ()
    removed: tuple[N, ...] = ()
    changed: tuple[N, ...] = ()
    """The new versions of entries that differ in anything but the name (the old ones are replaced)."""
    unchanged: tuple[N, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


def diff_targets(old: tuple[N, ...], new: tuple[N, ...]) -> TargetsDiff[N]:
    """Compare by name; an entry with the same name and any other field different is changed."""
    before = {t.name: t for t in old}
    after = {t.name: t for t in new}
    return TargetsDiff(
        added=tuple(t for t in new if t.name not in before),
        removed=tuple(t for t in old if t.name not in after),
        changed=tuple(t for t in new if t.name in before and before[t.name] != t),
        unchanged=tuple(t for t in new if before.get(t.name) == t))


def parse_targets_file(text: str) -> tuple[Target, ...]:
    """The file's targets; an empty list is refused as at startup (egress needs a target)."""
    targets = parse_targets(text, name=TARGETS_FILE)
    if not targets:
        raise ConfigError(f"{TARGETS_FILE} is empty (egress needs at least one target)")
    return targets


@dataclass
class ReloadState:
    """The last reload's outcome, for ``/status`` and the metrics."""

    error: str | None = None
    """Why the current file is not in force; None when it is."""
    loaded_at: datetime | None = None
    """When the targets in force were read."""
    reloads: int = 0
    errors: int = 0
    digest: str = field(default="", repr=False)


class TargetsWatcher(Generic[N]):
    """Polls ``path`` every ``interval`` seconds and hands each new list that ``parse`` accepts to
    ``apply`` (default ``parse``: the egress targets file).

    ``run`` blocks until cancelled. ``apply`` runs in the watcher's task, so reloads are serial.
    """

    def __init__(self, path: Path, apply: Callable[[tuple[N, ...]], Awaitable[object]], *, clock: Clock,
                 interval: float = DEFAULT_INTERVAL, initial_digest: str = "",
                 report: Callable[[str | None], None] | None = None,
                 parse: Callable[[str], tuple[N, ...]] | None = None, what: str = "targets") -> None:
        self.path = path
        self.apply = apply
        self.parse: Callable[[str], tuple[N, ...]] = parse or parse_targets_file  # type: ignore[assignment]
        self.what = what
        """What the list holds, for the log lines."""
        self.clock = clock
        self.interval = interval
        self.report = report
        """Told each outcome: the error, or None after a good reload (metrics)."""
        self.state = ReloadState(digest=initial_digest)
        """``initial_digest``: the SHA-256 of the file the targets in force came from."""

    async def run(self) -> None:
        if self.state.loaded_at is None:
            self.state.loaded_at = self.clock.utcnow()
        while True:
            await self.clock.sleep(self.interval)
            await self.check()

    async def check(self) -> bool:
        """Read the file once; apply it if its content changed and parses. True when applied."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            self._failed(f"cannot read {self.path}: {exc.strerror or exc}", "")
            return False
        digest = _digest(data)
        if digest == self.state.digest:
            return False
        try:
            targets = self.parse(data.decode("utf-8", errors="replace"))
        except ConfigError as exc:
            self._failed(str(exc), digest)
            return False
        await self.apply(targets)
        self.state = ReloadState(error=None, loaded_at=self.clock.utcnow(), reloads=self.state.reloads + 1,
                                 errors=self.state.errors, digest=digest)
        log.info(f"{self.what} reloaded", path=str(self.path), names=[t.name for t in targets])
        if self.report is not None:
            self.report(None)
        return True

    def _failed(self, message: str, digest: str) -> None:
        """Keep the targets in force; report a new error once (a bad file is read every interval)."""
        if message == self.state.error:
            return
        self.state.error = message
        self.state.errors += 1
        if digest:
            self.state.digest = digest
        log.error(f"{self.what} file not applied; the previous {self.what} stay in force", path=str(self.path),
                  error=message)
        if self.report is not None:
            self.report(message)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
