"""What JSON cannot carry is invalid_json, never a 500 (issue 13): nesting past MAX_DEPTH, NaN and Infinity,
numbers out of range, bytes that are not UTF-8. The library refuses the same in Python objects."""

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from litestar.testing import TestClient

from spinf_jax import api
from spinf_jax.decoding import MAX_DEPTH, convert, decode
from spinf_jax.errors import ScoringError
from spinf_jax.server.app import Settings, create_app


@pytest.fixture(scope="module")
def client():
    """No model: each body here is refused before one is needed (outside a `with` block, none loads)."""
    return TestClient(create_app(Settings("spinf/gemma-3-270m")))


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


def _with_field(value: bytes) -> bytes:
    """A body whose scoring.empty_floor is `value`, written as it is."""
    return b'{"messages": [{"content": "Hello."}], "scoring": {"empty_floor": ' + value + b"}}"


NOT_JSON = {
    "one level past the limit": _nested(MAX_DEPTH + 1),
    "the tester's 1,495 brackets": b"[" * 1_495,
    "100,000 nested objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep inside a valid body": _with_field(_nested(MAX_DEPTH)),
    "NaN": _with_field(b"NaN"),
    "Infinity": _with_field(b"Infinity"),
    "-Infinity": _with_field(b"-Infinity"),
    "a float past the range": _with_field(b"1e999"),
    "a negative float past the range": _with_field(b"-1.8e308"),
    "an integer of 5,000 digits": _with_field(b"9" * 5_000),  # Python's limit is 4,300
    "not UTF-8": b'{"messages": [{"content": "\xc3\x28"}]}',
}


@pytest.mark.parametrize("body", NOT_JSON.values(), ids=NOT_JSON.keys())
@pytest.mark.parametrize("path", ["/v1/score", "/v1/chat/completions"])
def test_what_json_cannot_carry_is_invalid_json(client, path, body):
    response = client.post(path, content=body)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json"), response.text


def test_nesting_up_to_the_limit_decodes_and_brackets_in_strings_do_not_count(client):
    at_the_limit = client.post("/v1/score", content=_nested(MAX_DEPTH - 1, b"[]"))
    assert at_the_limit.json()["error"]["code"] == "invalid_request"  # decoded: an array is not a request
    text = "[{" * 10_000 + '\\"]}'
    answer = client.post("/v1/chat/completions", json={"messages": [{"content": text}]})
    assert answer.json()["error"]["code"] == "scoring_required"  # decoded and converted


BRACKETY = st.text(alphabet='[]{}"\\, :ab\n', max_size=6)
json_values = st.recursive(
    st.none() | st.integers(-(2**63), 2**63 - 1) | BRACKETY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(BRACKETY, inner, max_size=3),
    max_leaves=12,
)


def _depth(value) -> int:
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max(map(_depth, children), default=0)
    return 0


@given(value=json_values, past=st.booleans(), ascii_only=st.booleans())
def test_the_limit_counts_arrays_and_objects_and_nothing_in_strings(value, past, ascii_only):
    """Strings full of brackets, quotes and backslashes, wrapped to end at the limit or one past it."""
    for _ in range(MAX_DEPTH + past - _depth(value)):
        value = [value]
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    if past:
        with pytest.raises(ScoringError) as e:
            decode(body, Any)
        assert e.value.code == "invalid_json"
    else:
        assert decode(body, Any) == value


def _loop() -> list:
    loop = []
    loop.append(loop)
    return loop


def _deep(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


LIBRARY = [
    ({"messages": [{"content": "x", "extra": float("nan")}]}, "messages[0].extra", "not a finite number"),
    ({"messages": [{"content": "x"}], "x": float("-inf")}, "x", "not a finite number"),
    ({"messages": [{"content": "x", "\ud800": 1}]}, "messages[0].\ud800", "not valid Unicode text"),
    (
        {"messages": [{"content": "x"}], "x": _deep(MAX_DEPTH)},
        "x" + "[0]" * (MAX_DEPTH - 1),
        "deeper than 64",
    ),
    ({"messages": _loop()}, "messages" + "[0]" * (MAX_DEPTH - 1), "deeper than 64"),
]


@pytest.mark.parametrize("body, param, message", LIBRARY)
def test_the_library_refuses_the_same_in_python_objects(body, param, message):
    with pytest.raises(ScoringError) as e:
        convert(body, api.ScoreRequest)
    assert (e.value.code, e.value.param) == ("invalid_request", param)
    assert message in e.value.message


MISSPELLED = {
    "scoring.query": (
        {"scoring": {"query": [{"id": "q", "template": "A:{?}", "options": [" a"]}]}},
        "scoring has no field 'query'; did you mean 'queries'?",
    ),
    "scoring.queries[0].option": (
        {"scoring": {"queries": [{"id": "q", "template": "A:{?}", "option": [" a"]}]}},
        "scoring.queries[0] has no field 'option'; did you mean 'options'?",
    ),
    "scorng": ({"scorng": {}}, "the body has no field 'scorng'; did you mean 'scoring'?"),
    "packs[0].categorys": (
        {"packs": [{"id": "spinf/reviews", "categorys": ["x"]}]},
        "packs[0] has no field 'categorys'; did you mean 'categories'?",
    ),
    "inputs[0].zzz": (
        {"inputs": [{"messages": [{"content": "x"}], "zzz": 1}]},
        "inputs[0] has no field 'zzz' (its fields: id, messages, query_ids, queries)",
    ),
}


@pytest.mark.parametrize("param", list(MISSPELLED))
def test_a_field_we_do_not_have_is_named_with_the_one_meant(client, param):
    """Our own bodies refuse fields they do not have, naming the field and the closest one there is: a
    misspelled `query` is not read as a missing `queries`."""
    extra, message = MISSPELLED[param]
    body = {"messages": [{"content": "Hello."}]} | extra
    response = client.post("/v1/score", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["message"]) == ("invalid_request", param, message)


def test_the_chat_route_takes_what_the_openai_sdk_sends_beside_ours(client):
    """/v1/chat/completions ignores the chat fields the SDKs add (temperature, n, ...) at the top level, and
    refuses a misspelling inside ours."""
    body = {"messages": [{"content": "Hi."}], "temperature": 0.2, "n": 1, "scoring": {"quries": []}}
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "scoring.quries" and "did you mean 'queries'?" in error["message"]
    decide = {"id": "d", "state": "x", "question": "q", "options": [{"id": "a", "descripton": "A"}]}
    error = client.post("/decide", json=decide).json()["error"]
    assert error["param"] == "options[0].descripton" and "did you mean 'description'?" in error["message"]
