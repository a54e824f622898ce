"""How long the hypothesis fuzz properties run (``unit_tests/fuzz``, ``unit_tests/agent/fuzz``):
``TAILNET_FUZZ_EXAMPLES`` examples each (default 100).

``make test`` runs the default; ``make fuzz`` raises it. No deadline: a slow example on a shared
machine is not a failure, an exception is.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("TAILNET_FUZZ_EXAMPLES", "100"))

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)
