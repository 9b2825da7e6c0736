"""Pydantic validation errors turned into one line in the user's YAML terms.

`nodes[2].regoin: unknown key (did you mean 'region'?)`, `train.steps: must be >= 1 (got 0)`.
Validators raise `FieldError` to point at the exact field of a cross-field check.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Mapping

from pydantic import BaseModel


class FieldError(ValueError):
    """Raised inside validators: ``path`` (relative to where the validator runs) is
    appended to pydantic's location, so cross-field errors name the exact field."""

    def __init__(self, path: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.path = path


def yaml_path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{_key(part)}" if out else _key(part))
    return out


def _key(part: Any) -> str:
    """A key as written, unless it would break the one-line message (a newline) or swamp it (a huge key)."""
    text = str(part)
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= 60 else text[:57] + "..."


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}" if isinstance(value, list) else f"[{', '.join(map(show, value))}]"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_KIND = {"int": "an integer", "float": "a number", "string": "a string", "bool": "true or false",
         "dict": "a mapping", "model": "a mapping", "list": "a list", "tuple": "a list"}


def describe(err: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error as `path: message` in the user's YAML terms (`root`: the top model)."""
    loc, kind, ctx, got = tuple(err["loc"]), err["type"], err.get("ctx") or {}, err.get("input")
    cause = ctx.get("error")
    if isinstance(cause, FieldError):
        loc = loc + cause.path
    where = yaml_path(loc)
    if kind == "extra_forbidden":
        msg = "unknown key" + _suggest(loc, root)
    elif kind == "missing":
        msg = "required"
    elif kind in ("value_error", "assertion_error") and cause is not None:
        msg = one_line(str(cause))
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op, bound = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
                     "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}[kind]
        limit = ctx[bound]
        limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
        msg = f"must be {op} {limit} (got {show(got)})"
    elif kind == "literal_error":
        msg = f"must be {ctx['expected']} (got {show(got)})"
    elif kind == "string_pattern_mismatch":
        msg = f"must match {ctx['pattern'].strip('^$')} (got {show(got)})"
    elif kind == "string_too_short":
        msg = "must not be empty"
    elif kind == "string_too_long":
        msg = f"must be at most {ctx['max_length']} characters (got {len(got) if isinstance(got, str) else show(got)})"
    elif kind in ("too_short", "too_long"):
        if kind == "too_short":
            msg = f"must have at least {ctx.get('min_length')} item(s) (got {ctx.get('actual_length')})"
        else:
            msg = f"must have at most {ctx.get('max_length')} item(s) (got {ctx.get('actual_length')})"
    elif kind == "finite_number":
        msg = f"must be a finite number (got {show(got)})"
    elif kind.split("_")[0] in _KIND and kind.endswith(("_type", "_parsing", "_from_float", "_attributes_type")):
        msg = f"must be {_KIND[kind.split('_')[0]]} (got {show(got)})"
    else:
        msg = one_line(err["msg"])
    return f"{where}: {msg}" if where else msg


def _suggest(loc: tuple[str | int, ...], root: type[BaseModel]) -> str:
    """' (did you mean ...)' for an unknown key, from the model that owns it."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return ""
        model = _model_in(field.annotation)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return ""
    keys = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(keys)})"


def _model_in(annotation: Any) -> Any:
    """The BaseModel inside list[...], X | None, Annotated[...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
