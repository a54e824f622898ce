"""A complete tagged-node controller on the pipeline: docs/runtime.md's worked example.

Each target of a TailnetEgress-shaped CR gets a ConfigMap that names the target; a target
removed from the spec loses its ConfigMap (the applier prunes it). Tag check, pre-auth key,
finalizer, deletion and the not-ready reasons are the pipeline's."""

from __future__ import annotations

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.controllers.access import Deps
from tailnet_operator.controllers.applier import Desired
from tailnet_operator.controllers.conditions import Cond
from tailnet_operator.controllers.kinds import TAILNET_EGRESS
from tailnet_operator.controllers.pipeline import Outcome, Run, TaggedNodeReconciler
from tailnet_operator.controllers.preauth import AuthKey
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.derive import Derived
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime import CONFIG_MAP, Request, Writer
from tailnet_operator.runtime.errors import Forbidden
from tailnet_operator.tenancy import Refusal
from tailnet_operator.types import JSON


class NoteNode:
    """What the example kind adds to the pipeline: its names, its objects, its status."""

    resource = TAILNET_EGRESS
    model = TailnetEgress
    field_manager = "example-notes"
    condition_types: tuple[str, ...] = ("TagOwned", "PreAuthKeyValid")

    def accepts(self, request: Request) -> bool:
        return True

    def spec_problem(self, run: Run[TailnetEgress]) -> tuple[str, str] | None:
        return None

    def tailnet_name(self, cr: TailnetEgress) -> str:
        return cr.spec.tailnet_ref.name

    def tag(self, cr: TailnetEgress) -> str:
        return cr.spec.tag

    def derived(self, cr: TailnetEgress) -> Derived:
        return derive_from_objects(egresses=[cr])

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        return f"{obj['metadata']['name']}-note-key", obj["metadata"]["namespace"]

    def key_metadata(self, run: Run[TailnetEgress]) -> JSON:
        return owned_metadata(run.obj, name=self.key_location(run.obj)[0], namespace=run.namespace,
                              tailnet=self.tailnet_name(run.cr))

    def refusal(self, run: Run[TailnetEgress], live_policy: str | None) -> Refusal | None:
        return None

    def before_key(self, run: Run[TailnetEgress]) -> Desired:
        return Desired.of()

    def desired(self, run: Run[TailnetEgress], key: AuthKey) -> Desired:
        notes = [(CONFIG_MAP, {"metadata": owned_metadata(run.obj, name=f"{run.name}-{t.name}", namespace=run.namespace,
                                                          tailnet=self.tailnet_name(run.cr)),
                               "data": {"address": str(t.address)}})
                 for t in run.cr.spec.targets]
        return Desired.of(*notes, prune=[(CONFIG_MAP, run.namespace)])

    def not_granted(self, run: Run[TailnetEgress], exc: Forbidden) -> str:
        return f"the operator may not write in {run.namespace}: {exc}"

    async def report(self, run: Run[TailnetEgress], outcome: Outcome) -> tuple[list[Cond], JSON]:
        return [Cond("Ready", "True", "Noted", f"{len(outcome.applied.stored)} note(s)")], {}


def note_reconciler(deps: Deps, writer: Writer) -> TaggedNodeReconciler[TailnetEgress]:
    return TaggedNodeReconciler(deps, writer, NoteNode())
