"""Parsing HuJSON: what is accepted, what is refused, and how the refusal reads."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailnet_operator.policy import PolicyParseError, canonical_text, parse_hujson, validate_structure


def test_comments_and_trailing_commas() -> None:
    text = """// leading comment
    {
      /* block
         comment */
      "tagOwners": {"tag:a": ["alice@",],}, // trailing
      "grants": [
        {"src": ["tag:a"], "dst": ["10.0.0.1"], "ip": ["tcp:443",],},
      ],
    }
    // after
    """
    assert parse_hujson(text) == {
        "tagOwners": {"tag:a": ["alice@"]},
        "grants": [{"src": ["tag:a"], "dst": ["10.0.0.1"], "ip": ["tcp:443"]}],
    }


def test_comment_markers_inside_strings_are_data() -> None:
    text = '{"x-url": "http://example.com//path", "x-tag": "tag:a//b", "x-block": "/* no */", "x-hash": "# no"}'
    assert parse_hujson(text) == {
        "x-url": "http://example.com//path",
        "x-tag": "tag:a//b",
        "x-block": "/* no */",
        "x-hash": "# no",
    }


def test_escaped_quotes_do_not_end_strings() -> None:
    assert parse_hujson(r'{"x": "say \"hi\" // not a comment", "y": "\\"}') == {
        "x": 'say "hi" // not a comment',
        "y": "\\",
    }


def test_key_order_is_kept() -> None:
    doc = parse_hujson('{"ssh": [], "acls": [], "groups": {"group:b": [], "group:a": []}, "hosts": {}}')
    assert list(doc) == ["ssh", "acls", "groups", "hosts"]
    assert list(doc["groups"]) == ["group:b", "group:a"]


def test_empty_object_and_bom() -> None:
    assert parse_hujson("\ufeff{}") == {}


@pytest.mark.parametrize(
    ("text", "line", "column", "fragment"),
    [
        ('{\n  "grants": [{"dst": 10.0.0.1, "ip": ["*"]}]\n}', 2, 22, "'10.0.0.1'"),
        ('{"acls": [{"src": [tag:a]}]}', 1, 20, "'tag:a'"),
        ('{\n  tagOwners: {}\n}', 2, 3, "'tagOwners'"),
        ('{"a": 1, # note\n}', 1, 10, "'#' comments are not HuJSON"),
        ("{'a': 1}", 1, 2, "double quotes"),
        ('{"a": "x\n"}', 1, 7, "not closed on this line"),
        ('{"a": "x}', 1, 7, "never closed"),
        ('{"a": 1 /* open', 1, 9, "never closed with */"),
        ('["tag:a"]', 1, 1, "found an array"),
        ('"groups": {}', 1, 1, "starting with '{'"),
        ('{"a": NaN}', 1, 7, "'NaN'"),
        ('{"a": 01}', 1, 7, "'01'"),
    ],
)
def test_refuses_what_hujson_does_not_allow(text: str, line: int, column: int, fragment: str) -> None:
    with pytest.raises(PolicyParseError) as caught:
        parse_hujson(text, source="ConfigMap tailnet-system/base")
    message = str(caught.value)
    assert message.startswith(f"ConfigMap tailnet-system/base: line {line}, column {column}: ")
    assert fragment in message
    assert (caught.value.line, caught.value.column) == (line, column)


def test_quoteless_value_cannot_swallow_the_rest_of_the_line() -> None:
    # hjson alone reads this as {"hosts": {"db": "10.0.0.1, \"web\": \"10.0.0.2\""}}.
    with pytest.raises(PolicyParseError, match="double quotes"):
        parse_hujson('{"hosts": {"db": 10.0.0.1, "web": "10.0.0.2"}\n}')


def test_error_message_points_at_the_text() -> None:
    with pytest.raises(PolicyParseError) as caught:
        parse_hujson('{\n  "hosts": {"db": oops}\n}')
    assert str(caught.value).endswith('\n    "hosts": {"db": oops}\n                    ^')


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("  // only a comment\n", "empty"),
        ('{"a": 1} {"b": 2}', "line 1, column 10"),
        ('{"a": [1,,2]}', "line 1, column 10"),
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"a": {"b": 1}', "line 1"),
        ('{"a": 1e400}', "not valid HuJSON"),
    ],
)
def test_structural_errors(text: str, fragment: str) -> None:
    with pytest.raises(PolicyParseError, match=fragment):
        parse_hujson(text)


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"tagOwners": []}, "tagOwners must be an object, got an array"),
        ({"tagOwners": {"tag:a": "alice@"}}, "tagOwners[\"tag:a\"] must be an array of strings, got the string"),
        ({"tagOwners": {"tag:a": [1]}}, "tagOwners[\"tag:a\"][0] must be a string, got a number"),
        ({"groups": {"group:a": None}}, "groups[\"group:a\"] must be an array of strings, got null"),
        ({"hosts": {"db": ["10.0.0.1"]}}, "hosts[\"db\"] must be a string, got an array"),
        ({"grants": {}}, "grants must be an array of objects"),
        ({"grants": ["tag:a"]}, "grants[0] must be an object"),
        ({"grants": [{"src": "tag:a"}]}, "grants[0].src must be an array of strings"),
        ({"acls": [{"dst": [True]}]}, "acls[0].dst[0] must be a string, got a boolean"),
        ({"autoApprovers": []}, "autoApprovers must be an object"),
        ({"autoApprovers": {"routes": {"10.0.0.0/8": "tag:r"}}}, "autoApprovers.routes[\"10.0.0.0/8\"]"),
        ({"autoApprovers": {"exitNode": "tag:r"}}, "autoApprovers.exitNode must be an array"),
        ({"randomizeClientPort": "true"}, "randomizeClientPort must be true or false"),
        ({"ssh": {}}, "ssh must be an array of objects"),
        ({"tagOwners": {}, "TagOwners": {}}, "has both 'tagOwners' and 'TagOwners'"),
    ],
)
def test_known_blocks_must_have_their_json_types(document: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolicyParseError) as caught:
        validate_structure(document, source="base")
    assert fragment in str(caught.value)
    with pytest.raises(PolicyParseError):
        parse_hujson(json.dumps(document))


def test_unknown_blocks_and_fields_are_not_judged() -> None:
    doc = {"x-custom": "anything", "postures": 3, "grants": [{"src": ["*"], "app": {"x": 1}, "#note": "hi"}]}
    validate_structure(doc)
    assert parse_hujson(json.dumps(doc)) == doc


def test_names_match_case_insensitively_like_headscale() -> None:
    with pytest.raises(PolicyParseError, match="tagowners must be an object"):
        parse_hujson('{"tagowners": []}')


def test_canonical_text() -> None:
    assert canonical_text({"b": [1], "a": "é"}) == '{\n  "b": [\n    1\n  ],\n  "a": "é"\n}\n'


_text = st.lists(
    st.sampled_from([*'ab/*#:"\\\n\t é{}[],\'', "//", "/*", "*/", "http://x", "tag:a//b"]), max_size=6
).map("".join)
_json: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_text, _json, max_size=5), st.sampled_from([None, 0, 2]))
def test_any_json_object_parses_to_itself(document: dict[str, Any], indent: int | None) -> None:
    """Strings full of comment markers, quotes and escapes survive; comments and trailing commas vanish."""
    # Keys named like known blocks would be type-checked; keep the property about syntax.
    document = {f"x-{key}": value for key, value in document.items()}
    text = json.dumps(document, indent=indent, ensure_ascii=False)
    parsed = parse_hujson(text)
    assert parsed == document
    assert json.dumps(parsed) == json.dumps(document)  # same key order everywhere

    decorated = '// head // "quoted"\n/* block { } */\n' + json.dumps(document, indent=2, ensure_ascii=False).replace(
        "\n}", ", // trailing\n}"
    )
    if document:
        assert parse_hujson(decorated) == document
