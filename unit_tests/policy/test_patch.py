"""Rendering by patching the base's HuJSON text: the base's bytes kept, the derived entries inserted."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hack.crds import load_samples
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.policy import (
    EgressInput,
    EgressTarget,
    GatewayInput,
    SiteInput,
    canonical_text,
    derive,
    diff_needed,
    parse_hujson,
    render,
)
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.hujson import TextMemo
from tailnet_operator.policy.patch import MARKER, Layout

from .test_properties import _assert_preserved, _owners, bases, cr_sets

BASE = """// The policy of example.internal.
{
  // Who is who.
  "groups": {"group:ops": ["alice@"]},
  "tagOwners": {
    "tag:db": ["group:ops"], // the databases
  },
  "autoApprovers": {
    "exitNode": ["tag:db"] /* nobody else */
  },
  "grants": [
    {"src": ["group:ops"], "dst": ["tag:db"], "ip": ["*"]}  // ops reach the databases
  ]
}
"""

PATCHED = """// The policy of example.internal.
{
  // Who is who.
  "groups": {"group:ops": ["alice@"]},
  "tagOwners": {
    "tag:db": ["group:ops"], // the databases
    // tailnet-operator: derived from TailnetEgress ns/billing
    "tag:billing": [],
    // tailnet-operator: derived from TailnetGateway ns/gw
    "tag:gw": [],
  },
  "autoApprovers": {
    "exitNode": ["tag:db"], /* nobody else */
    // tailnet-operator: added: the base has no autoApprovers.routes
    "routes": {
      // tailnet-operator: derived from TailnetEgress ns/billing
      "10.0.0.1/32": ["tag:gw"],
    },
  },
  "grants": [
    {"src": ["group:ops"], "dst": ["tag:db"], "ip": ["*"]},  // ops reach the databases
    // tailnet-operator: derived from TailnetEgress ns/billing
    {"src": ["tag:billing"], "dst": ["10.0.0.1"], "ip": ["tcp:443"]},
  ]
}
"""

DERIVED = derive(
    egresses=[EgressInput("tag:billing", (EgressTarget("10.0.0.1", (443,)),), source="TailnetEgress ns/billing")],
    gateways=[GatewayInput("tag:gw", source="TailnetGateway ns/gw")],
)


def test_entries_go_into_their_blocks_under_a_marker_and_the_base_text_is_kept() -> None:
    base = parse_hujson(BASE)
    rendered = render(base, DERIVED, text=BASE)
    assert rendered.text == PATCHED
    assert parse_hujson(rendered.text) == render(base, DERIVED).document == rendered.document
    assert not diff_needed(render(base, DERIVED).text, rendered)  # the comparison stays semantic


def test_missing_blocks_are_created_at_the_end_of_the_root_in_the_render_order() -> None:
    text = '{\n\t"hosts": {"db": "10.0.0.1"}, // hosts\n\t"acls": []\n}'
    rendered = render(parse_hujson(text), DERIVED, text=text, grants=False)
    assert rendered.text == (
        '{\n\t"hosts": {"db": "10.0.0.1"}, // hosts\n\t"acls": [\n'
        "\t\t// tailnet-operator: derived from TailnetEgress ns/billing\n"
        '\t\t{"action": "accept", "src": ["tag:billing"], "proto": "tcp", "dst": ["10.0.0.1:443"]},\n'
        "\t],\n"
        "\t// tailnet-operator: added: the base has no tagOwners\n"
        '\t"tagOwners": {\n'
        "\t\t// tailnet-operator: derived from TailnetEgress ns/billing\n"
        '\t\t"tag:billing": [],\n'
        "\t\t// tailnet-operator: derived from TailnetGateway ns/gw\n"
        '\t\t"tag:gw": [],\n'
        "\t},\n"
        "\t// tailnet-operator: added: the base has no autoApprovers\n"
        '\t"autoApprovers": {\n'
        "\t\t// tailnet-operator: added: the base has no autoApprovers.routes\n"
        '\t\t"routes": {\n'
        "\t\t\t// tailnet-operator: derived from TailnetEgress ns/billing\n"
        '\t\t\t"10.0.0.1/32": ["tag:gw"],\n'
        "\t\t},\n"
        "\t},\n"
        "}\n"
    )
    assert rendered.grants_as_acls
    assert parse_hujson(rendered.text) == render(parse_hujson(text), DERIVED, grants=False).document


def test_one_line_bases_and_case_variant_block_names() -> None:
    text = '{"TagOwners": {"tag:x": []}, "Grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
    base = parse_hujson(text)
    rendered = render(base, DERIVED, text=text)
    assert parse_hujson(rendered.text) == render(base, DERIVED).document
    assert rendered.text.startswith('{"TagOwners": {"tag:x": [],\n  // tailnet-operator: derived from')


def test_a_base_that_gains_nothing_is_its_own_text() -> None:
    base = parse_hujson(BASE)
    assert render(base, derive(), text=BASE).text == BASE
    patched = parse_hujson(PATCHED)
    assert render(patched, DERIVED, text=PATCHED).text == PATCHED
    assert render({}, derive(), text="{}").text == "{}\n"  # texts end with a newline, as before


def test_the_sources_of_an_entry_are_sorted_and_a_site_is_named() -> None:
    derived = derive(
        sites=[SiteInput("b", "tag:r", ("10.1.0.0/24",), source="TailnetSite b"),
               SiteInput("a", "tag:r", ("10.1.0.0/24",), source="TailnetSite a")],
    )
    text = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
    out = render(parse_hujson(text), derived, text=text).text
    assert f'{MARKER} derived from TailnetSite a, TailnetSite b\n      "10.1.0.0/24": ["tag:r"],' in out


def test_a_text_other_than_the_bases_falls_back_to_canonical_json() -> None:
    base = parse_hujson(BASE)
    assert render(base, DERIVED, text="{}").text == render(base, DERIVED).text


def test_a_byte_order_mark_is_dropped() -> None:
    rendered = render(parse_hujson("\ufeff" + BASE), DERIVED, text="\ufeff" + BASE)
    assert rendered.text == PATCHED


def test_the_layout_is_kept_in_the_memo_while_the_text_is_the_same() -> None:
    base = parse_hujson(BASE)
    memo = TextMemo(base)
    first = render(base, DERIVED, memo=memo, text=BASE)
    layout = memo.cache["layout"]
    assert isinstance(layout, Layout)
    assert render(base, DERIVED, memo=memo, text=BASE).text == first.text == PATCHED
    assert memo.cache["layout"] is layout


# --- properties over generated bases written in generated HuJSON styles ---------------------------

_COMMENTS = ["", " // a note } ] , \"", " /* { [ \" // */", "/**/"]


@st.composite
def hujson_texts(draw: st.DrawFn, document: dict[str, Any]) -> str:
    """``document`` written as HuJSON the way people do: any indentation, one-line and multi-line
    blocks, comments between and after entries, with and without trailing commas."""
    unit = draw(st.sampled_from(["  ", "    ", "\t"]))

    def emit(value: Any, depth: int) -> str:
        if not isinstance(value, (dict, list)):
            return json.dumps(value, ensure_ascii=draw(st.booleans()))
        opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
        items = ([f"{json.dumps(k)}: {emit(v, depth + 1)}" for k, v in value.items()] if isinstance(value, dict)
                 else [emit(v, depth + 1) for v in value])
        trailing = draw(st.booleans())
        if not items:
            return opening + draw(st.sampled_from(["", " ", "/* none */", "\n" + unit * depth])) + closing
        if depth > 0 and not draw(st.booleans()):  # one line: only block comments fit
            gap = draw(st.sampled_from(["", " ", " /* c */ "]))
            return opening + gap + ", ".join(items) + ("," if trailing else "") + gap + closing
        pad = unit * (depth + 1)
        lines = []
        for index, item in enumerate(items):
            if draw(st.booleans()):
                lines.append(pad + draw(st.sampled_from(["// before } ]", "/* before */"])))
            comma = "," if index < len(items) - 1 or trailing else ""
            lines.append(pad + item + comma + draw(st.sampled_from(_COMMENTS)))
        return opening + "\n" + "\n".join(lines) + "\n" + unit * depth + closing

    head = draw(st.sampled_from(["", "// the policy\n", "/* policy */ "]))
    tail = draw(st.sampled_from(["", "\n", "\n// end\n"]))
    newline = draw(st.sampled_from(["\n", "\r\n"]))  # (strings hold no raw line breaks)
    return (head + emit(document, 0) + tail).replace("\n", newline)


def _subsequence(short: str, long: str) -> bool:
    chars = iter(long)
    return all(char in chars for char in short)


@settings(max_examples=300, deadline=None)
@given(st.data(), bases(), cr_sets(), _owners, st.booleans())
def test_the_patched_text_parses_to_the_render(
    data: st.DataObject, base: dict[str, Any], crs: dict[str, list[Any]], owners: list[str], grants: bool
) -> None:
    text = data.draw(hujson_texts(base))
    assert parse_hujson(text) == base
    derived = derive(**crs, owners=owners)
    expected = render(base, derived, grants=grants)
    patched = render(base, derived, grants=grants, text=text)

    # The same document, in the same order, as today's canonical render.
    document = parse_hujson(patched.text)
    assert canonical_text(document) == expected.text
    if grants:  # (without grants, acls grows too)
        _assert_preserved(base, document)
    assert (patched.added, patched.skipped, patched.unsupported) == (expected.added, expected.skipped,
                                                                     expected.unsupported)
    assert not diff_needed(expected.text, patched) and not diff_needed(patched.text, expected)

    # Only insertions: every byte of the base (comments included) is there, in order.
    assert _subsequence(text, patched.text)
    if "\r\n" in text.split("\n", 1)[0] + "\n" and "\n" in text:  # a CRLF text stays CRLF
        assert "\n" not in patched.text.replace("\r\n", "")
    added = len(patched.added.tag_owners) + len(patched.added.routes) + len(patched.added.grants)
    assert patched.text.count(f"{MARKER} derived") == added

    # Deterministic, with or without a memo; a render of the render adds nothing and keeps the text.
    memo = TextMemo(base)
    for _ in range(2):
        again = render(base, derived, grants=grants, text=text, memo=memo)
        assert (again.text, again.hash) == (patched.text, patched.hash)
    second = render(document, derived, grants=grants, text=patched.text)
    assert second.text == patched.text and second.added.empty


def test_the_adapters_name_each_object_by_kind_namespace_and_name() -> None:
    sample = next(s for s in load_samples() if s["kind"] == "TailnetEgress")
    sample["metadata"] = {"name": "billing", "namespace": "payments"}
    egress = TailnetEgress.model_validate(sample)
    derived = derive_from_objects(egresses=[egress])
    text = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
    rendered = render(parse_hujson(text), derived, text=text)
    assert rendered.added.grants
    marker_line = f"{MARKER} derived from TailnetEgress payments/billing"
    assert rendered.text.count(marker_line + "\n") == (
        len(rendered.added.tag_owners) + len(rendered.added.routes) + len(rendered.added.grants))
