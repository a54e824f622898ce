"""The Widget controller of the runtime benchmark on this project's runtime (``e2e/widgets.py``'s
reconciler), as a process of its own: ``python -m benchmarks.runtime.ours KUBECONFIG NAMESPACE [WORKERS]``.

The reconciler finishes its work in one pass, so it runs with ``ignore_own_writes``: the answers
of its own two writes do not queue it again (controller-runtime's version of the benchmark gets
the same from ``GenerationChangedPredicate`` on the Widget, kopf from its handled-spec annotation)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from e2e.widgets import WIDGET, WidgetReconciler
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.controller import APISERVER_WORKERS, ControllerOptions
from tailnet_operator.runtime.kinds import CONFIG_MAP
from tailnet_operator.runtime.manager import Manager, ManagerOptions

WORKERS = APISERVER_WORKERS


async def main(kubeconfig: Path, namespace: str, workers: int = WORKERS) -> None:
    manager = Manager(rest_config.load(kubeconfig), ManagerOptions(field_manager="widget-controller",
                                                                   graceful_shutdown_timeout=2),
                      registry=CollectorRegistry())
    reconciler = WidgetReconciler(manager.cache, manager.writer())
    (manager.controller("widget", reconciler, options=ControllerOptions(workers=workers, ignore_own_writes=True))
     .for_(WIDGET, namespace=namespace).owns(CONFIG_MAP, namespace=namespace))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, manager.stop)
    loop.add_signal_handler(signal.SIGINT, manager.stop)
    await manager.run()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:4])))
