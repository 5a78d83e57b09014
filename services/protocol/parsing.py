"""Request bodies in, protocol models out; every failure is an InvalidRequest (HTTP 400).

`parse_model(cls, body)` is what every route and servicer calls.  Messages name
the field and the rule ("token_ids: must not be empty"); pydantic's wording and
its union-branch labels are translated here, once, so callers never see them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from services.protocol.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
MAX_REPORTED_ERRORS = 5
# Labels pydantic puts in an error location for a union branch, e.g. ("content", "list[Part]", 1).
_BRANCH_LABELS = {"str", "int", "float", "bool", "none", "list", "dict", "TokenId", "StrictInt"}

_RULES: dict[str, str] = {
    "missing": "field required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "finite_number": "must be a finite number",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be {expected}",
    "extra_forbidden": "unknown field",
}


def _rule(error: Mapping[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    if kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind in ("too_long", "string_too_long"):
        return f"must have at most {ctx.get('max_length')} {'characters' if 'string' in kind else 'items'}"
    template = _RULES.get(kind)
    return template.format(**ctx) if template else str(error["msg"])


def _is_branch_label(part: Any) -> bool:
    return isinstance(part, str) and (part in _BRANCH_LABELS or any(c in part for c in "[]()-,"))


def _where(loc: tuple[Any, ...]) -> tuple[str, int, str | None]:
    """Readable location, its depth, and where the first union along it sits (None outside unions)."""
    text, depth, union_at = "", 0, None
    for part in loc:
        if _is_branch_label(part):
            union_at = text if union_at is None else union_at
            continue
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
        depth += 1
    return text, depth, union_at


def _is_noise(rule: str) -> bool:
    return rule.startswith("must be a")  # "must be a string", "must be an integer", ...


def _drop_union_noise(found: dict[str, list[str]], unions: dict[str, str], depths: dict[str, int]) -> None:
    """Inside a union, keep the errors of the branch the input meant.

    A branch the input never meant reports type errors ("must be a string").  If any
    branch reports a real rule, drop the type errors; otherwise keep the deepest ones,
    from the branch that matched the input furthest.
    """
    for union_at in set(unions.values()):
        members = [w for w in found if unions.get(w) == union_at]
        if any(not _is_noise(r) for w in members for r in found[w]):
            for w in members:
                found[w] = [r for r in found[w] if not _is_noise(r)]
        else:
            deepest = max(depths[w] for w in members)
            for w in members:
                found[w] = found[w] if depths[w] == deepest else []


def format_validation_error(exc: ValidationError) -> str:
    """One readable line: 'where: rule; where: rule', union-branch noise removed."""
    found: dict[str, list[str]] = {}
    unions: dict[str, str] = {}
    depths: dict[str, int] = {}
    for error in exc.errors():
        where, depths_at, union_at = _where(tuple(error["loc"]))
        rules = found.setdefault(where, [])
        depths[where] = depths_at
        if (rule := _rule(error)) not in rules:
            rules.append(rule)
        if union_at is not None:
            unions[where] = union_at
    _drop_union_noise(found, unions, depths)
    lines = [f"{w}: {' or '.join(r)}" if w else " or ".join(r) for w, r in found.items() if r]
    shown = "; ".join(lines[:MAX_REPORTED_ERRORS])
    extra = len(lines) - MAX_REPORTED_ERRORS
    return shown + (f" (and {extra} more)" if extra > 0 else "")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def parse_json(body: bytes | bytearray | memoryview | str) -> Any:
    """Decode a JSON body; malformed JSON (NaN/Infinity literals, lone surrogates) -> InvalidRequest."""
    try:
        text = bytes(body) if isinstance(body, memoryview) else body
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    _refuse_lone_surrogates(text, obj)
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _refuse_lone_surrogates(text: bytes | bytearray | str, obj: Any) -> None:
    # JSON may spell a lone UTF-16 surrogate ("\ud800"): Python accepts it, but it is not text and
    # fails later (protobuf, hashing, logs) as an internal error.  Only bodies with such an escape pay.
    if (text.find("\\") if isinstance(text, str) else text.find(b"\\")) < 0:
        return  # one byte's search (memchr) spares the regex's scan of a body without any escape
    found = _SURROGATE_ESCAPE.search(text) if isinstance(text, str) else _SURROGATE_ESCAPE_BYTES.search(text)
    if found is None:
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("malformed JSON body: a string holds a lone UTF-16 surrogate "
                             "(a \\uD800-\\uDFFF escape without its pair)") from None


def validate_model(cls: type[M], data: Any) -> M:
    """Validate an already-decoded object as `cls`; failures -> InvalidRequest."""
    if not isinstance(data, Mapping):
        raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc)) from None


def parse_model(cls: type[M], data: bytes | bytearray | memoryview | str | Mapping[str, Any]) -> M:
    """A JSON body (bytes/str) or decoded mapping as `cls`; every failure -> InvalidRequest."""
    obj = data if isinstance(data, Mapping) else parse_json(data)
    return validate_model(cls, obj)
