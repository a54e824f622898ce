"""The pinned versions of every real component the tests and `make run` start.

This is the one place to bump them. Each binary is built from Go modules and cached under
``$XDG_CACHE_HOME/tailnet-operator/bin/<component>-<version>/``.
"""

from __future__ import annotations

KUBERNETES = "1.36.3"
ETCD = "3.6.16"
HEADSCALE = "0.29.2"
TAILSCALE = "1.98.10"

# The interop matrix (``make interop``, docs/compatibility.md): every Headscale minor the operator
# supports, newest patch of each, and every even tailscale minor (the releases), newest patch of
# each. The last entry of each is the pin above; ``TAILNET_HEADSCALE_VERSION`` and
# ``TAILNET_TAILSCALE_VERSION`` make the tests and ``make run`` use another listed version.
HEADSCALE_RANGE = ("0.26.1", "0.27.1", "0.28.0", HEADSCALE)
TAILSCALE_RANGE = ("1.80.3", "1.82.5", "1.84.3", "1.86.5", "1.88.4", "1.90.9", "1.92.5", "1.94.2", "1.96.5",
                   TAILSCALE)
# Headscale 0.30 is in development: its REST API (problem+json errors, correct 4xx statuses) is
# read from its sources and understood by the client, but no release is published to build.
HEADSCALE_UNRELEASED = ("0.30.0",)

# The local node: containerd runs pods through runc, CNI plugins wire them to a bridge, CoreDNS
# serves cluster DNS (and the Tailnet's hosts file) as a Deployment.
CONTAINERD = "2.4.2"
RUNC = "1.3.3"
CNI_PLUGINS = "1.10.0"
COREDNS = "1.12.4"

# Test tools: kind runs `make e2e` where Docker exists; cyclonus computes which connections a
# set of NetworkPolicies allows, with its own implementation of the semantics.
KIND = "0.33.0"
CYCLONUS = "0.5.6"
# cert-manager's certificates and issuer controllers (a test-only main, hack/certmanager/main.go)
# issue certificates for TailnetIngress hosts in the tests.
CERT_MANAGER = "1.19.1"
# The Gateway API's CRDs (standard channel, config/crd/standard of its module): a Gateway of the
# tailnet GatewayClass in the tests.
GATEWAY_API = "1.6.3"
# MetalLB's controller (its IP allocator only: no speaker, the gateway advertises the range) gives
# Services of type LoadBalancer an address of a TailnetGateway's advertiseLoadBalancerRange in the tests.
METALLB = "0.15.2"
# Helm renders manifests/install from the chart (python -m hack.render_install) and installs it in tests.
HELM = "3.22.0"
# Prometheus 3 (its Go module is tagged v0.<minor>.<patch>): rules are checked and unit-tested with
# promtool, and a real server scrapes the operator and an agent in the monitoring tests.
PROMETHEUS = "0.316.0"

# The Debian release the image's base rootfs is made from (debootstrap).
DEBIAN_SUITE = "bookworm"
