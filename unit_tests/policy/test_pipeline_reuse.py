"""The fast ways through the policy pipeline give exactly what the careful ways give: the
regular-expression + C parser path of parse_hujson, renders that reuse the base's text and rule
index, and parsed policies reused by version or by text."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks.policy import base_policy, egresses, sites
from tailnet_operator.policy import PolicyParseError, diff_needed, parse_hujson, render
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.cache import ParsedPolicies
from tailnet_operator.policy.hujson import TextMemo, _check_tokens, _fast_parse, canonical_text

TRICKY = [
    '{"a": "http://x/*not a comment*/", // a comment with "quotes"\n "b": [1, 2, /* c */ ], }',
    '{"e": "\\"//\\"", "f": {"g": [true, false, null, -1.5e3],\n// last\n},\n}',
    '\ufeff/* lead */ {"grants": [{"src": ["*"], "dst": ["tag:x"], "ip": ["*"]}, ] }',
    '{"n": [2.0, 1e3, 1.5, -0.0, 1E2, 1e22, 1e-2, 0.1e1, 12345678901234567890]}',
]
CAREFUL_ONLY = ['{"a": 1 /* a comment before a trailing comma */ , }']
REJECTED = ['{,}', '[1, 2]', '{"a": NaN}', '{"a": 1e400}', "{'a': 1}", '{"a": 1,,}', '{"a": 1, "a": 2}',
            '{"a": tag:x}', '{"a": 1 # no\n}']


@pytest.mark.parametrize("text", TRICKY)
def test_the_fast_parse_reads_what_the_careful_parse_reads(text: str) -> None:
    import hjson

    from tailnet_operator.policy.hujson import _object_pairs

    careful_text = text.removeprefix("\ufeff")
    _check_tokens(careful_text, "test")
    careful = hjson.loads(careful_text, object_pairs_hook=_object_pairs)
    fast = _fast_parse(careful_text)
    assert fast is not None, "the fast way reads every HuJSON object"
    assert json.dumps(fast) == json.dumps(careful)
    assert parse_hujson(text) == fast


@pytest.mark.parametrize("text", CAREFUL_ONLY)
def test_what_the_fast_parse_leaves_the_careful_parse_reads(text: str) -> None:
    assert _fast_parse(text) is None
    assert parse_hujson(text) == {"a": 1}


@pytest.mark.parametrize("text", REJECTED)
def test_what_the_fast_parse_cannot_read_goes_the_careful_way_and_is_refused(text: str) -> None:
    assert _fast_parse(text) is None
    with pytest.raises(PolicyParseError):
        parse_hujson(text)


@pytest.mark.parametrize("grants", [True, False], ids=["grants", "grants-as-acls"])
def test_a_render_that_reuses_the_base_equals_one_that_does_not_and_leaves_the_base_alone(grants: bool) -> None:
    cache = ParsedPolicies()
    base = cache.parse(base_policy(200), source="base", version="1")
    pristine = copy.deepcopy(base)
    derived = derive_from_objects(egresses=egresses(50), sites=sites(10))
    memo = cache.memo(base)
    fast = render(base, derived, memo=memo, grants=grants)
    render(base, derived, memo=memo, grants=not grants)  # the other server kind shares the memo
    again = render(base, derived, memo=memo, grants=grants)  # the rule index and text memo are reused
    slow = render(copy.deepcopy(base), derived, grants=grants)
    assert fast.text == slow.text == again.text
    assert fast.grants_as_acls == slow.grants_as_acls == (not grants)
    assert fast.unsupported == slow.unsupported
    assert fast.text == json.dumps(fast.document, indent=2, ensure_ascii=False) + "\n"
    assert len(fast.added.grants) == 50
    assert base == pristine, "a render copies what it adds to; the base is shared, never changed"
    assert canonical_text(fast.document, memo=TextMemo(base)) == fast.text


def test_parsed_policies_are_reused_by_version_and_by_text() -> None:
    cache = ParsedPolicies()
    first = cache.parse('{"hosts": {}}', source="base", version="uid/1")
    assert cache.parse('{"hosts": {}}', source="base", version="uid/1") is first
    assert cache.parse('{"hosts": {"a": "1.2.3.4"}}', source="base", version="uid/2") is not first
    live = cache.parse('{"acls": []}', source="live")
    assert cache.parse('{"acls": []}', source="live") is live
    assert cache.parse('{"acls": [] }', source="live") == live
    assert (cache.hits, cache.misses) == (2, 3 + 1)


def test_a_live_policy_remembered_from_the_last_write_needs_no_parse() -> None:
    cache = ParsedPolicies()
    base = cache.parse(base_policy(50), source="base", version="1")
    memo = cache.memo(base)
    before = render(base, derive_from_objects(egresses=egresses(5)), memo=memo)
    after = render(base, derive_from_objects(egresses=egresses(6)), memo=memo)
    cache.remember(before.text, before.document, source="live policy")
    misses = cache.misses
    assert diff_needed(before.text, after, parsed=cache)
    assert not diff_needed(after.text, after, parsed=cache)
    assert cache.misses == misses, "the remembered render was not parsed again"
