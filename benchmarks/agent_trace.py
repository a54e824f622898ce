"""The agent's own entry point with a trace of every map message it applies, for the tailnet-scale
benchmark (:mod:`benchmarks.tailnet_scale`).

``BENCH_AGENT_TRACE=FILE python -m benchmarks.agent_trace`` runs ``tailnet_agent.__main__`` as is,
with a wrapper around the control client's message handler and the node's netmap steps: one JSON
line per message that is not a keep-alive, with when it was applied, its wall and CPU time, the
peers and filter rules held after it, the node keys it added, and the milliseconds of each step
(the peers' and the filter's projection, the data plane's ``upsert_peers``, ``remove_peers`` and
``set_filter``, disco's peers). Standard library and the agent only, so the process's memory is the
agent's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRACE = "BENCH_AGENT_TRACE"
"""Where the trace is written (JSON lines, appended)."""


def main() -> int:
    from tailnet_agent import __main__ as agent_main
    from tailnet_agent import disco as disco_module
    from tailnet_agent import node as node_module
    from tailnet_agent import projection as projection_module
    from tailnet_agent.control import client as client_module
    from tailnet_agent.control import netmap as nm

    out = Path(os.environ[TRACE]).open("a", buffering=1)  # noqa: SIM115 - open for the process's life
    steps: dict[str, float] = {}

    def timed(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                steps[name] = steps.get(name, 0.0) + (time.perf_counter() - start) * 1000

        return wrapper

    steps_of: tuple[tuple[object, str, str], ...] = (
        (node_module, "filter_rules", "filter_rules"),
        (projection_module.PeerProjection, "update", "project_peers"),
        (disco_module.Disco, "update_peers", "disco_update"))
    for owner, name, step in steps_of:
        setattr(owner, name, timed(step, getattr(owner, name)))

    class TimedDataPlane:
        """The data plane as the netmap step sees it, with its peer and filter calls timed."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self._inner, name)
            return timed(name, attr) if name in ("set_filter", "set_peers", "upsert_peers", "remove_peers") else attr

    on_netmap = node_module.Node._on_netmap

    def traced_netmap(self: Any, netmap: Any) -> None:
        real = self.dataplane
        self.dataplane = TimedDataPlane(real)  # only for this step: the data path keeps the real one
        try:
            timed("on_netmap", on_netmap)(self, netmap)
        finally:
            self.dataplane = real

    handle = client_module.ControlClient._handle

    def traced(self: Any, message: dict[str, Any]) -> None:
        steps.clear()
        start, cpu = time.perf_counter(), time.thread_time()
        handle(self, message)
        if nm.is_keepalive(message) or self.netmap is None:
            return
        netmap = self.netmap
        line = {"t": time.time(), "ms": (time.perf_counter() - start) * 1000,
                "cpu_ms": (time.thread_time() - cpu) * 1000, "peers": len(netmap.peers),
                "full": bool(message.get("Peers")), "filter_count": len(netmap.packet_filter),
                "added": [p.get("Key") for p in message.get("PeersChanged") or ()],
                "patches": len(message.get("PeersChangedPatch") or ()), **steps}
        out.write(json.dumps(line) + "\n")

    node_module.Node._on_netmap = traced_netmap  # type: ignore[method-assign]
    client_module.ControlClient._handle = traced  # type: ignore[method-assign]
    return agent_main.main()


if __name__ == "__main__":
    sys.exit(main())
