"""A built-in object served as the TailnetIngress it translates to (its "shape"): a Service of the
LoadBalancer class (:mod:`.loadbalancer`), an Ingress of the IngressClass (:mod:`.ingressclass`).

:class:`ShapedNode` is the part of the pipeline's :class:`~.pipeline.TaggedNode` that is the same
for both: tenancy, the agent's objects and the node's report come from the ingress's parts
(:class:`.ingress.IngressNode`, composed) applied to the shape; a kind says how it is shaped
(:meth:`ShapedNode.shape_of`), where its key is recorded and how its status reads.
"""

from __future__ import annotations

from typing import Generic

from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.headscale import Node
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.derive import Derived
from tailnet_operator.runtime import Request, Writer
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.tenancy import Refusal
from tailnet_operator.types import JSON

from .access import Deps
from .applier import Desired
from .ingress import IngressNode, IngressSettings
from .ingress_status import Report, report
from .pipeline import CR, Outcome, Run
from .preauth import AuthKey

__all__ = ["ShapedNode"]


class ShapedNode(Generic[CR]):
    """The TaggedNode methods of a kind served as its TailnetIngress shape; a kind adds its
    resource, model, field manager, conditions, :meth:`shape_of`, its record's name and the status."""


    def __init__(self, deps: Deps, writer: Writer, settings: IngressSettings, ingress: IngressNode) -> None:
        self.reader, self.access, self.events = deps.reader, deps.access, deps.events
        self.writer = writer
        self.settings = settings
        self.ingress = ingress

    def shape_of(self, cr: CR) -> TailnetIngress:
        """The TailnetIngress the object is served as (only for one whose ``spec_problem`` is None)."""
        raise NotImplementedError

    def record_name(self, namespace: str, name: str) -> str:
        """The name of the object's key record in the operator's namespace."""
        raise NotImplementedError

    def shape(self, run: Run[CR]) -> Run[TailnetIngress]:
        """The reconcile as the ingress's parts see it: the object as stored, its TailnetIngress shape."""
        return Run(run.obj, self.shape_of(run.cr), run.tailnet)

    def accepts(self, request: Request) -> bool:
        return True

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """The object's record in the operator's namespace, which the object's namespace cannot write."""
        meta = obj["metadata"]
        return self.record_name(meta["namespace"], meta["name"]), self.settings.operator_namespace

    def derived(self, cr: CR) -> Derived:
        return derive_from_objects(ingresses=[self.shape_of(cr)])

    def refusal(self, run: Run[CR], live_policy: str | None) -> Refusal | None:
        """The ingress's tenancy: the namespace, the tag (a reserved one only by its exact name), the names."""
        return self.ingress.refusal(self.shape(run), live_policy)

    def not_granted(self, run: Run[CR], exc: Forbidden) -> str:
        return self.ingress.not_granted(self.shape(run), exc)

    def before_key(self, run: Run[CR]) -> Desired:
        return self.ingress.before_key(self.shape(run))

    def desired(self, run: Run[CR], key: AuthKey) -> Desired:
        """The ingress's agent objects for the shape, owned by the object."""
        return self.ingress.desired(self.shape(run), key)

    async def served(self, run: Run[CR], outcome: Outcome) -> tuple[Report, list[Node]]:
        """The shape's report (no DNS names, no Certificates) after the hostname's succession, and
        the nodes as they are afterwards."""
        shaped = self.shape(run)
        nodes = await self.ingress.free_hostname(shaped, outcome)
        agent = await self.ingress.agent_status.read(shaped.cr)
        return report(shaped.cr, [], agent=agent, nodes=nodes, key=outcome.key, reader=self.reader, issues={},
                      dns=False), nodes
