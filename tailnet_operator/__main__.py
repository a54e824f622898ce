"""Entry point of the controller manager: flags, logging, then run until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from tailnet_operator import __version__, logs
from tailnet_operator.runtime import config as rest_config

log = structlog.get_logger("tailnet-operator")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tailnet-operator", description=__doc__)
    parser.add_argument("--kubeconfig", default=os.environ.get("TAILNET_KUBECONFIG"),
                        help="kubeconfig to use; default: in-cluster, then $KUBECONFIG, then ~/.kube/config")
    parser.add_argument("--context", default=None, help="kubeconfig context; default: the current one")
    parser.add_argument("--metrics-bind-address", default="0.0.0.0:8080",
                        help="host:port of /metrics (default 0.0.0.0:8080; 0 disables)")
    parser.add_argument("--health-probe-bind-address", default="0.0.0.0:8081",
                        help="host:port of /healthz and /readyz (default 0.0.0.0:8081; 0 disables)")
    parser.add_argument("--log-format", choices=["console", "json"],
                        default="json" if os.environ.get("KUBERNETES_SERVICE_HOST") else "console")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


async def _serve(app: web.Application, address: str) -> web.AppRunner | None:
    if address == "0":
        return None
    host, _, port = address.rpartition(":")
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
    return runner


async def run(args: argparse.Namespace) -> int:
    cfg = rest_config.load(args.kubeconfig, context=args.context)
    registry = CollectorRegistry()
    build_info = Gauge("tailnet_operator_build_info", "Version of the running operator.", ["version"],
                       registry=registry)
    build_info.labels(__version__).set(1)
    headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
    async with aiohttp.ClientSession(headers=headers,
                                     connector=aiohttp.TCPConnector(ssl=cfg.ssl_context())) as session:
        async with session.get(f"{cfg.host}/version", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            version = (await resp.json())["gitVersion"]
        log.info("connected to kube-apiserver", host=cfg.host, server_version=version)

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        probes = web.Application()
        probes.add_routes([web.get("/healthz", ok), web.get("/readyz", ok)])
        metrics_app = web.Application()
        metrics_app.add_routes([web.get("/metrics", metrics)])
        runners = [await _serve(probes, args.health_probe_bind_address),
                   await _serve(metrics_app, args.metrics_bind_address)]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info("operator running", metrics=args.metrics_bind_address,
                 probes=args.health_probe_bind_address)
        await stop.wait()
        log.info("shutting down")
        for runner in runners:
            if runner is not None:
                await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure(args.log_format, args.log_level)
    try:
        return asyncio.run(run(args))
    except rest_config.ConfigError as exc:
        print(f"tailnet-operator: {exc}", file=sys.stderr)
        return 1
    except aiohttp.ClientError as exc:
        print(f"tailnet-operator: cannot reach kube-apiserver: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
