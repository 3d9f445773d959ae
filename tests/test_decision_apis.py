"""The decision APIs of the field: System One (/v1/systemone, its batch form) and OpenAI's Decisions API
(/v1/decisions), through the library, over HTTP, through the official SDKs, and against the conformance
suite jevcompat; every answer bit-identical whatever else is asked, under whatever id, in whatever order,
alone or in a batch."""

import asyncio
import base64
import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import typesafe_sdk
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from spinf_jax import openai_decisions, systemone
from spinf_jax.calibration import CalibrationError, apply_temperature, load_calibration
from spinf_jax.client import ApiError, AsyncClient, Client
from spinf_jax.decision_apis import DecisionApis
from spinf_jax.decoding import convert
from spinf_jax.errors import ScoringError
from spinf_jax.models.layers import TreeBatch
from spinf_jax.server.app import Settings, create_app
from tests import engines
from tests.serving import serving
from tests.test_layout import FAMILIES
from tests.typed_pool import POOL, SHORT

STATE = (
    "Hi, I was charged twice for my March invoice (order #4471) and the refund I was promised last week "
    "still hasn't arrived. Please fix this today or I will dispute the charge with my bank."
)
REFUND = {"type": "noul", "instructions": "Is the customer asking for money back?"}
TEAM = {
    "type": "choice",
    "instructions": "Which team should handle this ticket?",
    "criteria": {
        "Billing": "Payments, invoices, refunds",
        "Technical": None,
        "판매 🙂": {"covers": ["pricing"]},
    },
}
ANGER = {
    "type": "score",
    "instructions": "How frustrated is the customer?",
    "criteria": ["Calm", "Upset", ["Very", "angry"]],
}
URGENT = {"type": "noul", "criteria": {"true": "The customer needs an answer today"}}
# A pass on the CPU can take seconds while the other worker compiles: no client here gives up on it.
HTTP = httpx.Client(timeout=300)
QUESTIONS = {"refund": REFUND, "team": TEAM, "anger": ANGER, "urgent": URGENT}


@pytest.fixture(scope="module")
def apis(gemma_engine):
    return DecisionApis(gemma_engine)


def _values(answer: dict) -> list:
    """An answer's numbers, as they were sent: compared with ==, bit for bit."""
    return [answer.get(k) for k in ("noul", "choice", "probabilities", "score", "confidence", "x_residual")]


def test_every_type_is_answered_as_system_one_defines_it(apis):
    reply = apis.systemone({"model": "jev-latest", "state": STATE, "questions": QUESTIONS})
    assert reply["model"] == "spinf/gemma-3-270m"
    assert list(reply["answers"]) == list(QUESTIONS)
    usage = reply["usage"]
    assert (
        isinstance(usage["input_tokens"], int) and usage["input_tokens"] > 60 and usage["output_tokens"] == 0
    )
    a = reply["answers"]
    assert a["refund"]["type"] == "noul" and 0 <= a["refund"]["noul"] <= 1 and "confidence" not in a["refund"]
    team = a["team"]
    assert list(team["probabilities"]) == list(TEAM["criteria"])  # names byte for byte, in order
    assert math.isclose(sum(team["probabilities"].values()), 1, abs_tol=1e-9)
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    m, n = max(team["probabilities"].values()), 3
    assert math.isclose(team["confidence"], (m - 1 / n) / (1 - 1 / n), abs_tol=1e-12)
    anger = a["anger"]
    p = [anger["probabilities"][str(i)] for i in range(3)]
    assert anger["legend"] == {"0": "Calm", "1": "Upset", "2": ["Very", "angry"]}
    assert math.isclose(anger["score"], sum(i * x for i, x in enumerate(p)), abs_tol=1e-12)
    k, spread = int(np.argmax(p)), np.mean(np.abs(np.arange(3) - 1))
    expected = max(0.0, 1 - sum(x * abs(i - k) for i, x in enumerate(p)) / spread)
    assert math.isclose(anger["confidence"], expected, abs_tol=1e-12)
    for answer in a.values():
        assert 0 <= answer["x_residual"] <= 1 and len(answer["x_prompt_sha256"]) == 64
    assert reply["x_prompt_version"] == "typed-options-plain-v1"  # Gemma 3 270M is a base model


@pytest.mark.parametrize("contract", [None, "typed-names-v1"])
def test_an_answer_does_not_depend_on_what_else_is_asked(apis, contract):
    """Renamed ids, other questions, another order, alone: each question's answer keeps every bit, under
    either contract."""

    def ask(questions: dict) -> dict:
        return apis.systemone({"state": STATE, "questions": questions, "x_contract": contract})["answers"]

    base = ask(QUESTIONS)
    renamed = {f"q-{i} ✓": q for i, q in enumerate(QUESTIONS.values())}
    language = {"type": "choice", "instructions": "Language?", "criteria": {"English": None, "Other": None}}
    variants = [
        dict(zip(QUESTIONS, ask(renamed).values(), strict=True)),
        ask(dict(reversed(QUESTIONS.items()))),
        ask({"team": TEAM}),
        ask({"other": language, **QUESTIONS}),
    ]
    for variant in variants:
        for qid, answer in variant.items():
            if qid in base:
                assert _values(answer) == _values(base[qid]), qid


def test_a_batch_is_each_state_asked_alone(apis):
    states = [STATE, "The app crashes when I open settings.", {"ticket": 7, "text": "Cancel my plan"}]
    batch = apis.systemone_batch({"states": states, "questions": QUESTIONS})
    alone = [apis.systemone({"state": s, "questions": QUESTIONS}) for s in states]
    assert [r["answers"] for r in batch["results"]] == [r["answers"] for r in alone]
    assert [r["usage"] for r in batch["results"]] == [r["usage"] for r in alone]
    assert batch["total_usage"]["input_tokens"] == sum(r["usage"]["input_tokens"] for r in alone)


def test_orderings_and_a_prompt_the_model_reads_as_written(apis, gemma_engine):
    """With x_orderings every rotation is a branch of the same read: agreement and spread come back; and
    the listed order's labels are what one plain forward of the whole prompt gives them."""
    reply = apis.systemone({"state": STATE, "questions": {"team": TEAM}, "x_orderings": "rotations"})
    team = reply["answers"]["team"]
    assert team["x_agreement"] in (1 / 3, 2 / 3, 1.0) and 0 <= team["x_spread"] <= 1
    plan = apis.plan_systemone(
        convert({"state": STATE, "questions": {"team": TEAM}}, systemone.SystemOneRequest)
    )
    (answer,) = apis.reader.answers(plan.plan, gemma_engine.score_trees(plan.trees))[0]
    form = apis.reader.format
    text, _ = form.render(STATE, TEAM["instructions"], list(answer.question.shown))
    ids = form.tokenizer.encode(text)
    ids = ids if ids[:1] == form.tokenizer.prefix() else form.tokenizer.prefix() + ids
    model = gemma_engine.model
    hidden = model.hidden(TreeBatch.sequence(ids))
    labels = np.asarray(form.label_ids[:3], np.int32)[None, :]
    lp, _ = model.logprobs(hidden[len(ids) - 1 : len(ids)], labels)
    p = np.exp(np.asarray(lp[0], np.float64))
    np.testing.assert_allclose(answer.probabilities, p / p.sum(), atol=2e-4)
    assert answer.option_mass == pytest.approx(p.sum(), abs=2e-4)


def _names_read(engine, text: str, names: list[tuple[int, ...]]) -> np.ndarray:
    """Each name's log-probability after the prompt, from plain forwards of the prompt and the name."""
    tokenizer, model = engine.model.tokenizer, engine.model
    ids = tokenizer.encode(text)
    ids = ids if ids[:1] == tokenizer.prefix() else tokenizer.prefix() + ids
    out = []
    for name in names:
        hidden = model.hidden(TreeBatch.sequence(ids + list(name)))
        rows = hidden[len(ids) - 1 : len(ids) - 1 + len(name)]
        lp, _ = model.logprobs(rows, np.asarray(name, np.int32)[:, None])
        out.append(float(np.sum(np.asarray(lp, np.float64))))
    return np.array(out)


@pytest.mark.parametrize("model", ["gemma", "smollm"])
def test_the_names_contract_reads_each_option_name_as_the_model_would(model, gemma_engine, smollm_engine):
    """typed-names-v1: the options listed by name, each answer the probability of the reply beginning with
    that name (many tokens where it takes many), as plain forwards of the prompt give it; in the chat form
    through the template, in the plain form after "Answer:" and a space."""
    engine = gemma_engine if model == "gemma" else smollm_engine
    apis = DecisionApis(engine)
    body = {"state": STATE, "questions": {"team": TEAM}, "x_contract": "typed-names-v1"}
    reply = apis.systemone(body)
    assert reply["x_prompt_version"] == ("typed-names-plain-v1" if model == "gemma" else "typed-names-v1")
    plan = apis.plan_systemone(convert(body, systemone.SystemOneRequest))
    (answer,) = apis.reader.answers(plan.plan, engine.score_trees(plan.trees))[0]
    form = apis.reader.formats["typed-names-v1"]
    text, _ = form.render(STATE, TEAM["instructions"], list(answer.question.shown), False)
    assert text.count("\n- ") == 3 and "Answer with the option's name, exactly as listed." in text
    names = apis.reader.names.ids(answer.question)
    assert names is not None and any(len(n) > 1 for n in names)  # the Korean name takes several tokens
    p = np.exp(_names_read(engine, text, list(names)))
    np.testing.assert_allclose(answer.probabilities, p / p.sum(), atol=2e-4)
    assert answer.option_mass == pytest.approx(p.sum(), abs=2e-4)
    assert reply["answers"]["team"]["x_prompt_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_names_the_model_cannot_read_apart_are_listed_with_labels(apis):
    """A name with a leading space, a newline, or whose tokens begin another's: that question is listed with
    labels and its label read, under the same contract and the same read of the state."""
    labelled = {
        "type": "choice",
        "instructions": "Which team?",
        "criteria": {" Billing": None, "Technical\nsupport": None},
    }
    body = {"state": STATE, "questions": {"odd": labelled, "team": TEAM}, "x_contract": "typed-names-v1"}
    plan = apis.plan_systemone(convert(body, systemone.SystemOneRequest))
    odd, team = plan.plan.questions_asked
    assert apis.reader.names.ids(odd) is None and apis.reader.names.ids(team) is not None
    form = apis.reader.formats["typed-names-v1"]
    text, _ = form.render(STATE, "Which team?", list(odd.shown))
    assert "A.  Billing" in text and text.endswith("Answer with the option's label.\n\nAnswer:")
    reply = apis.systemone(body)
    assert reply["answers"]["odd"]["x_prompt_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    alone = apis.systemone(body | {"questions": {"team": TEAM}})["answers"]["team"]
    assert _values(reply["answers"]["team"]) == _values(alone)


def test_an_unknown_contract_is_refused_naming_the_ones_there_are(apis):
    with pytest.raises(ScoringError) as e:
        apis.systemone({"state": STATE, "questions": {"team": TEAM}, "x_contract": "typed-v9"})
    assert e.value.code == "unknown_contract" and e.value.param == "x_contract"
    assert "typed-names-v1" in e.value.message and "typed-options-plain-v1" in e.value.message
    decision = {"type": "predicate", "name": "r", "instructions": "Refund?"}
    reply = apis.decisions({"input": STATE, "questions": [decision], "x_contract": "typed-names-plain-v1"})
    assert reply["x_prompt_version"] == "typed-names-plain-v1"


BAD = {
    "box": ({"b": {"type": "box", "instructions": "Where?"}}, "question_type_unsupported"),
    "one option": ({"t": {"type": "choice", "criteria": {"A": None}}}, "option_count"),
    "256 options": (
        {"t": {"type": "choice", "criteria": {str(i): None for i in range(256)}}},
        "option_count",
    ),
    "11 levels": ({"s": {"type": "score", "criteria": [str(i) for i in range(11)]}}, "option_count"),
    "map-form score": ({"s": {"type": "score", "criteria": {"0": "low", "1": "high"}}}, "invalid_request"),
    "null level": ({"s": {"type": "score", "criteria": ["low", None]}}, "invalid_request"),
    "bare noul": ({"n": {"type": "noul"}}, "invalid_request"),
    "no questions": ({}, "invalid_request"),
    "unknown type": ({"n": {"type": "boolean", "instructions": "?"}}, "invalid_request"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_questions_are_refused_naming_the_field(apis, case):
    questions, code = BAD[case]
    with pytest.raises(ScoringError) as e:
        apis.systemone({"state": STATE, "questions": questions})
    assert e.value.code == code and e.value.status == 400, e.value.message


def test_openai_decisions_answer_in_order_with_typed_values(apis):
    body = {
        "model": "gpt-6-luna",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": STATE}]}],
        "questions": [
            {"type": "predicate", "name": "refund", "instructions": REFUND["instructions"]},
            {"type": "choice", "instructions": "Is this about billing?",
             "choices": [{"value": True, "description": "billing"}, {"value": "true"}, {"value": "no"}]},
            {"type": "score", "name": "anger", "instructions": "How angry?",
             "levels": [{"label": "calm"}, {"label": "angry", "description": "threatens action"}]},
        ],
        "x_refusal_below": 0,
    }  # fmt: skip
    reply = apis.decisions(body)
    refund, choice, anger = reply["answers"]
    assert (refund["type"], refund["name"]) == ("predicate", "refund") and 0 <= refund["probability"] <= 1
    assert choice["name"] is None and [p["value"] for p in choice["probabilities"]] == [True, "true", "no"]
    assert choice["choice"] in (True, "true", "no")
    assert [(p["value"], p["label"]) for p in anger["probabilities"]] == [(0, "calm"), (1, "angry")]
    assert reply["usage"]["total_tokens"] == reply["usage"]["input_tokens"] > 0
    # the same question as System One's noul, over the same state: the same bits
    same = apis.systemone({"state": STATE, "questions": {"r": REFUND}})["answers"]["r"]
    assert refund["probability"] == same["noul"]
    refused = apis.decisions({**body, "x_refusal_below": 1})
    assert [a["type"] for a in refused["answers"]] == ["refusal"] * 3
    assert [a["name"] for a in refused["answers"]] == ["refund", None, "anger"]
    twice = {"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}
    with pytest.raises(ScoringError) as e:
        apis.decisions({**body, "questions": [twice]})
    assert e.value.code == "duplicate_option"


# ---------------------------------------------------------------------------------------------------------
# Over HTTP: a server whose largest bucket holds 255 described options (serve's 6,144 rows on the CPU)


@pytest.fixture(scope="module")
def engine_6k():
    return engines.engine("spinf/gemma-3-270m", sizes=(256, 1024, 6144))


@pytest.fixture(scope="module")
def url(engine_6k):
    with serving(create_app(Settings("spinf/gemma-3-270m"), engine_6k)) as url:
        yield url


def _jevcompat(url: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).parent / "jevcompat"
    return subprocess.run(
        [str(tool), "test", url, "--timeout", "300", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


# 100-240 s on the 2-core machine (the suite's semantics cases send each request many times): the full tier
# alone, as the run with a key below runs the same cases and its auth cases too.
@pytest.mark.full
def test_jevcompat_finds_the_server_conformant(url):
    run = _jevcompat(url)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "conformant to spec" in run.stdout and "MUST 32/32" in run.stdout


@pytest.mark.slow
def test_jevcompat_finds_the_server_conformant_with_a_key(engine_6k):
    with serving(create_app(Settings("spinf/gemma-3-270m", api_keys=("s1-key",)), engine_6k)) as keyed:
        run = _jevcompat(keyed, "--key-env", "S1_KEY", env={**os.environ, "S1_KEY": "s1-key"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "conformant to spec" in run.stdout and "MUST 32/32" in run.stdout
    assert "auth.bearer" in run.stdout and "SHOULD 15/15" in run.stdout


def test_the_official_sdk_parses_every_answer_from_a_zstd_body(url):
    """typesafe-sdk compresses bodies of 1 KiB and more with zstd (its `zstd` extra is installed here)."""
    client = typesafe_sdk.TypeSafeClient(base_url=url, api_key="unused", compression="zstd", timeout=300)
    long_state = STATE + " " + "More context about the order. " * 60  # over 1 KiB: sent compressed
    reply = client.system_one(long_state, {"refund": REFUND, "team": TEAM, "anger": ANGER})
    assert reply.model == "spinf/gemma-3-270m" and reply.request_id.startswith("req_")
    assert 0 <= reply.nouls["refund"].noul <= 1
    assert reply.choices["team"].choice in TEAM["criteria"]
    assert reply.answers["anger"].legend[2] == ["Very", "angry"]  # the SDK keys levels by integer
    plain = HTTP.post(f"{url}/v1/systemone", json={"state": long_state, "questions": {"team": TEAM}})
    assert reply.answers["team"].probabilities == plain.json()["answers"]["team"]["probabilities"]
    listed = client.models.list()
    assert [m.name for m in listed.models] == ["spinf/gemma-3-270m"]


def test_the_openai_sdk_parses_every_decision_type(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    decision = client.decisions.create(
        model="gpt-6-luna",
        input=STATE,
        questions=[
            {"type": "predicate", "name": "refund", "instructions": "Is a refund asked for?"},
            {"type": "choice", "instructions": "Team?", "choices": [{"value": "billing"}, {"value": False}]},
            {"type": "score", "instructions": "Anger?", "levels": [{"label": "calm"}, {"label": "angry"}]},
        ],
        extra_body={"x_refusal_below": 0},
    )
    assert [a.type for a in decision.answers] == ["predicate", "choice", "score"]
    assert decision.answers[1].probabilities[1].value is False
    assert decision.usage.total_tokens > 0
    assert [m.id for m in client.models.list().data] == ["spinf/gemma-3-270m"]


def test_errors_come_in_the_shapes_decision_clients_parse(url):
    bad = HTTP.post(f"{url}/v1/systemone", json={"state": STATE, "questions": {"q.1": {"type": "boolean"}}})
    assert bad.status_code == 422 and bad.headers["x-typesafe-request-id"].startswith("req_")
    (item,) = bad.json()["detail"]
    assert item["loc"][:2] == ["body", "questions"] and item["type"] == "invalid_request"
    missing = HTTP.post(f"{url}/v1/decisions", json={"input": "x"})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "questions"]
    unknown = HTTP.post(
        f"{url}/v1/systemone", json={"model": "nope", "state": "x", "questions": {"r": REFUND}}
    )
    assert unknown.status_code == 404 and unknown.json()["detail"]["error_type"] == "not_found_error"
    not_json = HTTP.post(f"{url}/v1/systemone", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["detail"][0]["type"] == "invalid_json"
    ours = HTTP.post(f"{url}/v1/score", json={"messages": []})  # our own routes keep our envelope
    assert ours.status_code == 400 and "error" in ours.json()


def test_compressed_bodies_on_every_route_and_bombs_refused(url):
    body = json.dumps({"state": STATE, "questions": {"r": REFUND}}).encode()
    plain = HTTP.post(f"{url}/v1/systemone", content=body, headers={"content-type": "application/json"})
    for encoding, data in (
        ("gzip", gzip.compress(body)),
        ("zstd", zstandard.ZstdCompressor().compress(body)),
    ):
        reply = HTTP.post(f"{url}/v1/systemone", content=data, headers={"content-encoding": encoding})
        assert reply.status_code == 200 and reply.json()["answers"] == plain.json()["answers"]
    query = {"id": "r", "template": "\n\nRefund?{?}", "options": [" yes", " no"]}
    score = {"messages": [{"role": "user", "content": STATE}], "scoring": {"queries": [query]}}
    zipped = HTTP.post(f"{url}/v1/score", content=gzip.compress(json.dumps(score).encode()),
                        headers={"content-encoding": "gzip"})  # fmt: skip
    assert zipped.status_code == 200, zipped.text
    bomb = zstandard.ZstdCompressor().compress(b" " * 40_000_000)  # 40 MB in about 1 KB
    for path, shape in (("/v1/systemone", "detail"), ("/v1/score", "error")):
        refused = HTTP.post(f"{url}{path}", content=bomb, headers={"content-encoding": "zstd"})
        assert refused.status_code == 413 and shape in refused.json()
    odd = HTTP.post(f"{url}/v1/systemone", content=b"x", headers={"content-encoding": "br"})
    assert odd.status_code == 400 and "zstd" in odd.json()["detail"]["message"]
    assert HTTP.get(f"{url}/health").status_code == 200


def test_our_clients_speak_the_decision_apis(url):
    with Client(url) as client:
        reply = client.systemone({"state": STATE, "questions": {"refund": REFUND}})
        assert isinstance(reply.answers["refund"], systemone.NoulAnswer)
        batch = client.systemone_batch({"states": [STATE], "questions": {"refund": REFUND}})
        assert batch.results[0].answers == reply.answers
        decided = client.decisions(
            {"input": STATE, "questions": [{"type": "predicate", "instructions": "?"}]}
        )
        answer_types = (openai_decisions.PredicateAnswer, openai_decisions.RefusalAnswer)
        assert isinstance(decided.answers[0], answer_types)
        with pytest.raises(ApiError) as e:
            client.systemone(
                {"state": STATE, "questions": {"t": {"type": "choice", "criteria": {"A": None}}}}
            )
        assert (e.value.status, e.value.code, e.value.param) == (422, "option_count", "questions.t.criteria")

    async def both():
        async with AsyncClient(url) as client:
            return await client.systemone({"state": STATE, "questions": {"refund": REFUND}})

    assert asyncio.run(both()).answers == reply.answers


# ---------------------------------------------------------------------------------------------------------
# Every family (the tiny fixtures, reading text byte by byte): the recurrent-state fork of Qwen3.5 included


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    apis = DecisionApis(engines.with_bytes(request.param))
    return apis, apis.systemone({"state": SHORT, "questions": POOL})["answers"]


@pytest.mark.slow  # 80 s for the eight families on the 2-core machine (compiles, mostly)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_family_answers_the_same_bits_whatever_else_is_asked(family, data):
    """Any subset of the questions, in any order, under any ids, alone or second in a batch: each answer
    keeps the bits it has when the whole pool is asked."""
    apis, base = family
    picked = data.draw(st.lists(st.sampled_from(list(POOL)), min_size=1, max_size=4, unique=True))
    ids = data.draw(
        st.lists(st.text(min_size=1, max_size=4), min_size=len(picked), max_size=len(picked), unique=True)
    )
    asked = {qid: POOL[q] for qid, q in zip(ids, picked, strict=True)}
    if data.draw(st.booleans(), label="in a batch"):
        reply = apis.systemone_batch({"states": ["Other text.", SHORT], "questions": asked})["results"][1]
    else:
        reply = apis.systemone({"state": SHORT, "questions": asked})
    for qid, q in zip(ids, picked, strict=True):
        assert _values(reply["answers"][qid]) == _values(base[q]), q


def test_the_prior_taken_out_over_the_floor(apis):
    """x_prior: each answer over the same question on an empty state, renormalised; the floor is the same
    bits whatever the state, and the listed reading keeps the bits of a plain request."""
    plain = apis.systemone({"state": STATE, "questions": QUESTIONS})["answers"]
    other = "The app crashes when I open settings."
    replies = [apis.systemone({"state": s, "questions": QUESTIONS, "x_prior": True}) for s in (STATE, other)]
    lifted, lifted_other = (r["answers"] for r in replies)
    for qid, answer in lifted.items():
        read = plain[qid].get("probabilities") or {"true": plain[qid]["noul"]}
        assert {k: answer["x_listed"][k] for k in read} == read
        assert answer["x_floor"] == lifted_other[qid]["x_floor"]
        listed, floor = (
            np.array(list(answer["x_listed"].values())),
            np.array(list(answer["x_floor"].values())),
        )
        expected = listed / floor / np.sum(listed / floor)
        got = answer["probabilities"] if "probabilities" in answer else {"true": answer["noul"]}
        np.testing.assert_allclose(list(got.values()), expected[: len(got)], rtol=1e-9)
    # the floor is read once a request, and counted
    alone = apis.systemone({"state": STATE, "questions": QUESTIONS})["usage"]["input_tokens"]
    assert replies[0]["usage"]["input_tokens"] > alone


def test_temperatures_by_type_and_by_option_count(gemma_engine, tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"temperature": 2.0, "temperature_by_type": {"choice": 0.5}}))
    by_type = DecisionApis(gemma_engine, calibration=load_calibration(path))
    answers = by_type.systemone({"state": STATE, "questions": QUESTIONS})["answers"]
    assert {qid: a["x_calibrated"]["temperature"] for qid, a in answers.items()} == {
        "refund": 2.0,
        "team": 0.5,
        "anger": 2.0,
        "urgent": 2.0,
    }
    team = answers["team"]
    expected = apply_temperature(np.log(list(team["probabilities"].values())), 0.5)
    np.testing.assert_allclose(list(team["x_calibrated"]["probabilities"].values()), expected, rtol=1e-12)
    assert team["x_calibrated"]["workload"] is None
    path.write_text(json.dumps({"temperature_by_options": {"a": 3.0, "b": -1.0, "min": 0.4}}))
    by_options = DecisionApis(gemma_engine, calibration=load_calibration(path))
    answers = by_options.systemone({"state": STATE, "questions": QUESTIONS})["answers"]
    assert answers["refund"]["x_calibrated"]["temperature"] == pytest.approx(3.0 - math.log(2))
    assert answers["team"]["x_calibrated"]["temperature"] == pytest.approx(3.0 - math.log(3))
    for bad in (
        {"temperature_by_type": {"bool": 1.0}},
        {"temperature": 0},
        {"temperature_by_options": {"a": 1}},
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(CalibrationError):
            load_calibration(path)


def test_a_state_is_bounded_by_the_buckets_not_the_scoring_limit(apis):
    """A state past the scoring API's 4,096 tokens is read where the largest bucket holds it with its
    questions; past that it is refused naming the bucket, never cut."""
    long_state = "The customer wrote again about the same invoice. " * 900  # about 9,000 tokens
    with pytest.raises(ScoringError) as e:
        apis.systemone({"state": long_state, "questions": {"r": REFUND}})
    assert e.value.code == "question_too_large" and "largest bucket is 1024" in e.value.message
    assert e.value.param == "state"


@pytest.mark.slow  # a pass of the 6,144-row program: a minute on the 2-core machine
def test_a_state_past_the_scoring_limit_is_read_where_a_bucket_holds_it(url):
    long_state = "The customer wrote again about the same invoice. " * 460  # about 4,600 tokens
    reply = HTTP.post(
        f"{url}/v1/systemone", json={"state": long_state, "questions": {"r": REFUND}}, timeout=300
    )
    assert reply.status_code == 200, reply.text
    assert 4096 < reply.json()["usage"]["input_tokens"] < 6144


# ---------------------------------------------------------------------------------------------------------
# Images: System One's assets (inline, and as multipart parts through the SDK), OpenAI's input_image parts,
# on the tiny Gemma 3 vision fixture (its text read byte by byte)

MEDIA = Path(__file__).resolve().parent.parent / "fixtures" / "media"
DARK = {"dark": {"type": "noul", "instructions": "Is the picture dark?"}}


def _asset(name: str) -> dict:
    return {
        "type": "image",
        "format": "png",
        "data_base64": base64.b64encode((MEDIA / name).read_bytes()).decode(),
    }


@pytest.fixture(scope="module")
def vision():
    return DecisionApis(engines.with_bytes("gemma3-vision"))


def test_an_image_in_the_state_is_read(vision, apis):
    def ask(name: str, questions=DARK) -> dict:
        body = {"state": {"photo": "<image:1>", "note": "taken at night"}, "questions": questions}
        return vision.systemone(body | {"assets": {"<image:1>": _asset(name)}})

    gradient, grey = ask("gradient.png"), ask("grey.png")
    assert gradient["answers"]["dark"]["noul"] != grey["answers"]["dark"]["noul"]  # the pixels are read
    soft = 16  # the fixture's mm_tokens_per_image
    alone = vision.systemone({"state": {"photo": "", "note": "taken at night"}, "questions": DARK})
    assert gradient["usage"]["input_tokens"] - alone["usage"]["input_tokens"] >= soft
    with_more = ask("gradient.png", {**POOL, **DARK})["answers"]
    assert with_more["dark"] == gradient["answers"]["dark"]  # the same bits whatever else is asked
    # OpenAI's input_image at the same place in the same text: the same prompt, the same bits
    image_url = "data:image/png;base64," + _asset("gradient.png")["data_base64"]
    message = [{"type": "input_text", "text": "Photo:"}, {"type": "input_image", "image_url": image_url}]
    decided = vision.decisions({
        "input": [{"role": "user", "content": message}],
        "questions": [{"type": "predicate", "instructions": DARK["dark"]["instructions"]}],
        "x_refusal_below": 0,
    })  # fmt: skip
    same = vision.systemone(
        {"state": "Photo:\n<i>", "questions": DARK, "assets": {"<i>": _asset("gradient.png")}}
    )
    assert decided["answers"][0]["probability"] == same["answers"]["dark"]["noul"]
    refusals = {
        "invalid_media": {"state": "<i>", "assets": {"<i>": {"type": "image", "data_base64": "not base64!"}}},
        "invalid_request": {"state": "no image here", "assets": {"<i>": _asset("grey.png")}},
    }
    for code, body in refusals.items():
        with pytest.raises(ScoringError) as e:
            vision.systemone(body | {"questions": DARK})
        assert e.value.code == code, e.value.message
    with pytest.raises(ScoringError) as e:  # a model that reads no images
        apis.systemone({"state": "<i>", "questions": DARK, "assets": {"<i>": _asset("grey.png")}})
    assert e.value.code == "unsupported_content"


def test_the_sdk_sends_image_assets_as_multipart_parts(vision):
    with serving(create_app(Settings("vision", packs={}), vision.engine)) as vision_url:
        client = typesafe_sdk.TypeSafeClient(base_url=vision_url, api_key="unused", timeout=300)
        photo = typesafe_sdk.Image((MEDIA / "gradient.png").read_bytes())
        with client.attach_assets(photo):
            reply = client.system_one(f"Photo:\n{photo}", DARK)
    inline = vision.systemone(
        {"state": f"Photo:\n{photo}", "questions": DARK, "assets": {str(photo): _asset("gradient.png")}}
    )
    assert reply.nouls["dark"].noul == inline["answers"]["dark"]["noul"]
