"""Which ConfigMap a Tailnet's hosts file may be, and whether the Tailnet owns it.

The DNS reconciler writes ``spec.dns.hostsConfigMap`` (its ``hosts`` key) with server-side apply.
A ConfigMap the operator creates names the Tailnet as its controller owner, so the file goes with
the Tailnet. A ConfigMap someone else created (an empty one a cluster admin made for CoreDNS to
mount, say) is written but never owned: no owner reference, no ``managed-by`` label, only the
``hosts`` key and the label ``tailnet.dev/tailnet``, so deleting the Tailnet can never
garbage-collect it (it keeps the last names until another Tailnet names it, or a person empties
it). Refused outright, and never written: CoreDNS's own configuration by its well-known names
(whether it exists yet or not), a ConfigMap another live Tailnet holds, and one another
controller owns. The install's RBAC is the second fence: the operator may write only the hosts
ConfigMaps the chart names (``dns.hostsConfigMaps``, by ``resourceNames``), and a refusal by
kube-apiserver is reported the same way (:func:`forbidden_message`).
"""

from __future__ import annotations

from tailnet_operator.names import TAILNET_LABEL, managed_by_operator
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime import Reader
from tailnet_operator.types import JSON

from .kinds import TAILNET

__all__ = ["COREDNS_CONFIG_MAPS", "forbidden_message", "metadata", "refusal"]

COREDNS_CONFIG_MAPS = frozenset({"coredns", "coredns-custom", "kube-dns"})
"""The names CoreDNS's (and kube-dns's) own configuration goes by in the common distributions."""


def refusal(namespace: str, name: str, current: JSON | None, tailnet: JSON, reader: Reader) -> str:
    """Why the hosts file of ``tailnet`` may not be ``namespace/name`` ("" when it may), given the
    ConfigMap there now (None when there is none). A file whose Tailnet is gone (the garbage
    collector has not removed it yet) is taken over by the Tailnet that names it now."""
    where = f"{namespace}/{name}"
    if name in COREDNS_CONFIG_MAPS:
        return (f"spec.dns.hostsConfigMap names {where}, which is CoreDNS's own configuration; the operator "
                "never writes it. Name a ConfigMap of its own (e.g. tailnet-hosts) and mount that into CoreDNS")
    if current is None:
        return ""
    meta = current.get("metadata") or {}
    tailnet_meta = tailnet.get("metadata") or {}
    holders = [o for o in meta.get("ownerReferences") or [] if o.get("controller")
               and o.get("uid") != tailnet_meta.get("uid") and _alive(reader, o)]
    if holders:
        holder = holders[0]
        return (f"spec.dns.hostsConfigMap names {where}, which {holder.get('kind', 'another object')} "
                f"{holder.get('name', '')} controls; each Tailnet needs a hosts ConfigMap of its own")
    labelled = str((meta.get("labels") or {}).get(TAILNET_LABEL) or "")
    if labelled and labelled != tailnet_meta.get("name") and reader.get(TAILNET, labelled) is not None:
        return (f"spec.dns.hostsConfigMap names {where}, which is the hosts file of Tailnet {labelled}; each "
                "Tailnet needs a hosts ConfigMap of its own")
    return ""


def metadata(tailnet: JSON, namespace: str, name: str, current: JSON | None) -> JSON:
    """The metadata the hosts file is applied with: owned by the Tailnet when the operator creates
    it (or created it), only labelled with the Tailnet's name when someone else did."""
    tailnet_name = str(tailnet["metadata"]["name"])
    if current is None or managed_by_operator(current):
        return owned_metadata(tailnet, name=name, namespace=namespace, tailnet=tailnet_name)
    return {"name": name, "namespace": namespace, "labels": {TAILNET_LABEL: tailnet_name}}


def _alive(reader: Reader, owner: JSON) -> bool:
    """Whether the owner a reference names still exists (any owner but a Tailnet counts as alive)."""
    if owner.get("kind") != "Tailnet" or not str(owner.get("apiVersion", "")).startswith("tailnet.dev/"):
        return True
    found = reader.get(TAILNET, str(owner.get("name", "")))
    return found is not None and found.get("metadata", {}).get("uid") == owner.get("uid")


def forbidden_message(namespace: str, name: str, error: Exception) -> str:
    """The refusal when kube-apiserver does not let the operator write ``namespace/name``."""
    return (f"the operator may not write the hosts ConfigMap {namespace}/{name}: the install lets it write only "
            "the hosts ConfigMaps it names (chart value dns.hostsConfigMaps, docs/reference/rbac.md); add this "
            f"one there, or name one of those (kube-apiserver said: {error})")
