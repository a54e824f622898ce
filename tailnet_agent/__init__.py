"""tailnet-agent: one userspace tailnet node per TailnetEgress or TailnetIngress."""

__version__ = "0.1.0"
