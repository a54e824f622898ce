"""``tailnet-operator status|diagnose|check`` and the kubectl plugin ``kubectl tailnet``.

    kubectl tailnet status tailnetegress/office        # the chain of one object, with a next step
    kubectl tailnet diagnose -n apps web-7d9f db.tailnet-system.svc
    kubectl tailnet check [--wait 120]                 # exit 0 when the installation works

Exit codes: 0 nothing wrong, 1 a problem was found, 2 usage or connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence

from tailnet_operator import __version__, logs
from tailnet_operator.names import OPERATOR
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import KubeError

from . import check, diagnose, fetch, status
from .report import Report

__all__ = ["COMMANDS", "main"]

COMMANDS = ("status", "diagnose", "check")
DEFAULT_NAMESPACE = "tailnet-system"


def _parser(prog: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", default=os.environ.get("TAILNET_KUBECONFIG"),
                        help="kubeconfig; default: in-cluster, then $KUBECONFIG, then ~/.kube/config")
    common.add_argument("--context", default=None)
    common.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE", DEFAULT_NAMESPACE),
                        help=f"where the operator runs (default {DEFAULT_NAMESPACE})")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tailnet-operator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    status_parser = sub.add_parser("status", parents=[common],
                                   help="walk one object's chain: CR, agent pod, Headscale node, policy, Tailnet")
    status_parser.add_argument("object", help="KIND/NAME, e.g. tailnetegress/office or tailnet/home")
    status_parser.add_argument("-n", "--namespace", default=None,
                               help="the object's namespace (default: the operator's)")
    diagnose_parser = sub.add_parser("diagnose", parents=[common], help="why can't POD reach TARGET")
    diagnose_parser.add_argument("pod", help="the client pod (NAME or NAMESPACE/NAME)")
    diagnose_parser.add_argument("target", help="TARGET[.NAMESPACE.svc][:PORT], EGRESS/TARGET, or the target's address")
    diagnose_parser.add_argument("-n", "--namespace", default="default", help="the pod's namespace (default: default)")
    check_parser = sub.add_parser("check", parents=[common],
                                  help="verify CRDs, operator readiness, Headscale, keys and versions")
    check_parser.add_argument("--wait", type=float, default=0.0,
                              help="retry for up to this many seconds until the check passes (post-install hook)")
    check_parser.add_argument("--interval", type=float, default=5.0, help="seconds between retries with --wait")
    return parser


async def _status(client: Client, args: argparse.Namespace) -> Report:
    kind, _, name = str(args.object).partition("/")
    if not name:
        raise ValueError("status takes KIND/NAME, e.g. tailnetegress/office")
    resource = fetch.resolve_kind(kind)
    namespace = args.namespace or args.operator_namespace
    facts = await fetch.object_facts(client, resource, name, namespace, operator_namespace=args.operator_namespace)
    if facts is None:
        where = f" in namespace {namespace}" if resource.namespaced else ""
        report = Report(f"{resource.kind} {name}")
        report.find("NotFound", f"{resource.kind} {name} does not exist{where}", f"kubectl get {resource.plural} -A")
        return report
    return status.object_status(facts)


async def _diagnose(client: Client, args: argparse.Namespace) -> Report:
    namespace, _, pod_name = str(args.pod).rpartition("/")
    namespace = namespace or args.namespace
    pod = await fetch.get_object(client, fetch.POD, pod_name, namespace)
    egresses, facts = await fetch.egress_facts_all(client, args.operator_namespace)
    return diagnose.diagnose(pod, f"{namespace}/{pod_name}", args.target, egresses, facts)


async def _check(client: Client, args: argparse.Namespace) -> Report:
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        try:
            report = check.check(await fetch.check_facts(client, args.operator_namespace))
        except KubeError as exc:
            report = Report("tailnet-operator installation")
            report.find("APIUnavailable", f"kube-apiserver: {exc}", "check the kubeconfig and RBAC")
        if report.ok or time.monotonic() + args.interval > deadline:
            return report
        print(f"not yet: {', '.join(report.causes())}; retrying", file=sys.stderr, flush=True)
        await asyncio.sleep(args.interval)


async def _run(args: argparse.Namespace) -> int:
    config = rest_config.load(args.kubeconfig, context=args.context)
    async with Client(config, field_manager=OPERATOR) as client:
        handler = {"status": _status, "diagnose": _diagnose, "check": _check}[args.command]
        report = await handler(client, args)
    sys.stdout.write(report.render())
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None, *, prog: str = "tailnet-operator") -> int:
    args = _parser(prog).parse_args(argv)
    logs.configure("console", os.environ.get("TAILNET_LOG_LEVEL", "warning"))  # stderr: stdout is the report
    try:
        return asyncio.run(_run(args))
    except (rest_config.ConfigError, KubeError, KeyError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2


def kubectl_plugin() -> int:
    """``kubectl-tailnet``: kubectl finds it on PATH and runs it as ``kubectl tailnet``."""
    return main(sys.argv[1:], prog="kubectl tailnet")


if __name__ == "__main__":
    sys.exit(main())
