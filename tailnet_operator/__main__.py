"""Entry point of the controller manager: flags, logging, then run until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

import structlog

from tailnet_operator import __version__, logs
from tailnet_operator.controllers.gateway import GatewaySettings
from tailnet_operator.controllers.setup import setup
from tailnet_operator.names import LEADER_ELECTION_ID, OPERATOR
from tailnet_operator.resources.gateway import DEFAULT_ROUTER_IMAGE
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import KubeError
from tailnet_operator.runtime.events import EventRecorder
from tailnet_operator.runtime.kinds import Resource
from tailnet_operator.runtime.leaderelection import default_identity
from tailnet_operator.runtime.manager import LeadershipLost, Manager, ManagerOptions

log = structlog.get_logger("tailnet-operator")

FALLBACK_AGENT_IMAGE = "localhost/tailnet-operator:dev"
POD = Resource("", "v1", "pods", "Pod")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    parser = argparse.ArgumentParser(prog="tailnet-operator", description=__doc__)
    parser.add_argument("--kubeconfig", default=os.environ.get("TAILNET_KUBECONFIG"),
                        help="kubeconfig to use; default: in-cluster, then $KUBECONFIG, then ~/.kube/config")
    parser.add_argument("--context", default=None, help="kubeconfig context; default: the current one")
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "tailnet-system"),
                        help="the operator's namespace: egresses, its Secrets and its Lease (default tailnet-system)")
    parser.add_argument("--metrics-bind-address", default="0.0.0.0:8080",
                        help="host:port of /metrics (default 0.0.0.0:8080; 0 disables)")
    parser.add_argument("--health-probe-bind-address", default="0.0.0.0:8081",
                        help="host:port of /healthz and /readyz (default 0.0.0.0:8081; 0 disables)")
    parser.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=in_cluster,
                        help="elect a leader on a Lease before reconciling (default: on in a cluster)")
    parser.add_argument("--log-format", choices=["console", "json"], default="json" if in_cluster else "console")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--agent-image", default=os.environ.get("TAILNET_AGENT_IMAGE"),
                        help="image of the egress/ingress agent pods; default: the operator's own image "
                             "(read from its Pod, POD_NAME), else " + FALLBACK_AGENT_IMAGE)
    parser.add_argument("--agent-metrics-namespace-selector", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                        help="labels of the namespaces whose pods may scrape the agents' /metrics "
                             "(their NetworkPolicy admits only the operator otherwise)")
    parser.add_argument("--gateway-namespace", default=os.environ.get("TAILNET_GATEWAY_NAMESPACE", "tailnet-gateway"),
                        help="where TailnetGateway routers and their CoreDNS run (Pod Security privileged: "
                             "a router needs the TUN device and NET_ADMIN)")
    parser.add_argument("--gateway-router-image",
                        default=os.environ.get("TAILNET_GATEWAY_ROUTER_IMAGE") or DEFAULT_ROUTER_IMAGE,
                        help="the image of the TailnetGateway routers (tailscaled, its CLI and a shell; a "
                             f"TailnetGateway's spec.image is ignored); default {DEFAULT_ROUTER_IMAGE}")
    parser.add_argument("--gateway-router-sysctls", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("TAILNET_GATEWAY_ROUTER_SYSCTLS") == "true",
                        help="set IP forwarding on the router pods with their sysctls (the nodes' kubelets must "
                             "allow net.ipv4.ip_forward and net.ipv6.conf.all.forwarding); default: "
                             "TAILNET_GATEWAY_ROUTER_SYSCTLS=true, else off: the "
                             "pods inherit the node's IPv4 forwarding")
    parser.add_argument("--version", action="version", version=f"tailnet-operator {__version__}")
    return parser.parse_args(argv)


def parse_labels(text: str) -> dict[str, str]:
    """``a=b,c=d`` -> ``{"a": "b", "c": "d"}``; ArgumentTypeError names a malformed entry."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
        labels[key] = value
    return labels


def build_manager(args: argparse.Namespace) -> Manager:
    options = ManagerOptions(
        metrics_bind_address=args.metrics_bind_address,
        health_probe_bind_address=args.health_probe_bind_address,
        field_manager=OPERATOR,
        leader_election=args.leader_elect,
        leader_election_id=LEADER_ELECTION_ID,
        leader_election_namespace=args.namespace,
    )
    return Manager(rest_config.load(args.kubeconfig, context=args.context), options)


async def agent_image(manager: Manager, args: argparse.Namespace) -> str:
    """The flag; else the image the operator itself runs (one image carries both binaries)."""
    if args.agent_image:
        return str(args.agent_image)
    pod_name = os.environ.get("POD_NAME", "")
    if not pod_name:
        return FALLBACK_AGENT_IMAGE
    try:
        # The manager's client opens only when the manager runs; this read comes before.
        async with Client(manager.client.config, field_manager=OPERATOR) as client:
            pod = await client.get(POD, pod_name, args.namespace)
    except KubeError as exc:
        log.warning("cannot read the operator's own Pod for its image", error=str(exc),
                    fallback=FALLBACK_AGENT_IMAGE)
        return FALLBACK_AGENT_IMAGE
    containers = pod["spec"]["containers"]
    return str(next((c for c in containers if c["name"] == "manager"), containers[0])["image"])


async def run(args: argparse.Namespace) -> int:
    manager = build_manager(args)
    identity = manager.elector.identity if manager.elector is not None else default_identity()
    setup(manager, namespace=args.namespace,
          events=EventRecorder(manager.client, reporting_controller=OPERATOR, reporting_instance=identity,
                               clock=manager.clock),
          agent_image=await agent_image(manager, args),
          agent_metrics_namespaces=parse_labels(args.agent_metrics_namespace_selector),
          tenant_role=os.environ.get("TAILNET_TENANT_CLUSTER_ROLE") or "tailnet-operator-tenant",
          service_account=os.environ.get("TAILNET_SERVICE_ACCOUNT") or "tailnet-operator",
          gateway=GatewaySettings(namespace=args.gateway_namespace, router_image=args.gateway_router_image,
                                  router_sysctls=args.gateway_router_sysctls))
    log.info("starting", version=__version__, api_server=manager.client.config.host, namespace=args.namespace,
             metrics=args.metrics_bind_address, probes=args.health_probe_bind_address,
             leader_election=args.leader_elect)
    await manager.run(handle_signals=True)
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from tailnet_operator.cli.main import COMMANDS
    from tailnet_operator.cli.main import main as cli_main

    if argv and argv[0] in COMMANDS:
        return cli_main(argv)
    args = parse_args(argv)
    logs.configure(args.log_format, args.log_level)
    try:
        return asyncio.run(run(args))
    except rest_config.ConfigError as exc:
        print(f"tailnet-operator: {exc}", file=sys.stderr)
        return 1
    except LeadershipLost as exc:
        log.error("exiting", reason=str(exc))
        return 1
    except KubeError as exc:
        print(f"tailnet-operator: cannot talk to kube-apiserver: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
