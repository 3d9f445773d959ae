"""No 5xx from input (issue 13): 2,000 bodies in CI and 10,000 in the full tier (`pytest -m full`), generated
from the served OpenAPI schema (and valid requests built from SPEC's questions), then mutated into what broken
clients and attackers send (cut short, random bytes, wrong types, NaN and out-of-range numbers, nesting far
past the limit), posted to the app under Litestar's TestClient. Every answer is a 200 or a 4xx in the
envelope, and afterwards the server gives the same bits for a fixed request as before.

The cost stays near 20 s (2,000 bodies) on two cores because the bulk never reaches the engine: while it runs,
the server's request budget is one token, so a body that decodes and compiles is refused (too_many_tokens) as
its trees are built, the step before the queue. And the bulk is handed to the app as ASGI requests, a
document's bodies in one call on the TestClient's event loop: through httpx, one call a body, it took twice as
long (2.0 against 0.9 ms a body, most of which is the app's). Then a dozen valid requests are scored for real,
through the TestClient.
"""

import copy
import dataclasses
import json

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from spinf_jax import api, openai_decisions, systemone
from spinf_jax.decoding import MAX_DEPTH
from spinf_jax.errors import CODES
from spinf_jax.server.app import Settings, create_app
from tests.profiles import examples
from tests.serving import loaded
from tests.spec_example import QUERY_POOL

MODEL = "spinf/gemma-3-270m"
ROUTES = {"/v1/score": api.ScoreResponse, "/v1/chat/completions": api.ChatCompletion}
# The decision APIs answer errors in their clients' shapes: 422 {"detail": [...]}, else {"detail": {...}}.
DECISION_ROUTES = {
    "/v1/systemone": systemone.SystemOneResponse,
    "/v1/systemone/batch": systemone.SystemOneBatchResponse,
    "/v1/decisions": openai_decisions.DecisionsResponse,
}
ENGINE_BODIES = examples(12)
FIXED = {
    "messages": [{"role": "user", "content": "I was charged twice for September."}],
    "scoring": {"queries": QUERY_POOL[:3]},
}
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def client(gemma_engine):
    with TestClient(create_app(Settings(MODEL), gemma_engine)) as client:
        assert loaded(client)["status"] == "ok"
        yield client


# ---------------------------------------------------------------------------------------------------------
# Bodies that fit the schema. Strings mix random text with pieces of template syntax, so that bodies reach
# the compiler's checks of meaning and not only the decoder's.

FRAGMENTS = [
    "{?}",
    "{*}",
    "{n}",
    "{$}",
    "{tone}",
    "{{",
    "}}",
    "{",
    " yes",
    " no",
    "\n\nAnswer:",
    "all",
    "tone",
]
strings = st.text(max_size=12) | st.lists(
    st.sampled_from([*FRAGMENTS, "\ud800", "\x00", "🙂"]), max_size=4
).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=8,
)


def from_schema(node: dict, components: dict) -> st.SearchStrategy:
    """Values that fit a node of the OpenAPI document: the keywords Litestar writes for msgspec Structs."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:  # a Literal, such as a query's mode (with null where it is optional)
        return st.sampled_from(node["enum"])
    if "oneOf" in node:  # Litestar writes minItems and minLength beside the arms
        shared = {k: v for k, v in node.items() if k in ("minItems", "minLength")}
        return st.one_of([from_schema(shared | arm, components) for arm in node["oneOf"]])
    kind = node.get("type")
    if kind == "object" and "properties" in node:
        fields = {name: from_schema(value, components) for name, value in node["properties"].items()}
        required = node.get("required", [])
        return st.fixed_dictionaries(
            {name: fields[name] for name in required},
            optional={name: field for name, field in fields.items() if name not in required},
        )
    if kind == "object":
        return st.dictionaries(
            strings, from_schema(node.get("additionalProperties", {}), components), max_size=3
        )
    if kind == "array":
        least = node.get("minItems", 0)
        return st.lists(from_schema(node["items"], components), min_size=least, max_size=least + 3)
    if kind == "string":
        return strings.map(lambda s: s.ljust(node.get("minLength", 0), "x"))
    simple = {"boolean": st.booleans(), "null": st.none(), "integer": st.integers(), "number": st.floats()}
    if kind is None:  # any value
        return json_values
    return simple[kind]


# ---------------------------------------------------------------------------------------------------------
# Mutations: each turns a generated document into the bytes to post.

MARK = "\x1fnode\x1f"  # stands where a mutation writes its own text
LITERALS = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"nan",
    b"1e999",
    b"-1e400",
    b"1" + b"0" * 30,
    b"-0",
    b"1e-999",
]
DEPTHS = [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 1_495, 100_000]


def _encode(data, document) -> bytes:
    ascii_only = data.draw(st.booleans())  # not: lone surrogates written as they are, which is not UTF-8
    return json.dumps(document, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def _paths(value, path=()):
    yield path
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        yield from _paths(child, (*path, key))


def _at(document, path):
    for step in path:
        document = document[step]
    return document


def _with(document, path, value):
    if not path:
        return value
    document = copy.deepcopy(document)
    _at(document, path[:-1])[path[-1]] = value
    return document


def _at_a_node(data, document, text: bytes) -> bytes:
    """The document with one of its values (or itself) written as `text`."""
    path = data.draw(st.sampled_from(list(_paths(document))))
    return _encode(data, _with(document, path, MARK)).replace(json.dumps(MARK).encode(), text)


def as_generated(data, document):
    return _encode(data, document)


def wrong_type(data, document):
    path = data.draw(st.sampled_from(list(_paths(document))))
    return _encode(data, _with(document, path, data.draw(json_values)))


def other_text(data, document):
    """One string changed: a template without its slot, equal options, an unknown placeholder..."""
    texts = [path for path in _paths(document) if isinstance(_at(document, path), str)] or [()]
    return _encode(data, _with(document, data.draw(st.sampled_from(texts)), data.draw(strings)))


def bad_number(data, document):
    return _at_a_node(data, document, data.draw(st.sampled_from(LITERALS)))


def deep(data, document):
    depth = data.draw(st.sampled_from(DEPTHS))
    opener, closer = data.draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b"[", b"")]))
    return _at_a_node(data, document, opener * depth + b"1" + closer * depth)


def truncated(data, document):
    body = _encode(data, document)
    return body[: data.draw(st.integers(0, len(body)))]


def edited(data, document):
    """A few bytes inserted, overwritten or deleted: bad UTF-8, broken syntax."""
    body = bytearray(_encode(data, document))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body)))
        byte = data.draw(st.integers(0, 255))
        how = data.draw(st.sampled_from(["insert", "overwrite", "delete"]))
        if how == "insert":
            body.insert(at, byte)
        elif at < len(body):
            body[at : at + 1] = bytes([byte]) if how == "overwrite" else b""
    return bytes(body)


def noise(data, _):
    return data.draw(st.binary(max_size=300))


MUTATIONS = [as_generated, wrong_type, other_text, bad_number, deep, truncated, edited, noise]


# ---------------------------------------------------------------------------------------------------------
# Requests valid by construction: contents and questions the engine scores.

messages = st.lists(
    st.fixed_dictionaries({"content": st.text(min_size=1, max_size=80)}, optional={"role": st.just("user")}),
    min_size=1,
    max_size=2,
)
# Extraction slots too (short ones: each decodes), so that random contents reach the decode steps.
SLOTS = [
    {"id": "month", "template": '\n\nQ: Which month?\nA: "{*}', "max_answers": 2, "max_tokens": 3},
    {"id": "count", "template": "\n\nQ: How many?\nA:{n}", "mode": "generate", "max_tokens": 3},
]
scoring = st.fixed_dictionaries(
    {
        "queries": st.lists(
            st.sampled_from(QUERY_POOL + SLOTS), min_size=1, max_size=2, unique_by=lambda q: q["id"]
        )
    },
    optional={"empty_floor": st.booleans()},
)
inputs = st.lists(st.fixed_dictionaries({"messages": messages}), min_size=1, max_size=2)
valid_requests = st.one_of(
    st.fixed_dictionaries({"messages": messages, "scoring": scoring}, optional={"model": st.just(MODEL)}),
    st.fixed_dictionaries({"inputs": inputs, "scoring": scoring}, optional={"model": st.just(MODEL)}),
)


async def _posted(app, path: str, bodies: list[bytes]) -> list[httpx.Response]:
    return [await _post(app, path, body) for body in bodies]


async def _post(app, path: str, body: bytes) -> httpx.Response:
    """The body posted to the ASGI app as httpx would send it (no content type), and its answer."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver.local"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver.local", 80),
    }
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return incoming.pop() if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return httpx.Response(start["status"], headers=start["headers"], content=content)


def _answered(response, path: str) -> None:
    """The property: a 200 with the route's body, or a refusal in the envelope under its documented status."""
    status = response.status_code
    if status == 200:
        msgspec.json.decode(response.content, type=(ROUTES | DECISION_ROUTES)[path])
        return
    assert status < 500, response.text
    if path in DECISION_ROUTES:
        detail = response.json()["detail"]
        if status == 422:
            assert all({"loc", "msg", "type"} <= set(item) for item in detail), detail
        else:
            assert {"error_type", "message"} <= set(detail), detail
        assert response.headers["x-typesafe-request-id"] == response.headers["x-request-id"]
        return
    envelope = msgspec.json.decode(response.content, type=api.ErrorEnvelope)
    assert status < 500, response.text
    assert CODES[envelope.error.code][0] == status
    assert response.headers["x-request-id"] == envelope.request_id


# 2,000 bodies in CI (about 20 s); the release checklist's full tier posts 10,000.
@pytest.mark.parametrize(
    "bulk", [examples(2_000), pytest.param(examples(10_000), marks=pytest.mark.full, id="full")]
)
def test_no_body_gets_a_5xx_and_the_bits_stay(client, monkeypatch, bulk):
    schema = client.get("/schema/openapi.json").json()
    documents = {
        path: from_schema(
            schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
            schema["components"]["schemas"],
        )
        | valid_requests
        for path in ROUTES | DECISION_ROUTES
    }
    before = client.post("/v1/score", json=FIXED)
    assert before.status_code == 200, before.text
    posted, scored = [], []

    @settings(FUZZ, max_examples=-(-bulk // len(MUTATIONS)))
    @given(data=st.data())
    def bulk_bodies(data):
        path = data.draw(st.sampled_from(list(ROUTES | DECISION_ROUTES)))
        document = data.draw(documents[path])
        # a document costs more to draw than its bodies to post: each mutation of it
        bodies = [mutate(data, document) for mutate in MUTATIONS]
        for response in client.blocking_portal.call(_posted, client.app, path, bodies):
            _answered(response, path)
            posted.append(path)

    @settings(FUZZ, max_examples=ENGINE_BODIES)
    @given(path=st.sampled_from(list(ROUTES)), body=valid_requests)
    def engine_bodies(path, body):
        response = client.post(path, json=body)
        _answered(response, path)
        scored.append(response.status_code == 200)

    service = client.app.state.server.service
    scorer, reader = service.scorer, service.apis.reader
    with monkeypatch.context() as patch:
        patch.setattr(scorer, "limits", dataclasses.replace(scorer.limits, max_request_tokens=1))
        patch.setattr(reader, "limits", dataclasses.replace(reader.limits, max_request_tokens=1))
        bulk_bodies()
    engine_bodies()
    assert len(posted) >= bulk and sum(scored) >= ENGINE_BODIES // 2
    after = client.post("/v1/score", json=FIXED)
    assert (after.json()["results"], after.json()["system_fingerprint"]) == (
        before.json()["results"],
        before.json()["system_fingerprint"],
    )
