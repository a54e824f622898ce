"""Jittered exponential backoff: the project's one implementation, used by the agent's control
client and DERP supervisor and by the operator's informers (stdlib only, so cheap to import; in
the contract so that neither package imports the other for it)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Backoff:
    """Delays of ``initial * multiplier**n`` seconds, capped at ``maximum``, times a random factor
    in ``[jitter_low, jitter_high)``; ``reset()`` after a success.

    The defaults (1 s doubling to 30 s, factor 0.5 to 1.0) suit the control connection; the
    DERP supervisor uses tailscaled's 0.1 s to 5 s with a factor of 0.5 to 1.5.
    """

    initial: float = 1.0
    """Seconds before the first retry, before jitter."""
    maximum: float = 30.0
    """Cap in seconds, before jitter."""
    multiplier: float = 2.0
    """Growth per consecutive failure."""
    jitter_low: float = 0.5
    jitter_high: float = 1.0
    _attempts: int = 0
    _random: Callable[[], float] = field(default=random.random, repr=False)  # for tests

    def next(self) -> float:
        delay = min(self.maximum, self.initial * self.multiplier ** self._attempts)
        self._attempts += 1
        return delay * (self.jitter_low + (self.jitter_high - self.jitter_low) * self._random())

    def reset(self) -> None:
        self._attempts = 0


def derp_backoff(**overrides: Any) -> Backoff:
    """tailscaled's DERP reconnect schedule: 0.1 s doubling to 5 s, jitter 0.5 to 1.5."""
    settings: dict[str, Any] = {"initial": 0.1, "maximum": 5.0, "jitter_low": 0.5, "jitter_high": 1.5}
    settings.update(overrides)
    return Backoff(**settings)
