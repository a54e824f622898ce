"""A Service of ``type: LoadBalancer`` with a tailnet class, translated into the TailnetIngress it
is served as: desired state in, models and manifest pieces out.

The class is ``tailnet.dev/<Tailnet name>`` (:func:`load_balancer_class`), one per Tailnet. Such a
Service becomes one tailnet node exactly as a TailnetIngress does, so the ingress builders
(:mod:`.ingress`) make its objects from :func:`as_ingress`: every TCP port of the Service is a
``mode: tcp`` expose on the same port, forwarding to the Service itself. The TailnetIngress shape
is named ``<service>-lb`` (:data:`NAME_SUFFIX`) so that its objects (``<service>-lb-ingress-agent``
and so on) never meet those of a TailnetIngress named after the same app.

Annotations, each with its default:

* :data:`HOSTNAME_ANNOTATION` (``tailnet.dev/hostname``): the node's name on the tailnet, a DNS
  label; default ``<namespace>-<name>`` cut to 63 characters (:func:`default_hostname`);
* :data:`TAG_ANNOTATION` (``tailnet.dev/tag``): the node's ACL tag; default :data:`DEFAULT_TAG`.
  Either is used only as far as the Tailnet's ``spec.tenants`` let the namespace
  (:mod:`tailnet_operator.tenancy`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tailnet_operator.api.common import DNSLabel, ObjectMeta, Port, Tag
from tailnet_operator.api.ingress import EXPOSES_MAX, TailnetIngress
from tailnet_operator.names import MANAGED_BY, TAILNET_LABEL

__all__ = [
    "CLASS_PREFIX",
    "DEFAULT_TAG",
    "HOSTNAME_ANNOTATION",
    "NAME_SUFFIX",
    "TAG_ANNOTATION",
    "AnnotatedObject",
    "LoadBalancerService",
    "annotated_view",
    "as_ingress",
    "default_hostname",
    "load_balancer_class",
    "load_balancer_status",
    "name_problem",
    "object_name",
    "object_name_of",
    "problem",
    "record_metadata",
    "record_name",
    "skipped_ports",
    "sweep_view",
    "tailnet_of",
    "tcp_ports",
]

CLASS_PREFIX = "tailnet.dev/"
"""``spec.loadBalancerClass`` is this and a Tailnet's name."""
HOSTNAME_ANNOTATION = "tailnet.dev/hostname"
TAG_ANNOTATION = "tailnet.dev/tag"
DEFAULT_TAG = "tag:k8s"
"""The tag of a Service without :data:`TAG_ANNOTATION`: the Tailscale operator's default, so a
policy written for it keeps working; the namespace's tenancy must still allow it."""
NAME_SUFFIX = "-lb"
"""Appended to the Service's name for the TailnetIngress shape, and so for every object it owns."""
SERVICE_NAMESPACE_LABEL = "tailnet.dev/service-namespace"
SERVICE_NAME_LABEL = "tailnet.dev/service-name"
_LONGEST_OWNED_SUFFIX = len("-ingress-agent")
"""The longest suffix the ingress builders give a name that must be a DNS label (the status Service)."""


def load_balancer_class(tailnet: str) -> str:
    """The ``loadBalancerClass`` that asks for a node on the Tailnet ``tailnet``."""
    return f"{CLASS_PREFIX}{tailnet}"


def tailnet_of(service: Mapping[str, Any]) -> str | None:
    """The Tailnet a Service (as stored) asks for: its type is LoadBalancer and its class
    ``tailnet.dev/<name>``; None for every other Service, which the operator leaves alone."""
    spec = service.get("spec") or {}
    cls = spec.get("loadBalancerClass")
    if spec.get("type") != "LoadBalancer" or not isinstance(cls, str) or not cls.startswith(CLASS_PREFIX):
        return None
    return cls[len(CLASS_PREFIX):] or None


def default_hostname(namespace: str, name: str) -> str:
    """``<namespace>-<name>``, cut to a DNS label's 63 characters (the Tailscale operator's default)."""
    return f"{namespace}-{name}"[:63].rstrip("-")


# -- the Service as parsed ------------------------------------------------------------------------


class _Annotations(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    hostname: DNSLabel | None = Field(default=None, alias=HOSTNAME_ANNOTATION)
    tag: Tag | None = Field(default=None, alias=TAG_ANNOTATION)


class _Meta(ObjectMeta):
    annotations: _Annotations = Field(default_factory=_Annotations)


class ServicePort(BaseModel):
    """One entry of ``spec.ports``: what the node serves of it."""

    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"
    port: Port

    def describe(self) -> str:
        return f"{self.protocol} port {self.name + ' ' if self.name else ''}{self.port}"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: str = "ClusterIP"
    load_balancer_class: str | None = Field(default=None, alias="loadBalancerClass")
    ports: list[ServicePort] = Field(default_factory=list)


class AnnotatedObject(BaseModel):
    """A built-in object served as a tailnet node (a Service of the class, an Ingress of the
    IngressClass): its name and its annotations (validated, so a bad one is an ``InvalidSpec``
    naming ``metadata.annotations.tailnet.dev/...``), each with its default."""

    model_config = ConfigDict(extra="ignore")

    metadata: _Meta

    @property
    def name(self) -> str:
        return str(self.metadata.name)

    @property
    def namespace(self) -> str:
        return str(self.metadata.namespace)

    @property
    def hostname(self) -> str:
        return self.metadata.annotations.hostname or default_hostname(self.namespace, self.name)

    @property
    def tag(self) -> str:
        return self.metadata.annotations.tag or DEFAULT_TAG


class LoadBalancerService(AnnotatedObject):
    """A Service as the LoadBalancer class reads it: its annotations and its ports."""

    spec: _Spec

    @property
    def tailnet(self) -> str:
        """The Tailnet the class names ("" when the Service has none: it is not served)."""
        return tailnet_of({"spec": {"type": self.spec.type, "loadBalancerClass": self.spec.load_balancer_class}}) or ""


def tcp_ports(service: LoadBalancerService) -> list[ServicePort]:
    return [p for p in service.spec.ports if p.protocol == "TCP"]


def skipped_ports(service: LoadBalancerService) -> list[ServicePort]:
    """The ports the node does not serve: it forwards TCP only."""
    return [p for p in service.spec.ports if p.protocol != "TCP"]


def object_name(service: LoadBalancerService) -> str:
    """The name of the TailnetIngress shape, the stem of every object the Service owns."""
    return object_name_of(service.name)


def object_name_of(service_name: str) -> str:
    """:func:`object_name` from the Service's name alone."""
    return f"{service_name}{NAME_SUFFIX}"




def problem(service: LoadBalancerService) -> tuple[str, str] | None:
    """(reason, message) of a Service the class cannot serve, None when it can."""
    ports = tcp_ports(service)
    if not ports:
        return "NoTCPPorts", ("the Service has no TCP port; the tailnet node forwards TCP only, so nothing was "
                              "created on the tailnet")
    if len(ports) > EXPOSES_MAX:
        return "TooManyPorts", (f"the Service has {len(ports)} TCP ports; a tailnet node serves at most "
                                f"{EXPOSES_MAX}: split it into Services of at most {EXPOSES_MAX} ports")
    return name_problem("Service", service.name, NAME_SUFFIX)


def shape_name(name: str, suffix: str) -> str:
    """The TailnetIngress shape's name for an object named ``name``: ``name + suffix``; for a name
    too long for its agent's objects' names to be DNS labels, its start and a digest of the whole,
    so that two long names stay apart."""
    longest = 63 - _LONGEST_OWNED_SUFFIX - len(suffix)
    if len(name) <= longest:
        return f"{name}{suffix}"
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:longest - len(digest) - 1].rstrip('-')}-{digest}{suffix}"


def name_problem(kind: str, name: str, suffix: str) -> tuple[str, str] | None:
    """NameTooLong when the names of the agent's objects made of ``name + suffix`` would not be
    DNS labels (the status Service's is the longest), None when they are."""
    longest = 63 - _LONGEST_OWNED_SUFFIX - len(suffix)
    if len(name) > longest:
        return "NameTooLong", (f"the {kind}'s name has {len(name)} characters; its agent's objects "
                               f"({name}{suffix}-ingress-agent) need it to have at most {longest}")
    return None


def _expose(service: LoadBalancerService, port: ServicePort) -> dict[str, Any]:
    return {"name": port.name or f"port-{port.port}", "mode": "tcp", "port": port.port,
            "backend": {"service": service.name, "port": port.port}}


def as_ingress(service: LoadBalancerService) -> TailnetIngress:
    """The TailnetIngress the Service is served as: its TCP ports as tcp exposes to the Service
    itself, its hostname and tag. Only for a Service :func:`problem` has nothing against."""
    return TailnetIngress.model_validate({
        "metadata": {"name": object_name(service), "namespace": service.namespace, "uid": service.metadata.uid},
        "spec": {"tailnetRef": {"name": service.tailnet}, "tag": service.tag, "hostname": service.hostname,
                 "exposes": [_expose(service, p) for p in tcp_ports(service)]}})


# -- the key record and the status ---------------------------------------------------------------


def record_name(namespace: str, name: str) -> str:
    """The Service's pre-auth key record in the operator's namespace (a namespace has no dot, so
    the name is unique, and apart from an ingress's ``ingress.<namespace>.<name>``)."""
    return f"loadbalancer.{namespace}.{name}"


def record_metadata(service: LoadBalancerService, operator_namespace: str) -> dict[str, Any]:
    """metadata of the record: no owner (it lives in another namespace; the operator deletes it)."""
    return {"name": record_name(service.namespace, service.name), "namespace": operator_namespace,
            "labels": {**MANAGED_BY, TAILNET_LABEL: service.tailnet, SERVICE_NAMESPACE_LABEL: service.namespace,
                       SERVICE_NAME_LABEL: service.name}}


def load_balancer_status(node: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.loadBalancer`` from the node (``status.node`` of the TailnetIngress shape): its
    MagicDNS name as ``hostname`` once the agent has reported it, then each tailnet address as
    ``ip`` with ``ipMode: Proxy`` (the address is the tailnet node's, which forwards: kube-proxy
    must not short-cut it to the endpoints). Empty before the node exists."""
    if not node:
        return {}
    name = str(node.get("name") or "").rstrip(".")
    entries: list[dict[str, Any]] = [{"hostname": name}] if "." in name else []
    entries += [{"ip": str(a), "ipMode": "Proxy"} for a in node.get("addresses") or []]
    return {"ingress": entries} if entries else {}



def sweep_view(service: Mapping[str, Any], tailnet: str) -> dict[str, Any] | None:
    """A Service of ``tailnet``'s class as the orphan sweep counts a CR (its metadata and
    ``spec.tag``), so that its key and node are never taken for orphans; None for any other."""
    return annotated_view(service) if tailnet_of(service) == tailnet else None


def annotated_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An :class:`AnnotatedObject` (as stored) as the orphan sweep counts a CR: its metadata and its
    tag as ``spec.tag``."""
    notes = (obj.get("metadata") or {}).get("annotations") or {}
    return {"metadata": obj.get("metadata") or {}, "spec": {"tag": notes.get(TAG_ANNOTATION) or DEFAULT_TAG}}
