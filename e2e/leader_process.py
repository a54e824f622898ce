"""One leader-election candidate in a process of its own, so a test can SIGKILL it.

    python -m e2e.leader_process --kubeconfig K --name N --namespace NS --identity ID \
        [--lease-duration 3] [--renew-deadline 2] [--retry-period 0.25]

Prints `leading <identity>` once it leads. SIGTERM steps down gracefully (releases the Lease);
SIGKILL is the crash the tests are after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.client.config import load
from tailnet_operator.runtime.leaderelection import LeaderElectionConfig, LeaderElector


async def campaign(args: argparse.Namespace) -> None:
    config = LeaderElectionConfig(lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
                                  retry_period=args.retry_period, identity=args.identity)
    async with Client(load(args.kubeconfig)) as client:
        elector = LeaderElector(client, name=args.name, namespace=args.namespace, config=config)
        run = asyncio.create_task(elector.run())
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, run.cancel)
        leading = asyncio.create_task(elector.wait_leading())
        await asyncio.wait([run, leading], return_when=asyncio.FIRST_COMPLETED)
        if leading.done():
            print(f"leading {args.identity}", flush=True)
        leading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--identity", required=True)
    parser.add_argument("--lease-duration", type=float, default=3.0)
    parser.add_argument("--renew-deadline", type=float, default=2.0)
    parser.add_argument("--retry-period", type=float, default=0.25)
    asyncio.run(campaign(parser.parse_args()))


if __name__ == "__main__":
    main()
