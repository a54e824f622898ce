"""The runtime's `Clock` seam; the implementation lives in :mod:`tailnet_operator.clock`.

It sits outside the runtime package so the agent can share it without importing the runtime (and
with it the Kubernetes client, about a second and a hundred megabytes).
"""

from tailnet_operator.clock import Clock, FakeClock, RealClock

__all__ = ["Clock", "FakeClock", "RealClock"]
