"""The Headscale policy as pure data: parse the base, derive what the CRs need, render, compare.

No I/O happens here; the Policy reconciler reads the base ConfigMap and the live policy, calls
these functions and writes the results. Decisions worth knowing (details in each module):

* Input is HuJSON only: ``//`` and ``/* */`` comments and trailing commas. hjson's extras
  (quoteless strings, unquoted keys, ``#`` comments, single quotes) are rejected with a position.
* Derived tags are owned by nobody (``[]``) unless ``owners`` says otherwise; the operator's
  tag-only pre-auth keys do not need an owner, and the entry makes the tag usable in grants.
* The base always wins; nothing is removed or reordered; derived entries are appended, sorted,
  by inserting them into the base's own text (comments and layout kept), each under a
  ``// tailnet-operator: derived from <Kind> <namespace>/<name>`` comment.
* Ingresses get a tag entry but no grant: who may reach them is the policy author's choice.
* No grants are added to a policy without acls and grants (allow-all stays allow-all).
* Routes advertised before their approver existed are approved from the rendered policy only: a
  derived approval the render left out (the base wins) is never replayed, and every entry left
  out is reported (``Rendered.skipped``, with the CRs it came from).
"""

from tailnet_operator.policy.derive import (
    DEFAULT_TAG_OWNERS,
    Derived,
    EgressInput,
    EgressTarget,
    GatewayInput,
    Grant,
    IngressInput,
    RouteApproval,
    SiteInput,
    TagOwner,
    derive,
)
from tailnet_operator.policy.hujson import (
    PolicyParseError,
    canonical_text,
    has_tests,
    parse_hujson,
    validate_structure,
)
from tailnet_operator.policy.render import (
    Added,
    Missing,
    Rendered,
    Replay,
    Skipped,
    diff_needed,
    missing,
    render,
    routes_to_approve,
)
from tailnet_operator.policy.sites import SiteRoutes, Verdict, judge

__all__ = [
    "DEFAULT_TAG_OWNERS",
    "Added",
    "Derived",
    "EgressInput",
    "EgressTarget",
    "GatewayInput",
    "Grant",
    "IngressInput",
    "Missing",
    "PolicyParseError",
    "Rendered",
    "Replay",
    "RouteApproval",
    "SiteInput",
    "SiteRoutes",
    "Skipped",
    "TagOwner",
    "Verdict",
    "canonical_text",
    "derive",
    "diff_needed",
    "has_tests",
    "judge",
    "missing",
    "parse_hujson",
    "render",
    "routes_to_approve",
    "validate_structure",
]
