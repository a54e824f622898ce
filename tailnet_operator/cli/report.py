"""What the CLI prints: a chain of steps, the findings that explain a failure, and a next step."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

__all__ = ["Finding", "Report", "Step", "age"]

_MARK = {True: "ok", False: "FAIL", None: "??"}


@dataclass(frozen=True)
class Finding:
    """One cause: ``cause`` is a CamelCase word (``TagNotOwned``), ``next_step`` what to do about it."""

    cause: str
    message: str
    next_step: str


@dataclass(frozen=True)
class Step:
    """One link of the chain (an object, the Headscale node, the policy): healthy, broken or unknown."""

    title: str
    ok: bool | None
    lines: tuple[str, ...] = ()


@dataclass
class Report:
    """The chain walked for one question, in order, and the causes found on the way."""

    title: str
    steps: list[Step] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    healthy_hint: str = ""
    """The "check next" line when nothing is wrong."""

    @property
    def ok(self) -> bool:
        return not self.findings

    def step(self, title: str, ok: bool | None, *lines: str) -> None:
        self.steps.append(Step(title, ok, tuple(line for line in lines if line)))

    def find(self, cause: str, message: str, next_step: str) -> None:
        if not any(f.cause == cause and f.message == message for f in self.findings):
            self.findings.append(Finding(cause, message, next_step))

    def causes(self) -> list[str]:
        return [f.cause for f in self.findings]

    def check_next(self) -> str:
        return self.findings[0].next_step if self.findings else self.healthy_hint

    def render(self) -> str:
        out = [self.title, ""]
        for step in self.steps:
            out.append(f"[{_MARK[step.ok]:>4}] {step.title}")
            out.extend(f"       {line}" for line in step.lines)
        out.append("")
        if self.findings:
            out.append("Problems:")
            out.extend(f"  - {f.cause}: {f.message}" for f in self.findings)
        else:
            out.append("No problem found.")
        out.append("")
        out.append(f"Check next: {self.check_next()}")
        return "\n".join(out) + "\n"


def age(then: datetime | None, now: datetime) -> str:
    """``3m12s ago`` / ``in 2d4h``; ``never`` for None."""
    if then is None:
        return "never"
    seconds = int((now - then).total_seconds())
    later, seconds = seconds < 0, abs(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        text = f"{days}d{hours}h"
    elif hours:
        text = f"{hours}h{minutes}m"
    elif minutes:
        text = f"{minutes}m{secs}s"
    else:
        text = f"{secs}s"
    return f"in {text}" if later else f"{text} ago"
