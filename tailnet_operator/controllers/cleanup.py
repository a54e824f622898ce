"""The Headscale half of every finalizer: bounded, and skippable with an annotation.

A Tailnet expires its working API key, an egress or ingress its pre-auth key, a gateway (under
``deletionPolicy: Delete``) its node, before the finalizer comes off. None of them may hang an
uninstall when Headscale is unreachable, so every one goes through :meth:`Cleanup.run`:

* the annotation :data:`SKIP_CLEANUP_ANNOTATION` (``tailnet.dev/skip-cleanup: "true"``) on the
  object being deleted skips the Headscale cleanup at once, with a Warning Event
  ``CleanupSkipped`` naming what was left behind (the orphan sweep, :mod:`.sweep`, expires the
  keys and deletes the ephemeral nodes of CRs later; a Tailnet's working key expires on its own);
* one attempt is bounded by :data:`ATTEMPT_TIMEOUT`; a failed attempt is retried every
  :data:`RETRY_SECONDS` until the object has been deleting for :data:`GIVE_UP` (5 minutes), then
  the finalizer lets go with a Warning Event (the kind's own reason, e.g. ``PreAuthKeyNotExpired``)
  that says what to remove by hand;
* an error that retrying cannot heal (``final``, e.g. the key is already gone) lets go at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import structlog

from tailnet_operator.headscale import HeadscaleError
from tailnet_operator.runtime import Clock, EventRecorder, Result
from tailnet_operator.types import JSON

from . import periods
from .access import NoAccess, Problem

__all__ = ["ATTEMPT_TIMEOUT", "GIVE_UP", "RETRY_SECONDS", "SKIP_CLEANUP_ANNOTATION", "Cleanup", "skip_cleanup"]

log = structlog.get_logger("controllers.cleanup")

SKIP_CLEANUP_ANNOTATION = "tailnet.dev/skip-cleanup"
"""Set to ``"true"`` on an object to let its finalizer go without touching Headscale."""
GIVE_UP = periods.CLEANUP_GIVE_UP
RETRY_SECONDS = periods.CLEANUP_RETRY
ATTEMPT_TIMEOUT = periods.CLEANUP_ATTEMPT_TIMEOUT

CLEANUP_ERRORS = (HeadscaleError, NoAccess, Problem, TimeoutError)


def skip_cleanup(obj: JSON) -> bool:
    """Whether ``obj`` carries ``tailnet.dev/skip-cleanup: "true"``."""
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(SKIP_CLEANUP_ANNOTATION, "")
    return str(value).strip().lower() == "true"


class Cleanup:
    """Runs one object's Headscale cleanup under the rules of the module docstring."""

    def __init__(self, events: EventRecorder, clock: Clock, *, give_up: timedelta = GIVE_UP,
                 attempt_timeout: float = ATTEMPT_TIMEOUT) -> None:
        self.events = events
        self.clock = clock
        self.give_up = give_up
        self.attempt_timeout = attempt_timeout

    def deleting_for(self, obj: JSON) -> timedelta:
        stamp = obj["metadata"].get("deletionTimestamp")
        if not stamp:
            return timedelta(0)
        return self.clock.utcnow() - datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))

    def still_trying(self, obj: JSON) -> bool:
        """Whether ``obj`` has been deleting for less than the bound."""
        return self.deleting_for(obj) < self.give_up

    async def run(self, obj: JSON, work: Callable[[], Awaitable[None]], *, what: str, reason: str, hint: str,
                  final: Callable[[BaseException], bool] = lambda exc: False) -> Result | None:
        """Run ``work`` (the cleanup of ``what``, e.g. "pre-auth key hskey-auth-abc-***").

        Returns a Result to requeue while it is still worth retrying; None when the finalizer may
        come off (done, skipped, or given up: then a Warning Event ``reason`` ends with ``hint``).
        """
        meta = obj["metadata"]
        if skip_cleanup(obj):
            await self.events.warning(obj, "CleanupSkipped",
                                      f"{SKIP_CLEANUP_ANNOTATION} is set: left {what} in Headscale; {hint}",
                                      action="Cleanup")
            log.info("cleanup skipped by annotation", kind=obj.get("kind"), name=meta["name"], what=what)
            return None
        try:
            async with asyncio.timeout(self.attempt_timeout):
                await work()
            return None
        except CLEANUP_ERRORS as exc:
            error = str(exc) or f"no answer within {self.attempt_timeout:g}s"
            if not final(exc) and self.still_trying(obj):
                log.info("cleanup failed; retrying", kind=obj.get("kind"), name=meta["name"], what=what,
                         error=type(exc).__name__, reason=error)
                return Result(requeue_after=RETRY_SECONDS)
            waited = "" if final(exc) else f" (gave up after {_duration(self.give_up)})"
            await self.events.warning(obj, reason, f"could not clean up {what}{waited}: {error}; {hint}",
                                      action="Cleanup")
            return None


def _duration(value: timedelta) -> str:
    seconds = int(value.total_seconds())
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
