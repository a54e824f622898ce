"""Which ConfigMap a Tailnet's hosts file may be: never CoreDNS's own configuration, never one the
operator did not create, never another Tailnet's.

The DNS reconciler writes ``spec.dns.hostsConfigMap`` with server-side apply and names the Tailnet
as its controller owner, so the file goes with the Tailnet. Applied to a ConfigMap someone else
made (CoreDNS's Corefile, say), that apply would take the object over and the Tailnet's deletion
would garbage-collect it. So the ConfigMap must not exist yet (the operator creates it), or carry
the operator's ``app.kubernetes.io/managed-by`` label and no other controller than this Tailnet;
CoreDNS's well-known ConfigMaps are refused by name, whether they exist yet or not. The install's
RBAC is the second fence: the operator may write only the hosts ConfigMaps the chart names
(``dns.hostsConfigMaps``, by ``resourceNames``), and a refusal by kube-apiserver is reported the
same way (:func:`forbidden_message`).
"""

from __future__ import annotations

from tailnet_operator.runtime import Reader
from tailnet_operator.types import JSON

from .kinds import TAILNET

__all__ = ["COREDNS_CONFIG_MAPS", "forbidden_message", "refusal"]

COREDNS_CONFIG_MAPS = frozenset({"coredns", "coredns-custom", "kube-dns"})
"""The names CoreDNS's (and kube-dns's) own configuration goes by in the common distributions."""

_MANAGED_BY = ("app.kubernetes.io/managed-by", "tailnet-operator")


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
    if (meta.get("labels") or {}).get(_MANAGED_BY[0]) != _MANAGED_BY[1]:
        return (f"spec.dns.hostsConfigMap names {where}, which exists and was not created by the operator; it "
                "is not taken over (the Tailnet's deletion would garbage-collect it). Name a ConfigMap that does "
                "not exist yet, and the operator creates it")
    uid = (tailnet.get("metadata") or {}).get("uid")
    holders = [o for o in meta.get("ownerReferences") or [] if o.get("controller") and o.get("uid") != uid
               and _alive(reader, o)]
    if holders:
        holder = holders[0]
        return (f"spec.dns.hostsConfigMap names {where}, which is the hosts file of {holder.get('kind', 'an object')} "
                f"{holder.get('name', '')}; each Tailnet needs a hosts ConfigMap of its own")
    return ""


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
