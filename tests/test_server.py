"""The real server (uvicorn on 127.0.0.1) called with plain HTTP and the official OpenAI SDK."""

import copy
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from spinf_jax import fingerprint
from spinf_jax.calibration import Calibration, Workload
from spinf_jax.decisions import Decider
from spinf_jax.server.app import Settings, create_app
from tests.engines import TINY
from tests.profiles import examples
from tests.serving import loaded, serving
from tests.spec_example import QUERY_POOL, scores_by_question, without_extraction

MODEL = "spinf/smollm2-135m-instruct"
BODY = {**without_extraction(), "model": MODEL}
TEXTS = [
    f"Message {i}: my order number {1000 + 37 * i} arrived {'late' if i % 2 else 'broken'}."
    for i in range(12)
]


@pytest.fixture(scope="module")
def engine(smollm_engine):
    return smollm_engine


@pytest.fixture(scope="module")
def url(engine):
    calibration = Calibration({"support": Workload(2.0), "spam": Workload(1.5, rule="floor_lift")})
    settings = Settings(MODEL, served_names=("spinf/gemma-4-12b-fp8",), calibration=calibration)
    with serving(create_app(settings, engine)) as url:
        yield url


@pytest.fixture(scope="module")
def strict_url(engine):
    """A server with an API key and no room in its queue."""
    with serving(create_app(Settings(MODEL, api_keys=("sekret",), max_queue=0), engine)) as url:
        yield url


def test_default_model_same_bits_however_a_question_is_asked(default_url):
    messages = BODY["messages"]
    asked = ["refund", "city", "sentiment_about"]
    others = [
        {
            "id": f"other{i}",
            "messages": [{"role": "user", "content": t}],
            "query_ids": [QUERY_POOL[i % 7]["id"]],
        }
        for i, t in enumerate(TEXTS + TEXTS[:7])
    ]
    target = {"id": "target", "messages": messages, "query_ids": asked}
    bodies = {
        "alone": [
            {"messages": messages, "scoring": {"queries": [q]}} for q in QUERY_POOL if q["id"] in asked
        ],
        "among all the questions": [{"messages": messages, "scoring": {"queries": QUERY_POOL[::-1]}}],
        "via query_ids": [{"inputs": [target], "scoring": {"queries": QUERY_POOL}}],
        "in a 20-input batch": [
            {"inputs": [*others[:8], target, *others[8:]], "scoring": {"queries": QUERY_POOL}}
        ],
    }
    seen = {}
    for how, requests in bodies.items():
        scores = {}
        for body in requests:
            r = httpx.post(f"{default_url}/v1/score", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert len(r.json()["results"]) == len(body.get("inputs", [0]))
            scores |= {k[1:]: v for k, v in scores_by_question(r.json()).items() if k[0] in ("0", "target")}
        mine = {k: v for k, v in scores.items() if k[0] in asked}
        assert {k[0] for k in mine} == set(asked), how
        for key, value in mine.items():
            assert value == seen.setdefault(key, value), (how, key)


def test_extraction_over_http_and_the_openai_sdk(default_url):
    """SPEC's example slot (`A: "{*}`, which ends at the implied closing quote) and a number, over /v1/score
    and through the OpenAI SDK's extra_body; the same answers both ways and when the slot is asked alone."""
    month = {"id": "month", "template": '\n\nQ: Which month was charged twice?\nA: "{*}'}
    refund = {"id": "refund", "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
              "options": [" yes", " no"]}  # fmt: skip
    messages = [{"role": "user", "content": "Customer support message:\nI was charged twice for September."}]
    scoring = {"queries": [refund, month]}
    r = httpx.post(f"{default_url}/v1/score", json={"messages": messages, "scoring": scoring}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    answers = body["results"][0]["queries"][1]["combinations"][0]["answers"]
    assert answers[0]["text"] == "September" and {"text", "logprob", "p"} <= set(answers[0])
    decode_tokens = body["usage"]["prompt_tokens_details"]["decode_tokens"]
    assert decode_tokens > 0
    client = openai.OpenAI(base_url=f"{default_url}/v1", api_key="unused")
    completion = client.chat.completions.create(
        model="spinf/gemma-3-270m", messages=messages, extra_body={"scoring": {"queries": [month]}}
    )
    extra = completion.model_extra
    assert extra["results"][0]["queries"][0]["combinations"][0]["answers"] == answers
    assert completion.usage.completion_tokens > 0
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    bad = {"messages": messages, "scoring": {"queries": [{**month, "max_answers": 12}]}}
    _error(
        httpx.post(f"{default_url}/v1/score", json=bad), 400, "out_of_range", "scoring.queries[0].max_answers"
    )
    assert httpx.get(f"{default_url}/health").status_code == 200


def _error(response, status, code, param=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code
    assert body["request_id"].startswith("req_") and body["error"]["type"] and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body


def test_score_over_http(url):
    r = httpx.post(f"{url}/v1/score", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "score" and body["model"] == MODEL
    assert [q["id"] for q in body["results"][0]["queries"]] == ["topic", "refund", "sentiment_about"]
    assert len(body["results"][0]["queries"][2]["combinations"]) == 4
    assert body["usage"]["prompt_tokens"] > 0


def test_openai_sdk_chat_completions(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="spinf/gemma-4-12b-fp8", messages=BODY["messages"], extra_body={"scoring": BODY["scoring"]}
    )
    assert reply.object == "chat.completion" and reply.choices == []
    assert reply.model == "spinf/gemma-4-12b-fp8"  # an alias of the served model answers under its name
    direct = httpx.post(f"{url}/v1/score", json=BODY, timeout=60).json()
    assert reply.model_extra["results"] == direct["results"]
    assert reply.system_fingerprint == direct["system_fingerprint"]
    assert [m.id for m in client.models.list()] == [MODEL, "spinf/gemma-4-12b-fp8"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "scoring_required"
    with pytest.raises(openai.BadRequestError) as e:  # the SDK would wait for events that never come
        client.chat.completions.create(
            model=MODEL, messages=BODY["messages"], extra_body={"scoring": BODY["scoring"]}, stream=True
        )
    assert e.value.code == "streaming_unsupported"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4o", messages=BODY["messages"], extra_body={"scoring": BODY["scoring"]}
        )


def test_workloads_and_orderings_of_queries_through_the_openai_sdk(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    query = {"id": "spam", "template": "\n\nIs this spam?\nAnswer:{?}", "options": [" yes", " no"]}
    scoring = {"queries": [query | {"workload": "spam"}]}
    reply = client.chat.completions.create(
        model=MODEL, messages=BODY["messages"], extra_body={"scoring": scoring}
    )
    combination = reply.model_extra["results"][0]["queries"][0]["combinations"][0]
    calibrated = combination["calibrated"]
    assert (calibrated["workload"], calibrated["temperature"], calibrated["rule"]) == (
        "spam",
        1.5,
        "floor_lift",
    )
    lifts = [o["logprob"] - math.log(o["floor_p"]) for o in combination["options"]]
    assert calibrated["choice"] == query["options"][lifts.index(max(lifts))]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=BODY["messages"],
            extra_body={"scoring": {"queries": [query | {"workload": "x"}]}},
        )
    assert e.value.code == "unknown_workload"
    # Option-order averaging on a query that lists its options.
    listed = query | {"id": "listed", "template": "\n\nSpam ({options})?{?}", "orderings": "rotations"}
    scoring = {"queries": [listed]}
    reply = client.chat.completions.create(
        model=MODEL, messages=BODY["messages"], extra_body={"scoring": scoring}
    )
    combined = reply.model_extra["results"][0]["queries"][0]["combinations"][0]["combined"]
    assert combined["orderings"] == 2 and combined["top"] in (" yes", " no")


def _with_content(text: str) -> dict:
    body = copy.deepcopy(BODY)
    body["messages"] = [{"role": "user", "content": text}]
    return body


def test_concurrent_clients_get_what_they_get_alone(url):
    alone = [
        httpx.post(f"{url}/v1/score", json=_with_content(t), timeout=60).json()["results"] for t in TEXTS
    ]
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        together = list(
            pool.map(lambda t: httpx.post(f"{url}/v1/score", json=_with_content(t), timeout=120), TEXTS)
        )
    for response, expected in zip(together, alone, strict=True):
        assert response.status_code == 200
        assert response.json()["results"] == expected
    metrics = httpx.get(f"{url}/metrics").text
    assert 'spinf_requests_total{path="/v1/score",status="200"}' in metrics
    assert "spinf_pass_seconds_count" in metrics and "spinf_queue_depth 0" in metrics


def test_errors_in_the_envelope(url):
    _error(httpx.post(f"{url}/v1/score", content=b"{nope"), 400, "invalid_json")
    _error(httpx.post(f"{url}/v1/score", json=[1, 2]), 400, "invalid_request")
    bad = copy.deepcopy(BODY)
    # "cats" is one token, not "cat" + "s"
    bad["scoring"]["queries"][0] |= {"template": "\n\nThe cat{?}", "options": [" dog", "s"]}
    _error(httpx.post(f"{url}/v1/score", json=bad), 400, "option_boundary", "scoring.queries[0].options[1]")
    _error(httpx.post(f"{url}/v1/score", json={**BODY, "model": "other"}), 404, "model_not_found", "model")
    _error(
        httpx.post(f"{url}/v1/score", json={**BODY, "packs": [{"id": "nobody/missing"}]}),
        400,
        "unknown_pack",
    )
    _error(httpx.get(f"{url}/v1/nothing"), 404, "not_found")
    _error(httpx.get(f"{url}/v1/score"), 405, "method_not_allowed")
    health = httpx.get(f"{url}/health").json()
    assert health["ready"] is True
    assert health["precision"] == "fp32"  # the engine's, not the settings' default (bf16)
    # the parts a user compares across servers, and the fingerprint is their digest
    assert fingerprint.digest(health["fingerprint_parts"]) == health["system_fingerprint"]
    assert health["fingerprint_parts"]["precision"] == "fp32" and "xla_flags" in health["fingerprint_parts"]


def test_body_over_the_limit_is_refused_while_reading(url):
    big = b'{"messages": [{"content": "' + b"x" * (3 * 1024 * 1024) + b'"}]}'
    _error(httpx.post(f"{url}/v1/score", content=big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit must hold on the bytes as they arrive
        for _ in range(40):
            yield b" " * 100_000

    _error(httpx.post(f"{url}/v1/score", content=chunks()), 413, "request_too_large")
    assert httpx.post(f"{url}/v1/score", json=BODY, timeout=60).status_code == 200


def test_api_key_and_queue_limit(strict_url):
    _error(httpx.post(f"{strict_url}/v1/score", json=BODY), 401, "invalid_api_key")
    _error(
        httpx.get(f"{strict_url}/v1/models", headers={"authorization": "Bearer wrong"}),
        401,
        "invalid_api_key",
    )
    r = httpx.post(f"{strict_url}/v1/score", json=BODY, headers={"authorization": "Bearer sekret"})
    _error(r, 429, "concurrency_limit")
    assert r.headers["retry-after"] == "1"
    assert httpx.get(f"{strict_url}/health").status_code == 200


def test_openapi_schema(url):
    schema = httpx.get(f"{url}/schema/openapi.json").json()
    paths = {
        "/v1/score",
        "/v1/chat/completions",
        "/decide",
        "/decide/shared",
        "/v1/models",
        "/health",
        "/metrics",
    }
    assert paths <= set(schema["paths"])
    decision = schema["components"]["schemas"]["DecisionResult"]["properties"]
    assert {"option_ids", "probabilities", "option_logits", "prompt_sha256", "combined", "calibrated"} <= set(
        decision
    )


DECISION = {
    "id": "d",
    "state": {"ticket": 7, "body": "My card was charged twice for one order."},
    "question": "Which team should handle this?",
    "options": [
        {"id": "billing", "description": "Billing"},
        {"id": "shipping", "description": "Shipping"},
        {"id": "tech", "description": "Technical support"},
    ],
    "orderings": "rotations",
    "workload": "support",
}


def test_decisions_over_http(url, engine):
    """/decide answers what the library answers; /decide/shared the same bits per decision; the workloads
    loaded are listed in /health."""
    r = httpx.post(f"{url}/decide", json=DECISION, timeout=120)
    assert r.status_code == 200, r.text
    alone = r.json()
    library = Decider(engine, calibration=Calibration({"support": Workload(2.0)})).decide(DECISION)
    for field in ("probabilities", "option_logits", "prompt_sha256", "orderings", "combined", "calibrated"):
        assert alone[field] == library[field], field
    assert alone["model"]["name"] == MODEL and alone["system_fingerprint"].startswith("fp_")
    other = {"id": "e", "question": "Is the customer angry?", "options": [{"id": "y", "description": "Yes"},
             {"id": "n", "description": "No"}]}  # fmt: skip
    decisions = [other, {k: v for k, v in DECISION.items() if k != "state"}]
    r = httpx.post(
        f"{url}/decide/shared", json={"state": DECISION["state"], "decisions": decisions}, timeout=120
    )
    assert r.status_code == 200, r.text
    shared = r.json()
    assert shared["object"] == "decision.list" and [d["id"] for d in shared["results"]] == ["e", "d"]
    assert shared["results"][1] == alone
    assert httpx.get(f"{url}/health").json()["workloads"] == {"support": 2.0, "spam": 1.5}


def test_decision_errors_in_the_envelope(url):
    cases = [
        ({**DECISION, "options": DECISION["options"][:1]}, "option_count", "options"),
        ({**DECISION, "workload": "elsewhere"}, "unknown_workload", "workload"),
        ({**DECISION, "state": ""}, "empty_state", "state"),
        (
            {**DECISION, "orderings": "all", "options": DECISION["options"] * 2},
            "duplicate_option_id",
            "options[3].id",
        ),
        ({**DECISION, "state": None}, "invalid_request", "state"),
    ]
    for body, code, param in cases:
        _error(httpx.post(f"{url}/decide", json=body, timeout=60), 400, code, param)
    asked = {k: v for k, v in DECISION.items() if k != "state"}
    shared = {"state": "x", "decisions": [{**asked, "id": "a"}, {**asked, "id": "b", "orderings": "all",
              "options": [{"id": str(j), "description": str(j)} for j in range(5)]}]}  # fmt: skip
    _error(httpx.post(f"{url}/decide/shared", json=shared, timeout=60), 400, "too_many_orderings",
           "decisions[1].orderings")  # fmt: skip
    assert httpx.post(f"{url}/decide", json=DECISION, timeout=60).status_code == 200


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(
    ["messages", "inputs", "scoring", "model", "packs", "queries", "empty_floor", "state", "decisions", "x"]
)


@settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/score", "/v1/chat/completions", "/decide", "/decide/shared"]),
    body=st.one_of(json_values, st.dictionaries(keys, json_values, max_size=4), st.binary(max_size=50)),
)
def test_malformed_bodies_get_a_4xx_envelope_and_the_server_lives(url, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}{path}", content=content, timeout=60)
    assert 400 <= r.status_code < 500 or r.status_code == 200, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["code"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_engine_failures_answer_in_the_envelope_and_the_server_keeps_serving(url, engine, monkeypatch):
    def out_of_memory(trees, cuts=None, behind=None):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes")

    monkeypatch.setattr(engine, "launch", out_of_memory)
    r = httpx.post(f"{url}/v1/score", json=BODY, timeout=60)
    _error(r, 503, "out_of_memory")
    assert "retry-after" in r.headers
    monkeypatch.setattr(engine, "launch", lambda trees, cuts=None, behind=None: 1 / 0)
    _error(httpx.post(f"{url}/v1/score", json=BODY, timeout=60), 500, "internal_error")
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/score", json=BODY, timeout=60).status_code == 200


@pytest.mark.slow  # a model of its own (made-up weights at a small shape), compiled for one bucket
def test_random_weights_are_served_at_a_config_shape(tmp_path):
    """`serve --random-weights CONFIG` (for benchmarks): the model's tokenizer over made-up weights at the
    config's shape, scored over HTTP like any model (loading: tests/test_loading.py)."""
    config = json.loads((TINY / "llama" / "config.json").read_text())
    shape = tmp_path / "small-49k.json"
    shape.write_text(json.dumps(config | {"vocab_size": 49_152}))
    settings = Settings(MODEL, "fp32", buckets=(256,), random_weights=shape)
    with TestClient(create_app(settings)) as client:
        health = loaded(client)
        assert (health["status"], health["served_names"]) == ("ok", ["random:small-49k"]), health
        reply = client.post("/v1/score", json=without_extraction() | {"model": "random:small-49k"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["system_fingerprint"] == health["system_fingerprint"]


def test_warm_extraction_is_asked_of_the_engine_at_start(engine, monkeypatch):
    """Settings.warm_extraction (serve's default; `--no-warm-extraction` turns it off) reaches
    Engine.warmup, which test_extraction shows compiles what a small request's slots run; the middle
    buckets compile behind the start either way (test_logs)."""
    asked = []

    def warmup(progress=None, extraction=False, background=False):
        asked.append((extraction, background))

    monkeypatch.setattr(engine, "warmup", warmup)
    for warm in (True, False):
        with TestClient(create_app(Settings(MODEL, warm_extraction=warm, packs={}), engine)) as client:
            assert loaded(client)["status"] == "ok"
    assert asked == [(True, True), (False, True)]


def test_the_row_tile_reaches_the_engine(monkeypatch):
    """Settings.row_tile (`serve --row-tile`) is what the server loads its engine with (Engine.load's
    row_tile, which test_engine shows reaches the model and the fingerprint)."""
    asked = []

    def load(spec, precision=None, progress=None, row_tile=None, **kwargs):
        asked.append((row_tile, kwargs["buckets"].sizes))
        raise RuntimeError("loaded no model")

    monkeypatch.setattr("spinf_jax.server.app.Engine.load", load)
    settings = Settings(MODEL, buckets=(256, 512), row_tile=64, packs={})
    with TestClient(create_app(settings)) as client:
        assert loaded(client)["status"] == "error"
    assert asked == [(64, (256, 512))]


def test_a_profile_traces_the_server_while_it_serves(engine, tmp_path):
    """POST /v1/admin/profile (serve --profile-dir) writes a trace of the running process, behind the key,
    one at a time, while requests are still answered; without the flag it is profiling_off."""
    settings = Settings(MODEL, api_keys=("sekret",), profile_dir=tmp_path, packs={})
    key = {"authorization": "Bearer sekret"}
    with serving(create_app(settings, engine)) as url, ThreadPoolExecutor(1) as pool:
        assert httpx.post(f"{url}/v1/admin/profile", json={"seconds": 0.1}).status_code == 401
        bad = httpx.post(f"{url}/v1/admin/profile", json={"seconds": 0}, headers=key)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "seconds"
        ask = f"{url}/v1/admin/profile"
        first = pool.submit(httpx.post, ask, json={"seconds": 1.5}, headers=key, timeout=120)
        time.sleep(0.3)
        second = httpx.post(f"{url}/v1/admin/profile", json={"seconds": 0.1}, headers=key)
        assert second.status_code == 409 and second.json()["error"]["code"] == "profile_running"
        yes_no = {"id": "q", "template": "\n\nAnswer:{?}", "options": [" yes", " no"]}
        asked = {"messages": [{"role": "user", "content": "Hello"}], "scoring": {"queries": [yes_no]}}
        assert httpx.post(f"{url}/v1/score", json=asked, headers=key, timeout=120).status_code == 200
        answer = first.result()
        assert answer.status_code == 200, answer.text
        trace = Path(answer.json()["trace_dir"])
        assert trace.parent == tmp_path and answer.json()["seconds"] >= 1.5
        # the hold waits for the pass on the device (the score request's, here): it may outlast the trace
        assert answer.json()["held_seconds"] >= 0
        assert list(trace.glob("plugins/profile/*/*.trace.json.gz")) and list(
            trace.glob("plugins/profile/*/*.xplane.pb")
        )
    with TestClient(create_app(Settings(MODEL, packs={}), engine)) as client:
        loaded(client)  # not left loading when the test ends
        off = client.post("/v1/admin/profile", json={})
        assert off.status_code == 404 and off.json()["error"]["code"] == "profiling_off"
