"""API keys (issue 13): `Authorization: Bearer <key>` or `x-api-key: <key>`, any of several keys; a wrong
value in either header is refused whatever the other says; every key compared, in constant time; /health
open, /metrics behind the key only when the settings ask."""

import hmac

import pytest
from litestar.datastructures import Headers
from litestar.testing import TestClient

from spinf_jax.server import auth
from spinf_jax.server.app import Settings, create_app

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def client():
    """No model: /v1/models answers without one (outside a `with` block, none loads)."""
    return TestClient(create_app(Settings("spinf/gemma-3-270m", api_keys=KEYS)))


ADMITTED = {
    "Bearer, first key": [("authorization", "Bearer key-one")],
    "Bearer, second key": [("authorization", "Bearer key-two")],
    "the scheme in any case": [("authorization", "bEARER key-two")],
    "x-api-key": [("x-api-key", "key-one")],
    "both headers right": [("authorization", "Bearer key-one"), ("x-api-key", "key-two")],
}
REFUSED = {
    "no key": [],
    "a bare key, no scheme": [("authorization", "key-one")],
    "another scheme": [("authorization", "Basic key-one")],
    "Bearer without a key": [("authorization", "Bearer ")],
    "a prefix of a key": [("authorization", "Bearer key-on")],
    "a key and more": [("authorization", "Bearer key-one2")],
    "wrong Bearer, right x-api-key": [("authorization", "Bearer wrong"), ("x-api-key", "key-one")],
    "right Bearer, wrong x-api-key": [("authorization", "Bearer key-one"), ("x-api-key", "wrong")],
    "an empty x-api-key": [("x-api-key", "")],
    "a second, wrong Authorization": [("authorization", "Bearer key-one"), ("authorization", "Bearer wrong")],
}


@pytest.mark.parametrize("headers", ADMITTED.values(), ids=ADMITTED.keys())
def test_admitted(client, headers):
    assert client.get("/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize("headers", REFUSED.values(), ids=REFUSED.keys())
def test_refused(client, headers):
    response = client.get("/v1/models", headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
    assert response.headers["www-authenticate"] == 'Bearer realm="spinf"'


def test_the_schema_says_how_a_key_is_sent(client):
    doc = client.get("/schema/openapi.json").json()
    schemes = doc["components"]["securitySchemes"]
    assert (schemes["bearer"]["type"], schemes["bearer"]["scheme"]) == ("http", "bearer")
    assert schemes["x_api_key"] == {"type": "apiKey", "name": "x-api-key", "in": "header"}
    for path, method in [("/v1/score", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get")]:
        assert {"bearer": []} in doc["paths"][path][method]["security"]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_a_refusal_does_not_echo_the_key(client):
    response = client.get("/v1/models", headers={"authorization": "Bearer sent-by-someone-7Qx"})
    assert response.status_code == 401 and "7Qx" not in response.text


def test_every_key_is_compared_for_every_credential(monkeypatch):
    """No exit at the first match: the time does not tell which key it was."""
    compared, compare = [], hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(b) or compare(a, b))
    keys = auth.ApiKeys(["a", "b", "c"])
    assert keys.admit(Headers({"authorization": "Bearer a"}))
    assert len(compared) == 3
    assert not keys.admit(Headers({"authorization": "Bearer a", "x-api-key": "z"}))
    assert len(compared) == 3 + 6


def test_without_keys_anyone_is_admitted():
    assert auth.ApiKeys([]).admit(Headers({"authorization": "Bearer anything"}))


def test_health_is_open_and_metrics_open_unless_asked(client):
    assert client.get("/health").status_code == 503  # loading, and not a 401
    assert client.get("/metrics").status_code == 200
    guarded = TestClient(create_app(Settings("spinf/gemma-3-270m", api_keys=KEYS, metrics_auth=True)))
    assert guarded.get("/metrics").json()["error"]["code"] == "invalid_api_key"
    assert guarded.get("/metrics", headers={"x-api-key": "key-two"}).status_code == 200
    assert guarded.get("/health").status_code == 503


def test_keys_are_never_in_a_repr():
    assert "key-one" not in repr(Settings("spinf/gemma-3-270m", api_keys=KEYS))
