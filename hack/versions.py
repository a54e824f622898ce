"""The pinned versions of every real component the tests and `make run` start.

This is the one place to bump them. Each binary is built from Go modules and cached under
``$XDG_CACHE_HOME/tailnet-operator/bin/<component>-<version>/``.
"""

from __future__ import annotations

KUBERNETES = "1.36.3"
ETCD = "3.6.16"
HEADSCALE = "0.29.2"
TAILSCALE = "1.98.10"

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
# Helm renders manifests/install from the chart (python -m hack.render_install) and installs it in tests.
HELM = "3.22.0"
# Prometheus 3 (its Go module is tagged v0.<minor>.<patch>): rules are checked and unit-tested with
# promtool, and a real server scrapes the operator and an agent in the monitoring tests.
PROMETHEUS = "0.316.0"

# The Debian release the image's base rootfs is made from (debootstrap).
DEBIAN_SUITE = "bookworm"
