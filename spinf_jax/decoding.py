"""A body as JSON bytes (the server) or as Python objects (the library) → its spinf_jax.api Struct, or a
ScoringError: invalid_json where the bytes are not JSON, invalid_request naming the field where the JSON does
not fit the Struct.

msgspec says where decoding failed with a path, `$.inputs[2].queries[0].id`; the API's param is that path
without `$.`. Two things are added: the name of a missing field (`messages[0]` → `messages[0].content`), and a
dict's key, which msgspec writes as `[...]`, found in the body (`values[...][1]` → `values.tone[1]`).

What JSON cannot carry is invalid_json, refused before conversion: text that is not UTF-8, NaN and Infinity
(not JSON literals), numbers out of range (msgspec refuses a float past ±1.8e308, never making it inf, and an
integer of over 4,300 digits), and arrays and objects nested deeper than MAX_DEPTH.
"""

import difflib
import math
import re
import types
import typing
from typing import Annotated, Any

import msgspec
import numpy as np

from spinf_jax.errors import ScoringError

_FAILURE = re.compile(r"(?P<what>.*?)(?: - at (?:`key` in )?`\$(?P<path>.*)`)?", re.S)
_MISSING = re.compile(r"Object missing required field `(\w+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(.*)`", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")

Step = str | int  # a key or an index into the body

# Arrays and objects inside each other. The API's bodies need 8 levels (an image part in an input's message).
# The decoders recurse once per level, and near 1,500 levels (Python's C recursion limit) they stop with a
# RecursionError, sooner the deeper the stack already is: the limit is checked on the bytes instead.
MAX_DEPTH = 64

_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_NESTING_STEP = np.zeros(256, np.int8)
_NESTING_STEP[list(b"[{")] = 1
_NESTING_STEP[list(b"]}")] = -1


def decode[T](body: bytes, kind: type[T]) -> T:
    if _depth(body) > MAX_DEPTH:
        raise ScoringError(
            "invalid_json", f"the body nests arrays and objects deeper than {MAX_DEPTH} levels"
        )
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bytes that are not UTF-8 raise the latter
        raise ScoringError("invalid_json", f"the body is not valid JSON: {exc}") from None
    return _convert(raw, kind)


def convert[T](body: object, kind: type[T]) -> T:
    """Python objects → `kind`. They are first checked for what a JSON decoder would have refused: a lone
    surrogate ("\\ud800", which would crash the tokenizer), NaN or an infinity, nesting past MAX_DEPTH (or a
    list that holds itself)."""
    found = _not_json(body)
    if found is not None:
        where, what = found
        param = _param(where)
        raise ScoringError("invalid_request", f"{param or 'the body'} {what}", param)
    return _convert(body, kind)


def _depth(body: bytes) -> int:
    """How deeply arrays and objects nest in JSON text, brackets within strings not counted: checked on the
    bytes before decoding, so the limit is the same number whatever the stack. It runs at C speed: tens of
    milliseconds for the worst 2 MB body. Escapes go first (pairs of backslashes, then escaped quotes), so
    that every quote left opens or closes a string; a string left open runs to the end."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    chars = np.frombuffer(text, np.uint8)
    outside_strings = np.cumsum(chars == ord('"'), dtype=np.uint8) % 2 == 0  # the parity survives overflow
    return int(np.cumsum(_NESTING_STEP[chars] * outside_strings, dtype=np.int32).max(initial=0))


def _convert[T](raw: Any, kind: type[T]) -> T:
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        failure = _FAILURE.fullmatch(str(exc))
        steps = _steps(failure["path"] or "", raw, kind)
        where = _param(steps)
        if missing := _MISSING.fullmatch(failure["what"]):
            steps.append(missing[1])
        if unknown := _UNKNOWN.fullmatch(failure["what"]):
            raise _unknown_field(unknown[1], steps, raw, kind) from None
        message = f"{failure['what']} - at {where}" if where else failure["what"]
        raise ScoringError("invalid_request", message, _param(steps)) from None


def _unknown_field(name: str, steps: list[Step], raw: Any, kind: Any) -> ScoringError:
    """A field our API does not have (a misspelling, most often): named, with the field meant where one is
    close, so the error does not blame a field the caller believes they sent."""
    for step in steps:
        kind = _decoded_as(kind, raw)
        if isinstance(step, int):
            kind = typing.get_args(kind)[0]
        else:
            kind = {field.encode_name: field.type for field in msgspec.structs.fields(kind)}[step]
        raw = raw[step]
    fields = [field.encode_name for field in msgspec.structs.fields(_decoded_as(kind, raw))]
    shown = name if len(name) <= 40 else name[:40] + "…"
    where = _param(steps)
    message = f"{where or 'the body'} has no field {shown!r}"
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    message += f"; did you mean {close[0]!r}?" if close else f" (its fields: {', '.join(fields)})"
    return ScoringError("invalid_request", message, _param([*steps, shown]))


def _param(steps: list[Step] | tuple[Step, ...]) -> str | None:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).removeprefix(".") or None


def _steps(path: str, raw: Any, kind: Any) -> list[Step]:
    """msgspec's path as keys and indices into `raw`, each `[...]` made the key whose value does not fit
    (msgspec converts a dict's items in order and stops at the first that fails). Only a path with `[...]`
    needs the types along it; none passes through a tagged union, whose tag is no field."""
    steps: list[Step] = [
        name or (int(index) if index.isdigit() else index) for name, index in _STEP.findall(path)
    ]
    if "..." not in steps:
        return steps
    for i, step in enumerate(steps):
        kind = _decoded_as(kind, raw)
        if step == "...":
            kind = typing.get_args(kind)[1]
            steps[i] = next(key for key, value in raw.items() if not _fits(value, kind))
        elif isinstance(step, int):
            kind = typing.get_args(kind)[0]
        else:
            kind = {field.encode_name: field.type for field in msgspec.structs.fields(kind)}[step]
        raw = raw[steps[i]]
    return steps


def _decoded_as(kind: Any, raw: Any) -> Any:
    """The type within `kind` (Annotated, or a union) that a JSON object or array like `raw` decodes as."""
    if typing.get_origin(kind) is Annotated:
        return _decoded_as(typing.get_args(kind)[0], raw)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        container = dict if isinstance(raw, dict) else list  # a Python tuple converts as an array
        arms = [_decoded_as(arm, raw) for arm in typing.get_args(kind)]
        return next(arm for arm in arms if _json_container(arm) is container)
    return kind


def _json_container(kind: Any) -> type | None:
    """dict for a type that decodes from a JSON object, list for one that decodes from an array."""
    origin = typing.get_origin(kind) or kind
    if origin is dict or (isinstance(origin, type) and issubclass(origin, msgspec.Struct)):
        return dict
    return list if origin is list else None


def _fits(value: Any, kind: Any) -> bool:
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return False
    return True


def _not_json(value: Any, path: tuple[Step, ...] = ()) -> tuple[tuple[Step, ...], str] | None:
    """Where the first value that JSON cannot carry is, and what is wrong with it; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path, "is not valid Unicode text"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, "is not a finite number")
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list | tuple):
        children = enumerate(value)
    else:
        return None
    if len(path) == MAX_DEPTH:
        return path, f"nests arrays and objects deeper than {MAX_DEPTH} levels"
    for key, child in children:
        found = _not_json(key, (*path, key)) if isinstance(key, str) else None
        found = found or _not_json(child, (*path, key))
        if found is not None:
            return found
    return None
