"""Test doubles for the runtime's seams (controller-runtime's ``pkg/client/fake``, trio's ``testing``).

Kept out of the production facade (:mod:`tailnet_operator.runtime`): the operator never runs on
them, and a name exported there reads as something production code may use.

==================  =====================================================================
double              stands in for
==================  =====================================================================
:class:`FakeClient` the API server behind :class:`~..interfaces.Reader`,
                    :class:`~..interfaces.Writer` and, through ``lister_watcher``,
                    :class:`~..interfaces.ListerWatcher`
==================  =====================================================================

The fake is held to the real kube-apiserver by ``e2e/test_fake_contract.py``: the same
scenarios run on both and must end the same way. Its module docstring lists what it does not
model; when a test depends on that, test against the real API server (``e2e/``).
"""

from ._client import FakeClient

__all__ = ["FakeClient"]
