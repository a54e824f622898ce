"""The pinned versions of every real component the tests and `make run` start.

This is the one place to bump them. Each binary is built from Go modules and cached under
``$XDG_CACHE_HOME/tailnet-operator/bin/<component>-<version>/``.
"""

from __future__ import annotations

KUBERNETES = "1.36.3"
ETCD = "3.6.16"
HEADSCALE = "0.29.2"
TAILSCALE = "1.98.10"
