"""Entry point of the agent. AGENT_MODE selects the direction and has no default.

``egress`` runs the node, the local egress listeners and the health server until SIGTERM or SIGINT
(exit 0); ``ingress`` the node, the exposes' tailnet listeners (followed from
``TAILNET_EXPOSES_FILE``) and the health server. Startup problems are one line on stderr and a
non-zero exit: 2 for configuration (including AGENT_MODE), 1 when the node fails (e.g. control
refuses the pre-auth key).

Shutdown (SIGTERM or SIGINT), in this order: ``/readyz`` turns 503; an ingress whose node holds its
hostname keeps accepting until control renames it (its successor took the name) or the drain
share of the drain deadline passes, and one whose replicas share an address withdraws its route to
it and keeps accepting until control has moved it to another replica, and an egress keeps accepting
until no client has connected for a while (a kube-proxy with no other endpoint, or a late one,
still sends here; ``tailnet_agent/handover.py``); every listener closes (no new connection), the
open connections finish within what is left of ``TAILNET_DRAIN_TIMEOUT`` (HTTP/1.1 after their
current request, HTTP/2 once their streams are done; what is left then is reset), and the node
logs out of control, so Headscale deletes the ephemeral node at once instead of ageing it out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import structlog

from tailnet_agent.contract import environment as env_names


class _Stop(Exception):
    """Raised inside the TaskGroup to end it on a signal."""


def _configure_logging() -> None:
    level = logging.getLevelNamesMapping().get(os.environ.get(env_names.LOG_LEVEL, "info").upper(), logging.INFO)
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if os.environ.get(env_names.LOG_FORMAT) == "json"
        else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)


async def run_agent(mode: str) -> int:
    from collections.abc import Callable, Coroutine, Mapping
    from typing import Any

    from tailnet_agent import config
    from tailnet_agent.contract.clock import RealClock
    from tailnet_agent.control import ControlOptions, RegistrationError
    from tailnet_agent.handover import (
        HOLD_SHARE,
        holds_name,
        serve_until_handed_over,
        serve_while_sought,
    )
    from tailnet_agent.health import AgentMetrics, HealthServer
    from tailnet_agent.limits import ConnectionGate
    from tailnet_agent.node import Node, NodeOptions
    from tailnet_agent.probe import Prober, Warmup
    from tailnet_agent.targets import TargetsWatcher

    cfg = config.load(mode=mode)
    clock = RealClock()
    control = ControlOptions(url=cfg.control_url, auth_key=cfg.auth_key, auth_key_file=cfg.auth_key_file,
                             hostname=cfg.hostname, ca_bundle=cfg.ca_bundle)
    node = Node(NodeOptions(control=control, accept_routes=cfg.accept_routes, dial_timeout=cfg.dial_timeout,
                            udp_port=cfg.udp_port, shared_addresses=tuple(map(str, cfg.shared_addresses))),
                clock=clock)
    metrics = AgentMetrics(node)
    cfg.limits.report(metrics)
    gate = ConnectionGate.of(cfg.limits, metrics)
    watcher: TargetsWatcher[Any] | None = None
    status: Callable[[], Mapping[str, object]]
    work: Coroutine[Any, Any, None]
    drain: Callable[[], Coroutine[Any, Any, None]]
    warmup: Callable[[], list[str]] | None = None
    quiet_for: Callable[[], float] | None = None
    """Egress: seconds since a client last connected, which decides how long a stopping agent accepts."""
    if mode == env_names.EGRESS:
        from tailnet_agent.forward import EgressForwarder
        from tailnet_agent.status import egress_status

        prober = Prober(node, clock, metrics=metrics)
        forwarder = EgressForwarder(node, cfg.targets, bind_address=cfg.bind_address,
                                    dial_timeout=cfg.dial_timeout, metrics=metrics, prober=prober, gate=gate)
        warmup = Warmup(prober, lambda: [t.name for t in forwarder.targets], lambda: node.ready, clock).waiting
        if cfg.targets_file is not None:
            watcher = TargetsWatcher(cfg.targets_file, forwarder.apply, clock=clock,
                                     initial_digest=cfg.targets_digest, report=metrics.targets_reload_outcome)
        work, status = forwarder.run(), lambda: egress_status(node, forwarder, watcher)
        drain, quiet_for = forwarder.drain, forwarder.quiet_for
    else:
        from tailnet_agent.contract.exposes import parse_exposes
        from tailnet_agent.forward.ingress import Ingress, LocalDialer
        from tailnet_agent.status import ingress_status

        ingress = Ingress(node, cfg.exposes, dial_timeout=cfg.dial_timeout, metrics=metrics,
                          prober=Prober(LocalDialer(), clock, metrics=metrics), limits=cfg.limits, gate=gate)
        assert cfg.exposes_file is not None
        watcher = TargetsWatcher(cfg.exposes_file, ingress.forwarder.apply, clock=clock,
                                 initial_digest=cfg.targets_digest, report=metrics.targets_reload_outcome,
                                 parse=parse_exposes, what="exposes")
        work, status = ingress.forwarder.run(), lambda: ingress_status(node, ingress, watcher)
        drain = ingress.forwarder.drain
    health = HealthServer(node, metrics, host=cfg.health_host, port=cfg.health_port, status=status, warmup=warmup)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def until_signal() -> None:
        await stop.wait()
        log = structlog.get_logger("agent")
        log.info("stopping: not ready, then draining", drain_timeout=cfg.drain_timeout)
        health.stopping = True
        budget = cfg.drain_timeout
        if mode == env_names.INGRESS and node.shared_routes:
            log.info("withdrawing the shared address", routes=list(node.shared_routes))
            await node.withdraw_shared()
            held = await serve_while_sought(node.shared_quiet_for, clock, budget * HOLD_SHARE)
            log.info("served until the shared address moved", seconds=round(held, 1),
                     quiet_for=round(node.shared_quiet_for(), 1), routes=list(node.shared_routes))
            budget -= held
        elif mode == env_names.INGRESS:
            held = await serve_until_handed_over(lambda: holds_name(node.netmap, cfg.hostname), clock,
                                                 budget * HOLD_SHARE)
            if held > 0:
                log.info("served until the name was handed over", seconds=round(held, 1),
                         handed_over=not holds_name(node.netmap, cfg.hostname))
            budget -= held
        elif quiet_for is not None:
            held = await serve_while_sought(quiet_for, clock, budget * HOLD_SHARE)
            log.info("served until no new connection came", seconds=round(held, 1), quiet_for=round(quiet_for(), 1))
            budget -= held
        if budget > 0:
            try:
                async with asyncio.timeout(budget):
                    await drain()
                log.info("connections drained")
            except TimeoutError:
                log.warning("drain timeout passed; the connections left are reset")
        await node.logout()
        raise _Stop

    failure: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(node.run(), name="node")
            tg.create_task(health.run(), name="health")
            tg.create_task(work, name=mode)
            if watcher is not None:
                tg.create_task(watcher.run(), name=f"{watcher.what}-file")
            tg.create_task(until_signal(), name="signals")
    except* _Stop:
        structlog.get_logger("agent").info("stopped by signal")
    except* (RegistrationError, OSError) as group:
        failure = group.exceptions[0]
    if failure is not None:
        print(f"tailnet-agent: {failure}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    mode = os.environ.get(env_names.AGENT_MODE, "")
    if mode not in env_names.MODES:
        shown = repr(mode) if mode else "unset"
        print(f"tailnet-agent: {env_names.AGENT_MODE} is {shown}; set it to one of: {', '.join(env_names.MODES)}",
              file=sys.stderr)
        return 2
    from tailnet_agent.contract.errors import ConfigError
    from tailnet_agent.memory import fix_mmap_threshold

    _configure_logging()
    fix_mmap_threshold()
    try:
        return asyncio.run(run_agent(mode))
    except ConfigError as exc:
        print(f"tailnet-agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
