"""Forwarders between local TCP listeners and the tailnet: ``egress`` (local -> tailnet) and ``splice``."""

from .egress import Dialer, EgressForwarder
from .splice import Splice

__all__ = ["Dialer", "EgressForwarder", "Splice"]
