"""The typed API (spinf_jax.api): /schema is an OpenAPI 3.1 document that holds every field SPEC names, and a
body that does not fit is refused with the path of the offending field as `param`."""

import jsonschema
import pytest
from litestar.testing import TestClient
from openapi_spec_validator import validate

from spinf_jax.server.app import Settings, create_app
from tests.spec_example import SPEC_REQUEST, SPEC_RESPONSE


@pytest.fixture(scope="module")
def client():
    """The app without its model: serving the schema and decoding bodies need none, and outside a `with` block
    the client does not run the startup that would load it."""
    return TestClient(create_app(Settings("spinf/gemma-3-270m")))


@pytest.fixture(scope="module")
def schema(client) -> dict:
    response = client.get("/schema/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_schema_is_openapi_3_1(schema):
    assert schema["openapi"].startswith("3.1.")
    validate(schema)  # raises on a document a client generator could not trust


# ---------------------------------------------------------------------------------------------------------
# Every field of SPEC: the examples' fields, and those SPEC names only in its prose.
# A path: keys joined with ".", "[]" for an array's items.

REQUEST_PROSE = [
    "messages[].role",
    "messages[].content[].type",
    "messages[].content[].text",
    "inputs[].id",
    "inputs[].messages[].content",
    "inputs[].query_ids[]",
    "inputs[].queries[].template",
    "scoring.queries[].combinations[].tone",
    "scoring.empty_floor",
    "packs[].id",
]
RESPONSE_PROSE = [
    "results[].queries[].combinations[].answers[].value",
    "results[].queries[].combinations[].answers[].currency",
]
CHAT_RESPONSE = [
    "id",
    "object",
    "created",
    "model",
    "system_fingerprint",
    "choices",
    "results[].queries[].combinations[].options[].p",
    "warnings[].code",
    "usage.prompt_tokens",
    "usage.prompt_tokens_details.floor_tokens",
]
MODELS = ["object", "data[].id", "data[].object", "data[].created", "data[].owned_by"]
ERROR = ["error.type", "error.code", "error.message", "error.param", "request_id"]


def _paths(value, prefix: str = ""):
    """Every path of a JSON value, as REQUEST_PROSE writes them."""
    if isinstance(value, dict):
        for key, child in value.items():
            path = f"{prefix}.{key}".removeprefix(".")
            yield path
            yield from _paths(child, path)
    elif isinstance(value, list):
        for item in value:
            yield from _paths(item, prefix + "[]")


def _steps(path: str) -> list[str]:
    return path.replace("[]", ".[]").split(".")


def _holds(document: dict, schema: dict, steps: list[str]) -> bool:
    """Whether `schema` has a place for the path: a named property, an array's items, or (for keys the client
    chooses, such as a placeholder's name) an object's additional properties."""
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if not steps:
        return True
    arms = schema.get("oneOf", []) + schema.get("anyOf", [])
    if arms:
        return any(_holds(document, arm, steps) for arm in arms)
    step, rest = steps[0], steps[1:]
    if step == "[]":
        return schema.get("type") == "array" and _holds(document, schema.get("items", {}), rest)
    if step in schema.get("properties", {}):
        return _holds(document, schema["properties"][step], rest)
    extra = schema.get("additionalProperties")
    return isinstance(extra, dict) and _holds(document, extra, rest)


def _body(schema: dict, path: str, method: str, status: str | None = None) -> dict:
    """The schema of an operation's request body (no status) or of its answer with that status."""
    operation = schema["paths"][path][method]
    content = operation["responses"][status]["content"] if status else operation["requestBody"]["content"]
    return content["application/json"]["schema"]


def _missing(schema: dict, body: dict, paths) -> list[str]:
    return [path for path in dict.fromkeys(paths) if not _holds(schema, body, _steps(path))]


@pytest.mark.parametrize("path", ["/v1/score", "/v1/chat/completions"])
def test_schema_documents_every_field_of_the_request(schema, path):
    body = _body(schema, path, "post")
    assert not _missing(schema, body, [*_paths(SPEC_REQUEST), *REQUEST_PROSE])


def test_schema_documents_every_field_of_the_responses(schema):
    score = _body(schema, "/v1/score", "post", "200")
    assert not _missing(schema, score, [*_paths(SPEC_RESPONSE), *RESPONSE_PROSE])
    assert not _missing(schema, _body(schema, "/v1/chat/completions", "post", "200"), CHAT_RESPONSE)
    assert not _missing(schema, _body(schema, "/v1/models", "get", "200"), MODELS)
    for status in ("400", "401", "404", "413", "429", "503"):
        assert not _missing(schema, _body(schema, "/v1/score", "post", status), ERROR), status


def _validator(schema: dict, body: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**body, "components": schema["components"]})


def test_spec_examples_are_valid_bodies(schema):
    _validator(schema, _body(schema, "/v1/score", "post")).validate(SPEC_REQUEST)
    _validator(schema, _body(schema, "/v1/score", "post", "200")).validate(SPEC_RESPONSE)
    wrong = {**SPEC_REQUEST, "scoring": {"queries": [{"id": "q", "template": "A:{?}", "options": " yes"}]}}
    assert not _validator(schema, _body(schema, "/v1/score", "post")).is_valid(wrong)


# ---------------------------------------------------------------------------------------------------------
# Decoding errors: msgspec's path to the value (`$.inputs[0].messages[0].content`) is the envelope's param.

INPUT = {"messages": [{"content": "Hello."}]}
GRID = {"id": "q", "template": "{tone}:{?}", "options": [" yes"], "combinations": "all"}
PARAMS = [
    ({"inputs": [INPUT, {"messages": [{"content": 5}]}]}, "inputs[1].messages[0].content"),
    ({"inputs": [{"messages": [{"role": "user"}]}]}, "inputs[0].messages[0].content"),  # a missing field
    ({"inputs": [INPUT], "scoring": {"queries": [GRID | {"values": {"tone": ["calm", 3]}}]}},
     "scoring.queries[0].values.tone[1]"),  # msgspec writes a dict's key as [...]
    ({"messages": [{"content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"content": [{"type": "file"}]}]}, "messages[0].content[0].type"),
    ({"messages": [], "scoring": {}}, "messages"),
    ({"scoring": {"queries": [], "empty_floor": "false"}}, "scoring.empty_floor"),  # no lenient conversion
    ([INPUT], None),
]  # fmt: skip


@pytest.mark.parametrize("body, param", PARAMS)
def test_decoding_errors_name_the_field(client, body, param):
    for path in ("/v1/score", "/v1/chat/completions"):
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"] | {"message": ""} == {
            "type": "invalid_request_error",
            "code": "invalid_request",
            "message": "",
            "param": param,
        }


@pytest.mark.parametrize("raw", [b"", b"{nope", b'"\xff"', b'{"messages": [{"content": "\\ud800"}]}'])
def test_bytes_that_are_not_json(client, raw):
    """Empty, malformed, not UTF-8, a lone surrogate: invalid_json in the envelope, never a 500."""
    response = client.post("/v1/score", content=raw)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")


def test_the_key_is_checked_before_the_body():
    client = TestClient(create_app(Settings("spinf/gemma-3-270m", api_keys=("sekret",))))
    response = client.post("/v1/score", content=b"{nope")
    assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")


def test_the_schema_page_needs_nothing_from_the_network(client):
    """/schema is HTML written by the server (every route listed, no script from a CDN), beside the
    document as JSON and YAML."""
    page = client.get("/schema")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "<script" not in text and "http" not in text.split("<body>")[1].split("openapi.json")[0]
    assert "<code>/v1/score</code>" in text and "<code>/v1/systemone</code>" in text
    assert client.get("/schema/openapi.yaml").status_code == 200
