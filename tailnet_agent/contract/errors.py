"""The one error of the contract's parsers."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem (a variable or a mounted file); ``str()`` is one line meant for the
    pod's log and names the variable or file."""
