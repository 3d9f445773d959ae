"""Error codes are defined once (spinf_jax.errors.CODES), documented (docs/api.md), the only ones raised."""

import ast
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
from litestar.testing import TestClient

from spinf_jax import compiler
from spinf_jax.answers import vocabulary
from spinf_jax.compiler import Limits
from spinf_jax.decisions import Decider, Format
from spinf_jax.errors import CODES, ScoringError
from spinf_jax.runner import Runner
from spinf_jax.scoring import Scorer
from spinf_jax.server import app as app_module
from spinf_jax.server.app import Server, Settings, create_app
from tests import engines, test_audio, test_media
from tests.serving import loaded

REPO = Path(__file__).resolve().parent.parent
# Where a code is the n-th positional argument of a call, and helpers that stand for one code.
CODE_ARGUMENT = {"ScoringError": 0, "ApiError": 0, "_coded": 0}
HELPERS = {
    "_invalid": "invalid_request",
    "_unknown": "unknown_placeholder",
    "_bad_template": "invalid_template",
}


def _raised_codes() -> dict[str, list[str]]:
    """Every code the package's source raises, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "spinf_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            code = HELPERS.get(name)
            at = CODE_ARGUMENT.get(name)
            if at is not None and len(node.args) > at and isinstance(node.args[at], ast.Constant):
                code = node.args[at].value
            if code is not None:
                found.setdefault(code, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_code_raised_is_defined():
    raised = _raised_codes()
    assert len(raised) >= 25, raised  # the scan sees the raise sites
    undefined = {code: where for code, where in raised.items() if code not in CODES}
    assert not undefined


def test_docs_list_exactly_the_defined_codes_with_their_status():
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", (REPO / "docs" / "api.md").read_text(), re.M)
    assert dict((code, int(status)) for code, status in rows) == {c: s for c, (s, _) in CODES.items()}


def test_an_undefined_code_cannot_be_raised():
    with pytest.raises(ValueError, match="not defined"):
        ScoringError("made_up_code", "no such code")
    assert ScoringError("warming_up", "later").status == 503


# ---------------------------------------------------------------------------------------------------------
# Every defined code can be reached: a request (or a server state) that answers with it.

YES_NO = {"id": "q", "template": "\n\nAnswer:{?}", "options": [" yes", " no"]}
MESSAGES = [{"role": "user", "content": "Hello there."}]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _body(*queries, **top) -> dict:
    return {"messages": MESSAGES, "scoring": {"queries": list(queries) or [YES_NO]}, **top}


def _inputs(*items) -> dict:
    return {"inputs": list(items), "scoring": {"queries": [YES_NO]}}


# code → (request body, limits that make it reachable with a small body)
REQUESTS = {
    "invalid_request": ({"messages": [], "scoring": {"queries": [YES_NO]}}, {}),
    "invalid_template": (_body(YES_NO | {"template": "no slot"}), {}),
    "unknown_placeholder": (_body(YES_NO | {"template": "Is it {x}?{?}"}), {}),
    "too_many_combinations": (
        _body(YES_NO | {"template": "{x}?{?}", "combinations": [{"x": "a"}, {"x": "b"}]}),
        {"max_combinations": 1},
    ),
    "invalid_option": (_body(YES_NO | {"options": [" yes", ""]}), {}),
    "too_many_options": (_body(), {"max_options": 1}),
    "duplicate_option": (_body(YES_NO | {"options": [" yes", " YES"]}), {}),
    "option_too_long": (_body(YES_NO | {"options": [" yes", " no thank you"]}), {"max_option_tokens": 2}),
    "option_boundary": (_body(YES_NO | {"template": "\n\nThe cat{?}", "options": [" dog", "s"]}), {}),
    "template_too_long": (_body(), {"max_template_tokens": 1}),
    "unsupported_content": (
        {
            "messages": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "scoring": {"queries": [YES_NO]},
        },
        {},
    ),
    "content_too_long": (_body(), {"max_content_tokens": 1}),
    # gemma_engine's largest bucket is 1,024 tokens: a content within the limit that, with its question,
    # fills more than that.
    "question_too_large": ({**_body(), "messages": [{"content": "word " * 1100}]}, {}),
    "too_many_questions": (_body(YES_NO, YES_NO | {"id": "r"}), {"max_questions_per_content": 1}),
    "too_many_inputs": (_inputs({"messages": MESSAGES}, {"messages": MESSAGES}), {"max_inputs": 1}),
    "unknown_query": (_inputs({"messages": MESSAGES, "query_ids": ["nope"]}), {}),
    "too_many_tokens": (_body(), {"max_request_tokens": 5}),
    "unknown_pack": (_body(packs=[{"id": "nobody/missing"}]), {}),
    "too_many_slots": (_body({"id": "m", "template": 'A: "{*}" or {?}'}), {}),
    "unknown_slot": (_body({"id": "m", "template": "A:{#}"}), {}),
    "closing_too_long": (_body({"id": "m", "template": "A:{*}" + " word" * 17}), {}),
    "out_of_range": (_body({"id": "m", "template": "A:{*}", "max_answers": 9}), {}),
}


URGENT = {
    "id": "u",
    "question": "Urgent?",
    "options": [{"id": "y", "description": "Yes"}, {"id": "n", "description": "No"}],
}
DECISIONS = {
    "option_count": {"state": "x", **URGENT, "options": URGENT["options"][:1]},
    "duplicate_option_id": {"state": "x", **URGENT, "options": URGENT["options"] * 2},
    "empty_state": {"state": "", **URGENT},
    "too_many_orderings": {"state": "x", **URGENT, "orderings": "all",
                           "options": [{"id": str(j), "description": str(j)} for j in range(5)]},
    "unknown_workload": {"state": "x", **URGENT, "workload": "w"},
}  # fmt: skip


@pytest.mark.parametrize("code", list(DECISIONS))
def test_decision_codes_are_reachable(gemma_engine, code):
    with pytest.raises(ScoringError) as e:
        Decider(gemma_engine).decide(DECISIONS[code])
    assert e.value.code == code, e.value.message


@pytest.mark.parametrize("code", list(REQUESTS))
def test_request_codes_are_reachable(gemma_engine, code):
    body, limits = REQUESTS[code]
    with pytest.raises(ScoringError) as e:
        Scorer(gemma_engine, Limits(**limits)).plan(body)
    assert e.value.code == code, e.value.message
    assert e.value.status == CODES[code][0]


@pytest.fixture(scope="module")
def client(gemma_engine):
    app = create_app(Settings("spinf/gemma-3-270m", api_keys=("sekret",), max_queue=1), gemma_engine)
    with TestClient(app) as client:
        client.headers["authorization"] = "Bearer sekret"
        assert loaded(client)["status"] == "ok"
        yield client


def _failing_plan(message: str):
    def plan(body):
        raise RuntimeError(message)

    return plan


def test_server_codes_are_reachable(client, monkeypatch, tmp_path):
    def code_of(response, status):
        assert response.status_code == status, response.text
        return response.json()["error"]["code"]

    reached = {
        code_of(client.post("/v1/score", content=b"{nope"), 400),
        code_of(client.post("/v1/chat/completions", json={"messages": MESSAGES}), 400),
        code_of(client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True}), 400),
        code_of(client.post("/v1/score", json=_body(), headers={"authorization": "Bearer wrong"}), 401),
        code_of(client.post("/v1/score", json=_body(model="other")), 404),
        code_of(client.get("/v1/nothing"), 404),
        code_of(client.get("/v1/score"), 405),
        code_of(client.post("/v1/score", content=b" " * (3 * 1024 * 1024)), 413),
    }
    nowhere = client.post("/v1/scores", json=_body())  # a typo'd route says where the routes are
    assert "no route POST /v1/scores" in nowhere.json()["error"]["message"] and "/schema" in nowhere.text
    server = client.app.state.server
    reached.add(code_of(client.post("/v1/admin/profile", json={}), 404))  # no --profile-dir
    monkeypatch.setattr(server, "settings", replace(server.settings, profile_dir=tmp_path))
    with server.profiling:  # a profile being taken
        reached.add(code_of(client.post("/v1/admin/profile", json={}), 409))
    monkeypatch.setattr(server.runner, "max_queue", 0)
    reached.add(code_of(client.post("/v1/score", json=_body()), 429))
    monkeypatch.setattr(server.runner, "max_queue", 1)
    monkeypatch.setattr(server.service.scorer, "plan", _failing_plan("RESOURCE_EXHAUSTED: out of memory"))
    reached.add(code_of(client.post("/v1/score", json=_body()), 503))
    monkeypatch.setattr(server.service.scorer, "plan", _failing_plan("a bug"))
    reached.add(code_of(client.post("/v1/score", json=_body()), 500))
    assert client.post("/v1/score", json=_body()).status_code == 500  # still up, still answering
    monkeypatch.undo()
    # A request past its deadline (test_backpressure serves one over a server of its own).
    monkeypatch.setattr(server, "settings", replace(server.settings, request_deadline_s=1e-6))
    reached.add(code_of(client.post("/v1/score", json=_body()), 504))
    monkeypatch.undo()
    deadline = time.monotonic() + 60  # the expired request leaves the queue (max_queue 1) as it is gathered
    while server.runner.depth and time.monotonic() < deadline:
        time.sleep(0.05)
    # No body arrives in no time (a body that really stops halfway: test_backpressure).
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0)
    reached.add(code_of(client.post("/v1/score", json=_body()), 408))
    monkeypatch.undo()
    stopped = Runner(server.engine)
    stopped.close()
    with pytest.raises(ScoringError) as e:
        stopped.submit(None, server.service.scorer.finish)
    reached.add(e.value.code)

    loading = Server(Settings("spinf/gemma-3-270m"))
    with pytest.raises(ScoringError) as e:
        loading.require_ready()
    reached.add(e.value.code)
    loading.failure = "FileNotFoundError: no model"
    with pytest.raises(ScoringError) as e:
        loading.require_ready()
    reached.add(e.value.code)

    # A {n} slot on a model whose tokenizer spells no digits (ours all do: pretend one does not).
    no_digits = replace(vocabulary(server.engine.model.tokenizer), digits=frozenset())
    monkeypatch.setattr(compiler, "vocabulary", lambda tokenizer: no_digits)
    with pytest.raises(ScoringError) as e:
        Scorer(server.engine).plan(_body({"id": "n", "template": "A:{n}"}))
    reached.add(e.value.code)

    # System One's `box` question, and a prompt contract there is not (tests/test_decision_apis.py serves
    # their other refusals).
    for extra in [{"questions": {"where": {"type": "box"}}}, {"x_contract": "typed-v0"}]:
        with pytest.raises(ScoringError) as e:
            noul = {"n": {"type": "noul", "instructions": "?"}}
            server.service.apis.systemone({"state": "x", "questions": noul} | extra)
        reached.add(e.value.code)

    # A chat template that rewrites the user's message: the state cannot be found in the prompt.
    monkeypatch.setattr(
        server.engine.model.tokenizer, "chat_template", "{{ messages[1]['content'] | upper }}"
    )
    with pytest.raises(ScoringError) as e:
        Format(server.engine.model.tokenizer)
    reached.add(e.value.code)

    # Images, on a model that reads them (tests/test_media.py serves these too).
    scorer = Scorer(engines.engine("gemma3-vision"), packs={})
    parts = {
        "invalid_media": [_image("data:image/png;base64,AAAA")],  # three zero bytes: no image
        "unsupported_media": [_image("data:audio/wav;base64,AAAA")],
        "too_many_images": [_image("data:image/png;base64,AAAA")] * 17,
        "remote_media_disabled": [_image("https://example.com/cat.png")],
    }
    remote = Scorer(scorer.engine, Limits(allow_remote_media=True, remote_media_timeout_s=2.0), {})
    for code, content in [*parts.items(), ("media_unreachable", [_image("https://127.0.0.1:1/cat.png")])]:
        with pytest.raises(ScoringError) as e:
            body = {"messages": [{"content": content}], "scoring": {"queries": [test_media.QUERY]}}
            (remote if code == "media_unreachable" else scorer).plan(body)
        assert e.value.code == code
        reached.add(e.value.code)

    # A video's frames, on a model that reads them (tests/test_media.py).
    with pytest.raises(ScoringError) as e:
        frames = {"frames": ["data:image/png;base64,AAAA"] * 33}
        body = {"messages": [{"content": [{"type": "video_url", "video_url": frames}]}]}
        Scorer(engines.engine("gemma4-vision"), packs={}).plan(
            {**body, "scoring": {"queries": [test_media.QUERY]}}
        )
    reached.add(e.value.code)

    # Audio, on a model that hears (tests/test_audio.py serves its other codes).
    clip = test_audio.audio_part("tone.wav")
    with pytest.raises(ScoringError) as e:
        body = {"messages": [{"content": [clip, clip]}], "scoring": {"queries": [test_media.QUERY]}}
        Scorer(engines.engine("gemma4-audio"), Limits(max_audio_seconds_per_content=0.5), {}).plan(body)
    reached.add(e.value.code)

    unreached = set(CODES) - set(REQUESTS) - set(DECISIONS) - reached
    assert not unreached
    assert reached <= set(CODES)
