"""Reading and writing Headscale policy documents (HuJSON in; canonical JSON out where there is
no base text to patch, see :mod:`~tailnet_operator.policy.patch` for the render that keeps it).

HuJSON is JSON plus ``//`` and ``/* */`` comments and trailing commas. The hjson package parses
a superset of that: quoteless strings, unquoted keys, ``#`` comments, single quotes and a
brace-less root. Those extras would let a typo (``"dst": 10.0.0.1, "ip": ...``) silently become
a string that swallows the rest of the line, so a token pass rejects everything outside HuJSON
before hjson builds the tree, and a structure pass checks the blocks Headscale knows.

That careful path is pure Python (about a third of a second for a 300 KB policy), so a policy
is first tried the fast way: one regular-expression pass drops the comments and the trailing
commas (strings kept as they are) and the C JSON parser reads the rest. Whatever that pass
cannot read, or reads as something other than an object, goes the careful way, which decides
and explains; so both ways accept exactly the same documents.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import hjson

JSONObject = dict[str, Any]

# Top-level blocks of the Headscale v0.29 policy (hscontrol/policy/v2). Headscale matches member
# names case-insensitively, so lookups here do too.
KNOWN_BLOCKS = (
    "groups",
    "hosts",
    "tagOwners",
    "acls",
    "grants",
    "nodeAttrs",
    "autoApprovers",
    "ssh",
    "tests",
    "sshTests",
    "randomizeClientPort",
)

_LITERAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_DELIMITERS = frozenset(" \t\r\n{}[]:,/")
_STRUCTURAL = frozenset("{}[]:,")
_WHITESPACE = frozenset(" \t\r\n")
_WORD_END = frozenset(' \t\r\n{}[],"')


class PolicyParseError(ValueError):
    """The policy text or structure is not something the operator can safely render.

    ``line`` and ``column`` (1-based) point at the problem when it is in the text.
    """

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.column = column


def _position(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, column


def _error_at(text: str, index: int, message: str, source: str) -> PolicyParseError:
    line, column = _position(text, index)
    source_line = text.split("\n")[line - 1].rstrip("\r")
    pointer = f"\n  {source_line}\n  {' ' * (column - 1)}^" if source_line.strip() else ""
    return PolicyParseError(f"{source}: line {line}, column {column}: {message}{pointer}", line=line, column=column)


def _skip_string(text: str, start: int, source: str) -> int:
    """Index just after the double-quoted string that opens at ``start``."""
    i = start + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return i + 1
        if char == "\n":
            raise _error_at(text, start, "string is not closed on this line (escape line breaks as \\n)", source)
        i += 1
    raise _error_at(text, start, "string is never closed", source)


def _bare_word(text: str, index: int) -> str:
    end = index
    while end < len(text) and text[end] not in _WORD_END and end - index < 40:
        end += 1
    word = text[index : max(end, index + 1)]
    return word.rstrip(":") or word


def _check_tokens(text: str, source: str) -> None:
    """Reject everything hjson accepts that HuJSON does not, with the position of the first offence."""
    i = 0
    first_token = True
    while i < len(text):
        char = text[i]
        if char in _WHITESPACE:
            i += 1
            continue
        if text.startswith("//", i):
            newline = text.find("\n", i)
            i = len(text) if newline < 0 else newline
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise _error_at(text, i, "/* comment is never closed with */", source)
            i = end + 2
            continue
        if first_token and char != "{":
            what = "an array" if char == "[" else repr(_bare_word(text, i))
            raise _error_at(text, i, f"the policy must be a JSON object starting with '{{', found {what}", source)
        first_token = False
        if char == '"':
            i = _skip_string(text, i, source)
            continue
        if char in _STRUCTURAL:
            i += 1
            continue
        literal = _LITERAL.match(text, i)
        if literal and (literal.end() == len(text) or text[literal.end()] in _DELIMITERS):
            i = literal.end()
            continue
        if char == "#":
            message = "'#' comments are not HuJSON; use // or /* */"
        elif char == "'":
            message = "strings must be in double quotes, not single quotes"
        else:
            message = (
                f"unexpected {_bare_word(text, i)!r}: keys and string values must be in double quotes "
                '(e.g. "tag:web"), numbers plain, booleans true/false'
            )
        raise _error_at(text, i, message, source)
    if first_token:
        raise _error_at(text, len(text), "the policy is empty; an empty policy is written as {}", source)


def _key_positions(text: str) -> list[tuple[int, str, int]]:
    """(object id, key, index) of every member name, in text order; for text that passed the token check."""
    keys: list[tuple[int, str, int]] = []
    stack: list[int] = []
    opened = 0
    pending: tuple[str, int] | None = None
    i = 0
    while i < len(text):
        char = text[i]
        if text.startswith("//", i):
            newline = text.find("\n", i)
            i = len(text) if newline < 0 else newline
            continue
        if text.startswith("/*", i):
            i = text.find("*/", i + 2) + 2
            continue
        if char == '"':
            end = _skip_string(text, i, "policy")
            try:
                pending = (json.loads(text[i:end]), i)
            except ValueError:
                pending = None
            i = end
            continue
        if char == ":" and pending is not None and stack and stack[-1] >= 0:
            keys.append((stack[-1], pending[0], pending[1]))
        if char == "{":
            opened += 1
            stack.append(opened)
        elif char == "[":
            stack.append(-1)
        elif char in "}]" and stack:
            stack.pop()
        if char not in _WHITESPACE:
            pending = None
        i += 1
    return keys


def _duplicate_key_error(text: str, key: str, source: str) -> PolicyParseError:
    seen: set[tuple[int, str]] = set()
    for obj, name, index in _key_positions(text):
        if (obj, name) in seen and name == key:
            return _error_at(text, index, f"duplicate key {key!r} in one object; keep only one", source)
        seen.add((obj, name))
    return PolicyParseError(f"{source}: duplicate key {key!r} in one object; keep only one")


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object_pairs(pairs: list[tuple[str, Any]]) -> JSONObject:
    """Keep source order and refuse duplicate keys (Headscale rejects them; JSON leaves them undefined)."""
    result: JSONObject = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


_TO_JSON = re.compile(
    r'("[^"\\\n]*(?:\\.[^"\\\n]*)*")'  # a string: kept (group 1)
    r"|//[^\n]*|/\*[\s\S]*?\*/"  # a comment: dropped
    # a trailing comma after a value: dropped (possessive, so comments after it cost no backtracking)
    r"|(?<=[\]}\"0-9el]),(?=(?:\s++|//[^\n]*+|/\*[\s\S]*?\*/)*+[\]}])"
)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float | int:
    """A JSON number with a fraction or exponent, as the careful way reads it (hjson): a whole
    value below 1e10 becomes an int (``2.0`` -> ``2``), so both ways give one document."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    if int(value) == value and abs(value) < 1e10:
        return int(value)
    return value


def _fast_parse(text: str) -> JSONObject | None:
    """The document, if the fast way can read it as an object; None sends it the careful way."""
    try:
        document = json.loads(_TO_JSON.sub(r"\1", text), object_pairs_hook=_object_pairs,
                              parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def parse_hujson(text: str, *, source: str = "policy") -> JSONObject:
    """Parse a HuJSON policy into plain dicts and lists, keeping key order as written.

    ``source`` names the document in error messages (e.g. the ConfigMap it came from).
    """
    text = text.removeprefix("\ufeff")
    fast = _fast_parse(text)
    if fast is not None:
        validate_structure(fast, source=source)
        return fast
    _check_tokens(text, source)
    try:
        document = hjson.loads(text, object_pairs_hook=_object_pairs)
    except _DuplicateKey as exc:
        raise _duplicate_key_error(text, exc.key, source) from exc
    except hjson.HjsonDecodeError as exc:
        raise PolicyParseError(
            f"{source}: line {exc.lineno}, column {exc.colno}: {exc.msg}", line=exc.lineno, column=exc.colno
        ) from exc
    except (ValueError, OverflowError, RecursionError) as exc:
        raise PolicyParseError(f"{source}: not valid HuJSON: {exc}") from exc
    if not isinstance(document, dict):
        raise PolicyParseError(f"{source}: the policy must be a JSON object, got {_type_name(document)}")
    validate_structure(document, source=source)
    return document


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return f"the string {value!r}" if len(value) <= 60 else "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def find_key(obj: Mapping[str, Any], name: str) -> str | None:
    """The key of ``obj`` that Headscale would read as ``name`` (member names match case-insensitively)."""
    if name in obj:
        return name
    folded = name.casefold()
    return next((key for key in obj if key.casefold() == folded), None)


def has_tests(document: JSONObject) -> bool:
    """Whether the policy asserts anything of its own: a non-empty ``tests`` or ``sshTests`` block,
    which Headscale (0.29+) evaluates against the live nodes before it accepts the policy."""
    return any(document[key] for name in ("tests", "sshTests") if (key := find_key(document, name)) is not None)


def _string_list(value: Any, path: str, source: str) -> None:
    if not isinstance(value, list):
        raise PolicyParseError(f"{source}: {path} must be an array of strings, got {_type_name(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise PolicyParseError(f"{source}: {path}[{index}] must be a string, got {_type_name(item)}")


def _object_of(value: Any, path: str, source: str, check: str) -> None:
    if not isinstance(value, dict):
        raise PolicyParseError(f"{source}: {path} must be an object, got {_type_name(value)}")
    for key, item in value.items():
        item_path = f"{path}[{json.dumps(key)}]"
        if check == "strings":
            _string_list(item, item_path, source)
        elif not isinstance(item, str):
            raise PolicyParseError(f"{source}: {item_path} must be a string, got {_type_name(item)}")


def _rules(value: Any, path: str, source: str, string_lists: tuple[str, ...]) -> None:
    if not isinstance(value, list):
        raise PolicyParseError(f"{source}: {path} must be an array of objects, got {_type_name(value)}")
    for index, rule in enumerate(value):
        rule_path = f"{path}[{index}]"
        if not isinstance(rule, dict):
            raise PolicyParseError(f"{source}: {rule_path} must be an object, got {_type_name(rule)}")
        for field in string_lists:
            key = find_key(rule, field)
            if key is not None:
                _string_list(rule[key], f"{rule_path}.{key}", source)


def _unique_names(obj: Mapping[str, Any], names: tuple[str, ...], path: str, source: str) -> None:
    for name in names:
        matches = [key for key in obj if key.casefold() == name.casefold()]
        if len(matches) > 1:
            raise PolicyParseError(
                f"{source}: {path} has both {' and '.join(map(repr, matches))}; Headscale reads names "
                "case-insensitively, so keep one"
            )


def validate_structure(document: Mapping[str, Any], *, source: str = "policy") -> None:
    """Check that every block Headscale knows has the JSON type it expects.

    Unknown blocks and unknown fields are left alone: Headscale is the judge of those, and the
    operator passes them through untouched.
    """
    _unique_names(document, KNOWN_BLOCKS, "the policy", source)
    for name in KNOWN_BLOCKS:
        key = find_key(document, name)
        if key is None:
            continue
        value = document[key]
        if name in ("groups", "tagOwners"):
            _object_of(value, key, source, "strings")
        elif name == "hosts":
            _object_of(value, key, source, "string")
        elif name == "acls":
            _rules(value, key, source, ("src", "dst"))
        elif name == "grants":
            _rules(value, key, source, ("src", "dst", "ip", "via"))
        elif name in ("ssh", "tests", "sshTests", "nodeAttrs"):
            _rules(value, key, source, ())
        elif name == "randomizeClientPort":
            if not isinstance(value, bool):
                raise PolicyParseError(f"{source}: {key} must be true or false, got {_type_name(value)}")
        elif name == "autoApprovers":
            if not isinstance(value, dict):
                raise PolicyParseError(f"{source}: {key} must be an object, got {_type_name(value)}")
            _unique_names(value, ("routes", "exitNode"), key, source)
            routes = find_key(value, "routes")
            if routes is not None:
                _object_of(value[routes], f"{key}.{routes}", source, "strings")
            exit_node = find_key(value, "exitNode")
            if exit_node is not None:
                _string_list(value[exit_node], f"{key}.{exit_node}", source)


def canonical_text(document: Mapping[str, Any], *, memo: TextMemo | None = None) -> str:
    """The one text form of a document: 2-space JSON in key order, UTF-8, trailing newline.

    Deterministic so that the hash (and therefore "did the render change?") depends on data only.
    With ``memo`` (of a document this one shares objects with, such as the base a render starts
    from), the text of every shared object is taken from the memo: only what is new is encoded.
    """
    if memo is None:
        return json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    return memo.encode(document) + "\n"


_encode_string = getattr(json.encoder, "c_encode_basestring", None) or json.encoder.py_encode_basestring


def _scalar(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, allow_nan=False)`` for a string, number, bool or null."""
    if isinstance(value, str):
        return str(_encode_string(value))
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class TextMemo:
    """The canonical text of every container inside one read-only document, by identity; it
    keeps the document alive, so an identity is never reused while the memo is held.

    The first encode encodes the document once (a render that patches the base's own text never
    needs it); after that, encoding a document that shares most of its objects (a render of that
    base) costs only the new parts. The output is exactly ``json.dumps(..., indent=2,
    ensure_ascii=False)``'s.
    """

    def __init__(self, document: Mapping[str, Any]) -> None:
        self.document = document
        self.cache: dict[str, Any] = {}
        """Other values computed from the document that its users keep with it."""
        self._texts: dict[int, str] = {}

    def encode(self, document: Mapping[str, Any]) -> str:
        if not self._texts:
            self._text(self.document, store=True)
        return self._text(document, store=False)

    def _text(self, obj: Any, *, store: bool) -> str:
        """``obj``'s text at indentation 0 (nested, every line after the first is indented)."""
        if not isinstance(obj, (dict, list)):
            return _scalar(obj)
        text = self._texts.get(id(obj))
        if text is not None:
            return text
        if isinstance(obj, dict):
            parts = [f"{_scalar(k)}: {self._text(v, store=store)}" for k, v in obj.items()]
            text = "{\n  " + ",\n".join(parts).replace("\n", "\n  ") + "\n}" if parts else "{}"
        else:
            parts = [self._text(v, store=store) for v in obj]
            text = "[\n  " + ",\n".join(parts).replace("\n", "\n  ") + "\n]" if parts else "[]"
        if store:
            self._texts[id(obj)] = text
        return text
