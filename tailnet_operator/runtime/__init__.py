"""The controller runtime: what a controller author imports (controller-runtime's ``ctrl``).

A controller is a :class:`Reconciler` (one ``async reconcile(Request) -> Result``) that reads
through a :class:`Reader` and writes through a :class:`Writer`, registered on a
:class:`Manager` with ``for_`` / ``owns`` / ``watches``::

    from tailnet_operator import runtime as rt

    class WidgetReconciler:
        def __init__(self, reader: rt.Reader, writer: rt.Writer, clock: rt.Clock) -> None: ...
        async def reconcile(self, request: rt.Request) -> rt.Result: ...

    manager = rt.Manager(config, scheme=rt.Scheme({Widget: WIDGET}))
    reconciler = WidgetReconciler(manager.cache, manager.writer("widget-controller"), manager.clock)
    manager.controller("widget", reconciler).for_(WIDGET).owns(rt.CONFIG_MAP)

The seams, and what stands behind each in production and in tests (the test doubles live in
:mod:`tailnet_operator.runtime.testing`, which this facade does not export):

==========================  ==========================================  ======================================
seam                        production                                  unit tests
==========================  ==========================================  ======================================
:class:`Reader`             ``manager.cache`` (:class:`SharedCache`)     ``testing.FakeClient``
:class:`Writer`             ``manager.writer(name)`` (:class:`Applier`   ``testing.FakeClient``, or an
                            over the REST :class:`Client`)              :class:`Applier` over it
:class:`ListerWatcher`      :class:`Client`                             ``testing.FakeClient.lister_watcher``
:class:`Clock`              :class:`RealClock`                          :class:`FakeClock`
Headscale                   ``headscale.HeadscaleClient``               ``headscale.MockTransport``
==========================  ==========================================  ======================================

Helpers: :func:`owner_reference` / :func:`set_controller_reference` for owned objects,
:func:`needs_apply` (the comparison the :class:`Applier` makes), :func:`managed_paths` (what a
field manager owns), finalizers, predicates, and
the API errors (:class:`NotFound`, :class:`Conflict`, ...). Everything else in the submodules
is the engine behind these names.
"""

from tailnet_operator.types import JSON

from .cache import NotYetCached, SharedCache
from .client import Client, ObjectList, WatchEvent, config
from .client.apply import Applier
from .client.config import RestConfig
from .client.interfaces import ListerWatcher, Reader, Writer
from .client.ssa import managed_paths, needs_apply
from .clock import Clock, FakeClock, RealClock
from .controller import (
    APISERVER_WORKERS,
    DEFAULT_WORKERS,
    Controller,
    ControllerOptions,
    Mapper,
    Reconciler,
    Request,
    Result,
    TerminalError,
    owner_mapper,
    request_for,
)
from .controller.finalizers import add_finalizer, has_finalizer, remove_finalizer
from .controller.predicates import FieldChanged, GenerationChanged, LabelsChanged, Matching, Predicate, any_of
from .errors import (
    AlreadyExists,
    APIError,
    Conflict,
    Gone,
    Invalid,
    KubeError,
    NotFound,
    TransportError,
    certainly_not_written,
)
from .events import EventRecorder
from .kinds import CONFIG_MAP, NAMESPACE, SECRET, SERVICE, Resource
from .manager import Manager, ManagerOptions
from .objects import AlreadyOwned, owner_reference, set_controller_reference
from .scheme import Scheme

__all__ = [
    "APISERVER_WORKERS",
    "CONFIG_MAP",
    "DEFAULT_WORKERS",
    "JSON",
    "NAMESPACE",
    "SECRET",
    "SERVICE",
    "APIError",
    "AlreadyExists",
    "AlreadyOwned",
    "Applier",
    "Client",
    "Clock",
    "Conflict",
    "Controller",
    "ControllerOptions",
    "EventRecorder",
    "FakeClock",
    "FieldChanged",
    "GenerationChanged",
    "Gone",
    "Invalid",
    "KubeError",
    "LabelsChanged",
    "ListerWatcher",
    "Manager",
    "ManagerOptions",
    "Mapper",
    "Matching",
    "NotFound",
    "NotYetCached",
    "ObjectList",
    "Predicate",
    "Reader",
    "RealClock",
    "Reconciler",
    "Request",
    "Resource",
    "RestConfig",
    "Result",
    "Scheme",
    "SharedCache",
    "TerminalError",
    "TransportError",
    "WatchEvent",
    "Writer",
    "add_finalizer",
    "any_of",
    "certainly_not_written",
    "config",
    "has_finalizer",
    "managed_paths",
    "needs_apply",
    "owner_mapper",
    "owner_reference",
    "remove_finalizer",
    "request_for",
    "set_controller_reference",
]
