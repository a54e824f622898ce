"""The contract between the operator and the agent: what one writes and the other reads.

The operator imports this package and nothing else of ``tailnet_agent``; the agent never imports
the operator. It holds only the standard library, so the operator importing it loads none of the
agent (unit_tests/test_import_boundaries.py checks all three rules).

* :mod:`.environment`: the variables the operator sets on the agent's container, and the modes;
* :mod:`.endpoints`: the health port and its paths (``/healthz``, ``/readyz``, ``/status``, ``/metrics``);
* :mod:`.targets` and :mod:`.exposes`: the mounted files, as typed models with their parser (the
  agent's side) and their writer (the operator's side);
* :mod:`.status`: the ``GET /status`` document and its route states;
* :mod:`.clock` and :mod:`.backoff`: the time seam and the one jittered backoff both sides use;
* :mod:`.errors`: :class:`~.errors.ConfigError`, what a parser raises for a bad value;
* :mod:`.addresses`: which addresses an ingress's replicas may share.
"""
