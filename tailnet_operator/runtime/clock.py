"""The runtime's `Clock` seam; the implementation lives in :mod:`tailnet_agent.contract.clock`.

It sits in the contract between the operator and the agent so both share one Clock without the
agent importing the operator (and with it the Kubernetes client, about a second and a hundred
megabytes).
"""

from tailnet_agent.contract.clock import Clock, FakeClock, RealClock

__all__ = ["Clock", "FakeClock", "RealClock"]
