"""Parsed policies, reused while their text is unchanged.

The Policy reconciler parses the base (its ConfigMap) and the live policy (Headscale's) on every
reconcile; at a few thousand rules a parse costs more than the rest of the pipeline. A
:class:`ParsedPolicies` keeps the last few parsed documents: by ``version`` when the caller has
one (the base: ConfigMap uid and resourceVersion), else by the text itself. The documents it
returns are shared: treat them as read-only (``render`` copies the base before adding to it).
"""

from __future__ import annotations

from collections import OrderedDict

from .hujson import JSONObject, TextMemo, parse_hujson

DEFAULT_SIZE = 8


class ParsedPolicies:
    """A small LRU of parsed HuJSON documents; a text that does not parse is never kept."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, str], tuple[str, JSONObject]] = OrderedDict()
        self._memos: OrderedDict[int, TextMemo] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def parse(self, text: str, *, source: str, version: str | None = None) -> JSONObject:
        """``parse_hujson(text, source=source)``, or the document parsed last time for this
        ``version`` (or, without one, for this very text)."""
        key = (source, version) if version is not None else (source, "")
        hit = self._items.get(key)
        if hit is not None and (version is not None or hit[0] == text):
            self._items.move_to_end(key)
            self.hits += 1
            return hit[1]
        self.misses += 1
        document = parse_hujson(text, source=source)
        self._items[key] = (text if version is None else "", document)
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)
        return document

    def remember(self, text: str, document: JSONObject, *, source: str) -> None:
        """Record that ``text`` parses to ``document`` (a render's own text and document), so
        reading that text back (the live policy after a write) costs no parse."""
        self._items[(source, "")] = (text, document)
        self._items.move_to_end((source, ""))
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def memo(self, document: JSONObject) -> TextMemo:
        """The :class:`TextMemo` of ``document`` (built on first use, kept for the last few)."""
        memo = self._memos.get(id(document))
        if memo is None or memo.document is not document:
            memo = TextMemo(document)
            self._memos[id(document)] = memo
        self._memos.move_to_end(id(document))
        while len(self._memos) > 2:
            self._memos.popitem(last=False)
        return memo
