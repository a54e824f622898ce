"""The Gateway API's own conformance suite judges the Gateway API controller on a real node.

The suite (``sigs.k8s.io/gateway-api/conformance``, hack/gatewayconformance) runs against the
cluster as a platform engineer's CI would: the operator installed with ``kubectl apply -k``, the
Gateway API's standard CRDs, a tailnet GatewayClass, and the suite's own base manifests (its
echo backend and CoreDNS built here under the names they use). A Gateway's address is a tailnet
address, so the suite's HTTP client dials through a tailscaled "laptop"'s CONNECT proxy, as a
tailnet user would. The suite's Gateways carry no annotations: each is a node with the default
tag ``tag:k8s`` and the default hostname, in namespaces the Tailnet names as its tenants and that
bind the operator's tenant role.

``make test`` runs the GATEWAY-HTTP profile with the core features only (Gateway, HTTPRoute);
``make conformance`` runs it, the GATEWAY-GRPC profile (GRPCRoute, whose tests call gRPC on HTTP
listeners in plaintext, h2c) and the GATEWAY-TLS profile (TLSRoute, TCPRoute) with every feature
the class declares, and keeps the report under docs/conformance/. Four of the TLSRoute tests dial
the Gateway with no hook for a dialer, so the full run runs the suite on a machine of the tailnet:
a network namespace whose tailscaled runs on a TUN device, with the laptop's tag, from which every
client dials the Gateways' tailnet addresses directly.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import (
    TAILNETS,
    ClusterUnderTest,
    apply,
    condition,
    get_json,
    kubectl,
    operator_logs,
    remove_tailnet,
)
from e2e.conftest import TailscaleFactory
from e2e.operator import tailnet_object
from e2e.skips import skip_by_design
from hack import binaries, versions
from hack.localenv import Environment, Headscale, SiteHost, TailscaleNode, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parent.parent
CLASS = "tailnet-conformance"
NAMESPACES = ("gateway-conformance-infra", "gateway-conformance-app-backend", "gateway-conformance-web-backend")
"""The namespaces of the suite's base manifests (conformance/base/manifests.yaml)."""
TAG = "tag:k8s"
"""The tag of a Gateway without the ``tailnet.dev/tag`` annotation: every Gateway of the suite."""
LAPTOP_TAG = "tag:conformance-laptop"
CORE_FEATURES = ("Gateway", "HTTPRoute", "ReferenceGrant")
PROFILES = {"core": ("GATEWAY-HTTP",), "full": ("GATEWAY-HTTP", "GATEWAY-GRPC", "GATEWAY-TLS")}
"""The suite's conformance profiles each run reports on. A profile turns its core features on, so
the core run (CORE_FEATURES, no GRPCRoute) names GATEWAY-HTTP alone."""
FULL_ENV = "TAILNET_CONFORMANCE"
"""``core`` (the default, make test): the core features only; ``full`` (make conformance): every
feature the class declares, the report kept under docs/; ``off``: not run (skipped by design)."""
ONLY_ENV = "TAILNET_CONFORMANCE_ONLY"
"""A regular expression of the suite's test names (``HTTPRouteWeight|HTTPRouteMatching``): run
those alone, to look at a failure again without the rest of the suite."""
FULL_REPORT = ROOT / "docs" / "conformance" / f"gateway-api-v{versions.GATEWAY_API}-report.yaml"


def _base_policy() -> str:
    """The laptop reaches every Gateway of the suite; the Gateways' tag is owned."""
    return (f'{{"tagOwners": {{"{TAG}": [], "{LAPTOP_TAG}": []}},\n'
            f' "grants": [{{"src": ["{LAPTOP_TAG}"], "dst": ["{TAG}"], "ip": ["*"]}}]}}\n')


def _tenant_binding(namespace: str, operator_namespace: str) -> dict[str, Any]:
    """The RoleBinding with which a namespace lets the operator write its Gateways' objects."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "tailnet-operator", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "tailnet-operator-tenant"},
            "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": operator_namespace}]}


@dataclass
class Conformance:
    cluster: ClusterUnderTest
    laptop: TailscaleNode
    operator_namespace: str
    on_tailnet: SiteHost | None = None
    """The full run's host on the tailnet (a tailscaled on a TUN device in its namespace), where the
    suite runs and dials directly; None: the suite dials through the laptop's proxy."""


@pytest.fixture(scope="module")
def conformance(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale,
                module_tailscale_nodes: TailscaleFactory, environment: Environment) -> Iterator[Conformance]:
    """The Gateway API's CRDs, the suite's images, a Tailnet whose tenants are the suite's
    namespaces (each binding the operator's tenant role), the tailnet GatewayClass Accepted, and a
    laptop the policy lets reach the Gateways."""
    if os.environ.get(FULL_ENV, "core") not in ("full", "core"):
        skip_by_design(f"{FULL_ENV}={os.environ.get(FULL_ENV)}: the Gateway API conformance suite was asked not to run "
                       "(core, the default, and full run it)")
    from hack.image import conformance_images
    from hack.localenv.gatewayapi import standard_crd_bodies

    ns, suffix = installed_operator, uuid.uuid4().hex[:6]
    full, on_tailnet = os.environ.get(FULL_ENV) == "full", None
    tailnet, secret, base = f"conformance-{suffix}", f"conformance-{suffix}-bootstrap", f"conformance-{suffix}-policy"
    crds = yaml.safe_dump_all(standard_crd_bodies())
    kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=crds)
    for image in conformance_images():
        cluster.load_image(image)
    apply(cluster, [
        *({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}} for name in NAMESPACES),
        *(_tenant_binding(name, ns) for name in NAMESPACES),
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
         "stringData": {"apiKey": cluster_headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": base, "namespace": ns},
         "data": {"policy.hujson": _base_policy()}},
        tailnet_object(tailnet, cluster_headscale, ns, secret=secret,
                       tenants=[{"namespaces": list(NAMESPACES), "tags": [TAG]}],
                       policy={"baseConfigMapRef": {"namespace": ns, "name": base, "key": "policy.hujson"},
                               "mode": "Apply"}),
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": CLASS},
         "spec": {"controllerName": "tailnet.dev/gateway-controller",
                  "parametersRef": {"group": "tailnet.dev", "kind": "Tailnet", "name": tailnet}}},
    ])
    try:
        wait_until(lambda: condition(get_json(cluster, TAILNETS, tailnet), "PolicyApplied") == "True", timeout=120,
                   what="the Tailnet's policy applied (it owns the laptop's tag)")
        wait_until(lambda: condition(get_json(cluster, "gatewayclasses.gateway.networking.k8s.io", CLASS),
                                     "Accepted") == "True", timeout=90, what="the tailnet GatewayClass Accepted")
        laptop = module_tailscale_nodes(f"conformance-laptop-{suffix}", cluster_headscale,
                                        authkey=cluster_headscale.create_preauth_key(tags=[LAPTOP_TAG]))
        if full:
            host = on_tailnet = environment.site_host(reachable=True)
            module_tailscale_nodes(f"conformance-host-{suffix}", cluster_headscale, host=host,
                                   authkey=cluster_headscale.create_preauth_key(tags=[LAPTOP_TAG]))
        yield Conformance(cluster, laptop, ns, on_tailnet)
    finally:
        if on_tailnet is not None:
            on_tailnet.destroy()
        for name in NAMESPACES:
            kubectl(cluster, "delete", "namespace", name, "--wait=true", "--timeout=120s", check=False)
        kubectl(cluster, "delete", "gatewayclass", CLASS, "--ignore-not-found", check=False)
        remove_tailnet(cluster, tailnet)
        kubectl(cluster, "-n", ns, "delete", "secret", secret, "--ignore-not-found", check=False)
        kubectl(cluster, "-n", ns, "delete", "configmap", base, "--ignore-not-found", check=False)
        kubectl(cluster, "delete", "-f", "-", "--ignore-not-found", "--wait=false", stdin=crds, check=False)


def run_suite(world: Conformance, report: Path, *, features: tuple[str, ...] | None, log: Path,
              profiles: tuple[str, ...] = PROFILES["core"], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the suite's ``profiles`` (``features``: the supported features, else those the class
    declares); returns its ConformanceReport."""
    report.parent.mkdir(parents=True, exist_ok=True)
    command = [str(binaries.binary("gateway-conformance")), f"--gateway-class={CLASS}",
               f"--conformance-profiles={','.join(profiles)}", f"--report-output={report}",
               "--organization=tailnet-operator", "--project=tailnet-operator",
               "--url=https://github.com/tailnet-operator/tailnet-operator", "--version=dev",
               "--contact=https://github.com/tailnet-operator/tailnet-operator/issues",
               "-test.v", "-test.timeout=55m", *extra]
    if world.on_tailnet is not None:
        command = ["ip", "netns", "exec", world.on_tailnet.name, *command, "--on-tailnet"]
    else:
        command.append(f"--tailnet-proxy=127.0.0.1:{world.laptop.http_proxy_port}")
    if features is not None:
        command.append(f"--supported-features={','.join(features)}")
    if only := os.environ.get(ONLY_ENV):
        command.append(f"-test.run=TestGatewayAPIConformance/({only})$")
    env = {**os.environ, "KUBECONFIG": str(world.cluster.kubeconfig)}
    with log.open("wb") as out:
        subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=3500)
    if not report.is_file():
        raise AssertionError(f"the suite wrote no report; its output ends with:\n{log.read_text()[-4000:]}")
    loaded: dict[str, Any] = yaml.safe_load(report.read_text())
    return loaded


def profile_result(report: dict[str, Any], name: str = "GATEWAY-HTTP") -> dict[str, Any]:
    [profile] = [p for p in report.get("profiles") or [] if p.get("name") == name]
    return dict(profile)


def test_the_conformance_suites_core_gateway_and_httproute_tests_pass(conformance: Conformance) -> None:
    full = os.environ.get(FULL_ENV) == "full"
    name = "full" if full else "core"
    log = ROOT / "_artifacts" / f"gateway-conformance-{name}.log"
    report = run_suite(conformance, FULL_REPORT if full else ROOT / "_artifacts" / "gateway-conformance-core.yaml",
                       features=None if full else CORE_FEATURES, log=log, profiles=PROFILES[name])
    (log.parent / f"gateway-conformance-{name}-operator.log").write_text(
        operator_logs(conformance.cluster, conformance.operator_namespace, tail=-1))
    for profile in PROFILES[name]:
        core = profile_result(report, profile)["core"]
        assert core["result"] == "success", (
            f"{profile} core: {core.get('statistics')}; failed: {core.get('failedTests')}; skipped: "
            f"{core.get('skippedTests')} (log: {log})")
