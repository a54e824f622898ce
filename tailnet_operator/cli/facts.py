"""What every CLI command reads: the facts fetched beforehand, and how an object's metadata,
conditions, Events and times read in a report. Pure functions, no I/O, so each command's
answers are unit tests of fetched objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from tailnet_operator.headscale import Node
from tailnet_operator.types import JSON

from .report import Report, age

__all__ = [
    "Facts",
    "HeadscaleView",
    "by_priority",
    "condition_lines",
    "conditions",
    "event_key",
    "event_lines",
    "is_true",
    "meta",
    "parse_time",
    "title",
]

_PRIORITY = {"TailnetNotFound": 0, "HeadscaleUnreachable": 0, "NoWorkingKey": 0, "KeyExpired": 0,
             "NoSuchTarget": 0, "PodNotRunning": 1, "NamespaceNotAllowed": 1, "TagNotOwned": 2,
             "AgentDown": 3, "AgentNotJoined": 3, "NotAdvertised": 4, "NotApproved": 4, "NoGrant": 4}
"""Which cause comes first when several are found: the one the others follow from (an agent
cannot join with a tag nobody owns; nothing is routed through an agent that is down)."""



@dataclass(frozen=True)
class HeadscaleView:
    """What the CLI read from a Tailnet's Headscale with the operator's working key.

    ``nodes``/``policy`` are None when they could not be read; ``error`` then says why.
    """

    nodes: tuple[Node, ...] | None = None
    policy: str | None = None
    version: str = ""
    error: str = ""
    no_key: bool = False
    """Not contacted because the operator's namespace holds no working key for the Tailnet."""


@dataclass(frozen=True)
class Facts:
    """Everything one status question needs, fetched beforehand."""

    now: datetime
    obj: JSON
    tailnet: JSON | None = None
    pods: tuple[JSON, ...] = ()
    headscale: HeadscaleView | None = None
    events: Mapping[str, Sequence[JSON]] = field(default_factory=dict)
    """Events by ``event_key(kind, namespace, name)``."""


def event_key(kind: str, namespace: str, name: str) -> str:
    return f"{kind}/{namespace}/{name}"


def parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def meta(obj: JSON) -> tuple[str, str, str]:
    metadata = obj.get("metadata") or {}
    return str(obj.get("kind", "")), str(metadata.get("namespace") or ""), str(metadata.get("name") or "")


def title(obj: JSON) -> str:
    kind, namespace, name = meta(obj)
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def conditions(obj: JSON) -> dict[str, JSON]:
    return {str(c.get("type")): c for c in (obj.get("status") or {}).get("conditions") or [] if isinstance(c, dict)}


def condition_lines(obj: JSON) -> list[str]:
    return [f"{t}={c.get('status')} ({c.get('reason', '')}): {c.get('message', '')}".rstrip(": ")
            for t, c in conditions(obj).items()]


def is_true(obj: JSON | None, condition: str) -> bool | None:
    if obj is None:
        return None
    cond = conditions(obj).get(condition)
    if cond is None or cond.get("status") not in ("True", "False"):
        return None
    return cond.get("status") == "True"


def event_lines(facts: Facts, obj: JSON) -> list[str]:
    kind, namespace, name = meta(obj)
    events = sorted(facts.events.get(event_key(kind, namespace, name), ()),
                    key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    lines = []
    for event in events[-5:]:
        when = parse_time(event.get("lastTimestamp") or event.get("eventTime"))
        count = event.get("count") or (event.get("series") or {}).get("count") or 1
        times = f" x{count}" if count and int(count) > 1 else ""
        lines.append(f"event {event.get('type', 'Normal')} {event.get('reason', '')}{times} "
                     f"({age(when, facts.now)}): {event.get('message', '')}")
    return lines


def by_priority(report: Report) -> Report:
    """The report with its findings in cause order: the cause the others follow from first."""
    report.findings.sort(key=lambda f: _PRIORITY.get(f.cause, 5))
    return report
