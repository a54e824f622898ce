"""metav1.Condition bookkeeping: ``lastTransitionTime`` moves only when the status changes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import ValidationError

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Cond:
    """A condition to set: ``reason`` is one CamelCase word, ``message`` a sentence for people."""

    type: str
    status: Status
    reason: str
    message: str = ""


def invalid_spec_message(exc: ValidationError) -> str:
    """Every problem the model found in an object, each with the path of its field."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(existing: list[dict[str, Any]] | None, updates: list[Cond], *, generation: int,
          now: datetime) -> list[dict[str, Any]]:
    """The condition list after ``updates``: others kept, transition times kept when status is unchanged."""
    by_type = {c["type"]: dict(c) for c in existing or []}
    for cond in updates:
        old = by_type.get(cond.type)
        changed = old is None or old.get("status") != cond.status
        by_type[cond.type] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message[:32768],
            "observedGeneration": generation,
            "lastTransitionTime": rfc3339(now) if changed or old is None else old["lastTransitionTime"],
        }
    return [by_type[t] for t in sorted(by_type, key=_order)]


def only(conditions: list[dict[str, Any]], types: set[str]) -> list[dict[str, Any]]:
    """The conditions of ``types`` only: what one field manager applies (SSA merges by type)."""
    return [c for c in conditions if c["type"] in types]


def get(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def _order(type_: str) -> tuple[int, str]:
    return (0 if type_ == "Ready" else 1, type_)
