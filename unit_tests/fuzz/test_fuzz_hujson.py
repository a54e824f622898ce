"""Fuzzing the HuJSON policy parser and the renderer.

* any text either parses or raises :class:`PolicyParseError`, nothing else;
* a syntax error carries its line and column, inside the text; an error without a position is
  one about the document's structure (the text itself parses);
* render∘parse is the identity on documents, and parse∘render∘parse on HuJSON texts with
  comments, trailing commas and odd whitespace.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

from hypothesis import example, given
from hypothesis import strategies as st

from hack.fuzz import fuzz_settings
from tailnet_operator.policy import hujson
from tailnet_operator.policy.hujson import PolicyParseError, canonical_text, parse_hujson

# Texts built from HuJSON's own pieces, so most of them get past the first character.
_PIECES = st.sampled_from(
    ["{", "}", "[", "]", ":", ",", '"a"', '"tag:x"', '"acls"', '"hosts"', "1", "-2.5e3", "true", "null",
     "// c\n", "/* c */", "/*", "\n", " ", '"\\', "'", "#", "x", "\ufeff", '"\u00e9"', "0x1", "01", "\t"]
)
_texts = st.one_of(
    st.text(max_size=80),
    st.lists(_PIECES, max_size=30).map("".join),
    st.lists(_PIECES, max_size=30).map(lambda parts: "{" + "".join(parts)),
)

_keys = st.text(max_size=6).map(lambda k: "x-" + k)  # never a block Headscale knows
_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12)
    | st.sampled_from(["//", "/* */", "a//b", '"', "\\", "\n"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=10,
)
_documents = st.dictionaries(_keys, _values, max_size=5)


def _parses_without_structure_checks(text: str) -> bool:
    with mock.patch.object(hujson, "validate_structure", lambda *_a, **_k: None):
        try:
            parse_hujson(text)
        except PolicyParseError:
            return False
    return True


@fuzz_settings
@given(_texts)
@example("")
@example("{" * 2000)
@example('{"a": 1, "a": 2}')
@example('{"groups": {"group:a": "alice@"}}')
def test_any_text_parses_or_fails_with_a_position(text: str) -> None:
    try:
        parse_hujson(text)
    except PolicyParseError as exc:
        if exc.line is None:
            assert exc.column is None
            assert _parses_without_structure_checks(text), f"syntax error without a position: {exc}"
        else:
            assert exc.column is not None
            lines = text.removeprefix("\ufeff").split("\n")
            assert 1 <= exc.line <= len(lines), exc
            assert 1 <= exc.column <= len(lines[exc.line - 1]) + 1, exc


@fuzz_settings
@given(_documents)
def test_render_then_parse_is_the_identity(document: dict[str, Any]) -> None:
    text = canonical_text(document)
    assert parse_hujson(text) == document
    assert canonical_text(parse_hujson(text)) == text


def _hujson(value: Any, draw: st.DrawFn) -> str:
    """``value`` written as HuJSON with comments, trailing commas and whitespace drawn at random."""
    gap = draw(st.sampled_from(["", " ", "\n", "\t", " // note\n", "/* c */", "\n  /* a\n b */ "]))
    if isinstance(value, dict):
        items = [f"{gap}{json.dumps(k)}{gap}:{gap}{_hujson(v, draw)}" for k, v in value.items()]
        comma = "," if bool(items) and draw(st.booleans()) else ""
        return "{" + ",".join(items) + comma + gap + "}"
    if isinstance(value, list):
        items = [gap + _hujson(v, draw) for v in value]
        comma = "," if bool(items) and draw(st.booleans()) else ""
        return "[" + ",".join(items) + comma + gap + "]"
    return json.dumps(value, ensure_ascii=draw(st.booleans()))


@st.composite
def _written(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    document = draw(_documents)
    return document, _hujson(document, draw)


@fuzz_settings
@given(_written())
def test_hujson_text_parses_to_its_document(case: tuple[dict[str, Any], str]) -> None:
    document, text = case
    parsed = parse_hujson(text)
    assert parsed == document
    assert parse_hujson(canonical_text(parsed)) == parsed
