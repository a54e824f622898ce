"""tailnet-operator: connects a Kubernetes cluster to a Headscale tailnet."""

__version__ = "0.1.0"
