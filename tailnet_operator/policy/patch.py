"""The rendered policy as the base's own HuJSON text with the derived entries inserted.

The admin's base is kept byte for byte (comments, layout, key order, trailing commas); each
derived entry is inserted at the end of the block it belongs in, one line per entry under a
marker comment naming the objects it came from, and a block the base lacks is created at the
end of its parent. Like tailscale's ``hujson`` patch "add" operations, only insertions happen:
the base's text is a subsequence of the result, and the result parses to the base's document
plus the appended entries (the document :func:`~tailnet_operator.policy.render.render` builds).

:class:`Layout` is where the blocks a render may add to begin and end in the text (found once
per base text with one scan); :func:`patch` then costs the inserted text plus one copy of the
base's.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MARKER = "// tailnet-operator:"
"""How every comment the operator writes into the policy begins."""

_STRING = r'"(?:[^"\\\n]|\\.)*+"'
_COMMENT = r"//[^\n]*+|/\*[\s\S]*?\*/"
_FLAT = rf'[\[{{](?:[^\[\]{{}}"/]++|{_STRING}|{_COMMENT})*+[\]}}]'
# A container nested at most two deep, matched whole (possessive: a miss costs no backtracking).
_NESTED = re.compile(rf'[\[{{](?:[^\[\]{{}}"/]++|{_STRING}|{_COMMENT}|{_FLAT})*+[\]}}]')
_TOKEN = re.compile(rf'\s*+(?:({_STRING})|({_COMMENT})|([{{\[])|([}}\]])|(,)|(:)|([^\s{{}}\[\],:"/]++))')
_STR, _REMARK, _OPEN, _CLOSE, _COMMA, _COLON, _LITERAL = range(1, 8)

@dataclass
class Block:
    """One object or array of the base text: where it opens and closes, and its last value."""

    open: int
    close: int = -1
    last_end: int = -1
    """Index just after the last value (-1: the block is empty)."""
    comma: bool = False
    """A comma follows the last value (a trailing comma)."""
    first: int = -1
    """Index of the first member or item (-1: empty)."""
    members: dict[str, Block] = field(default_factory=dict)
    """The object and array members of an object, by key (recorded down to ``_DEPTH``)."""


class Layout:
    """The structure of one HuJSON text, as far as a patch needs it; raises ValueError for a text
    that is not one object (the caller parsed it first, so that does not happen)."""

    def __init__(self, text: str) -> None:
        self.text = text.removeprefix("\ufeff")
        self.root = self._scan(self.text)
        self.unit = self._indent_unit()
        first_line = self.text.find("\n")
        self.newline = "\r\n" if first_line > 0 and self.text[first_line - 1] == "\r" else "\n"
        """The base's line ending (that of its first line), used for every inserted line."""

    @staticmethod
    def _scan(text: str) -> Block:
        """One pass over the tokens of the root, its members and ``autoApprovers``' members; a
        container inside those is skipped whole where :data:`_NESTED` matches it."""
        root: Block | None = None
        stack: list[Block | None] = []  # None: a container whose inside is not recorded
        keys: list[str | None] = []  # per open container: the key whose value comes next
        is_object: list[bool] = []
        expect_key: list[bool] = []
        record: list[bool] = []  # whether the container's own containers become Blocks
        pos = 0
        while (match := _TOKEN.match(text, pos)) is not None:
            pos = match.end()
            kind = match.lastindex
            if kind == _REMARK:
                continue
            top = stack[-1] if stack else None
            start = match.start(kind or 0)
            if kind == _OPEN:
                if stack and not record[-1] and (whole := _NESTED.match(text, start)) is not None:
                    pos = match_end = whole.end()
                    if top is not None:
                        if top.first < 0:
                            top.first = start
                        top.last_end, top.comma = match_end, False
                    continue
                block = Block(start) if not stack or record[-1] else None
                key = keys[-1] if stack else None
                if top is not None:
                    if top.first < 0:
                        top.first = start
                    if block is not None and key is not None:
                        top.members[key] = block
                elif not stack:
                    if root is not None or text[start] != "{":
                        raise ValueError("the policy text is not one object")
                    root = block
                record.append(block is not None and (not stack or (key or "").casefold() == "autoapprovers"))
                stack.append(block)
                keys.append(None)
                is_object.append(text[start] == "{")
                expect_key.append(is_object[-1])
            elif kind == _CLOSE:
                if not stack:
                    raise ValueError("the policy text is not one object")
                for items in (stack, keys, is_object, expect_key, record):
                    items.pop()
                if top is not None:
                    top.close = start
                parent = stack[-1] if stack else None
                if parent is not None:
                    parent.last_end, parent.comma = pos, False
            elif kind == _COMMA:
                if top is not None:
                    top.comma = True
                if stack:
                    expect_key[-1] = is_object[-1]
                    keys[-1] = None
            elif kind == _COLON:
                continue
            elif stack and expect_key[-1]:  # a member name
                expect_key[-1] = False
                if top is not None:
                    keys[-1] = json.loads(match.group(kind or 0))
                    if top.first < 0:
                        top.first = start
            elif top is not None:  # a value: string, number or literal
                if top.first < 0:
                    top.first = start
                top.last_end, top.comma = pos, False
        if root is None or root.close < 0 or stack or text[pos:].strip():
            raise ValueError("the policy text is not one object")
        return root

    def _indent_unit(self) -> str:
        if self.root.first >= 0:
            indent = _indent_at(self.text, self.root.first)
            if indent and _starts_line(self.text, self.root.first):
                return indent
        return "  "


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


def _starts_line(text: str, index: int) -> bool:
    start = _line_start(text, index)
    return not text[start:index].strip()


def _indent_at(text: str, index: int) -> str:
    """The whitespace that begins the line ``index`` is on."""
    start = _line_start(text, index)
    end = start
    while end < index and text[end] in " \t":
        end += 1
    return text[start:end]


_encode_string = getattr(json.encoder, "c_encode_basestring", None) or json.encoder.py_encode_basestring
_encode_other = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


def one_line(value: Any) -> str:
    """A JSON value on one line, the way people write policy entries: ``json.dumps(value,
    ensure_ascii=False)``'s text, without its per-call cost (a render writes thousands)."""
    if isinstance(value, str):
        return str(_encode_string(value))
    if isinstance(value, list):
        return "[" + ", ".join(map(one_line, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_encode_string(k)}: {one_line(v)}" for k, v in value.items()) + "}"
    return _encode_other(value)


def strings(items: Sequence[str]) -> str:
    """``one_line`` of a list of strings, the shape of nearly every derived value."""
    return "[" + ", ".join(map(_encode_string, items)) + "]"


@functools.lru_cache(maxsize=4096)
def marker(sources: tuple[str, ...]) -> str:
    """The comment above a derived entry."""
    return f"{MARKER} derived from {', '.join(sources)}" if sources else f"{MARKER} derived"


@dataclass
class Entry:
    """An entry to insert: its lines relative to the block's item indentation (the first is the
    marker comment), ending without a comma."""

    lines: list[str]

    @classmethod
    def member(cls, key: str, value: Sequence[str], sources: tuple[str, ...]) -> Entry:
        """A member whose value is a list of strings (a tag's owners, a route's approvers)."""
        return cls([marker(sources), f"{_encode_string(key)}: {strings(value)}"])

    @classmethod
    def item(cls, text: str, sources: tuple[str, ...]) -> Entry:
        """An array item, ``text`` being its JSON on one line."""
        return cls([marker(sources), text])

    @classmethod
    def block(cls, key: str, opening: str, entries: Sequence[Entry], unit: str, note: str) -> Entry:
        """A member ``key`` holding a new object (``opening`` ``{``) or array of ``entries``."""
        closing = "}" if opening == "{" else "]"
        lines = [f"{MARKER} {note}", f"{one_line(key)}: {opening}"]
        for entry in entries:
            lines += [unit + line for line in entry.lines[:-1]] + [f"{unit}{entry.lines[-1]},"]
        return cls([*lines, closing])


class Patch:
    """Insertions into one base text, applied together by :meth:`text`."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._inserts: list[tuple[int, int, str]] = []  # (index, order, text)

    def _insert(self, index: int, text: str) -> None:
        self._inserts.append((index, len(self._inserts), text))

    def append(self, block: Block, entries: Sequence[Entry]) -> None:
        """Insert ``entries`` at the end of ``block``, each on its own lines, with a trailing comma."""
        if not entries:
            return
        text, unit = self.layout.text, self.layout.unit
        outer = _indent_at(text, block.open)
        own_line = block.first >= 0 and _starts_line(text, block.first)
        inner = _indent_at(text, block.first) if own_line else outer + unit
        if block.last_end >= 0 and not block.comma:
            self._insert(block.last_end, ",")
        newline = self.layout.newline
        separator = newline + inner
        body = "".join(inner + separator.join(entry.lines) + "," + newline for entry in entries)
        if _starts_line(text, block.close):
            self._insert(_line_start(text, block.close), body)
        else:
            self._insert(block.close, newline + body + outer)

    def text(self) -> str:
        base = self.layout.text
        parts: list[str] = []
        at = 0
        for index, _, insert in sorted(self._inserts):
            parts += [base[at:index], insert]
            at = index
        parts.append(base[at:])
        out = "".join(parts)
        return out if out.endswith("\n") else out + self.layout.newline
