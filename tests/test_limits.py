"""Every limit /health reports, at its edge with its served value: at the limit the request is accepted,
one past it is refused with the limit's own code and the field that broke it. And the documented content
limit is served on this backend's default buckets."""

import dataclasses

import pytest
from litestar.testing import TestClient

from spinf_jax.api import ScoreRequest
from spinf_jax.compiler import AUDIO_LIMITS, IMAGE_LIMITS, VIDEO_LIMITS, Limits, compile_request
from spinf_jax.decoding import convert
from spinf_jax.engine import Engine
from spinf_jax.errors import ScoringError
from spinf_jax.packer import Buckets, default_sizes
from spinf_jax.scoring import Scorer
from spinf_jax.server.app import MAX_BODY, Settings, create_app
from tests.serving import loaded

LIMITS = Limits()
YES_NO = {"id": "q", "template": "\n\nAnswer:{?}", "options": [" yes", " no"]}
Q0 = "scoring.queries[0]"


def _body(*queries, text="Hi.", **top) -> dict:
    return {"messages": [{"content": text}], "scoring": {"queries": list(queries) or [YES_NO]}, **top}


def _text_of(tokenizer, n: int) -> str:
    """A text of exactly n tokens."""
    ids = tokenizer.encode(" ".join(f"w{i}" for i in range(n)))[:n]
    text = tokenizer.decode(ids)
    assert len(tokenizer.encode(text)) == n
    return text


def _compiles(tokenizer, body) -> ScoringError | None:
    try:
        compile_request(convert(body, ScoreRequest), tokenizer, LIMITS)
    except ScoringError as e:
        return e
    return None


def _template_of(tokenizer, n: int) -> str:
    """A template whose text before the slot is exactly n tokens."""
    text = _text_of(tokenizer, n - 1) + ":"
    assert len(tokenizer.encode(text)) == n
    return text + "{?}"


def _edges(tok) -> dict:
    """limit name → (body at the limit, body one past it, code, param) for the compile-time limits."""
    lim = LIMITS
    five = " a b c d e"
    assert len(tok.encode(five)) == lim.max_option_tokens
    # 10 queries of 1,000 combinations: 10,000 questions (a query has at most 1,000 combinations)
    grid = [
        {"id": f"g{k}", "template": "{x}:{?}", "options": [" yes", " no"], "combinations": "all",
         "values": {"x": [str(i) for i in range(1000)]}}
        for k in range(10)
    ]  # fmt: skip
    names = "abcdef"
    return {
        "max_content_tokens": (
            _body(text=_text_of(tok, lim.max_content_tokens)),
            _body(text=_text_of(tok, lim.max_content_tokens + 1)),
            "content_too_long",
            "messages",
        ),
        "max_questions_per_content": (
            _body(*grid),
            _body(*grid, YES_NO),
            "too_many_questions",
            "scoring.queries",
        ),
        "max_template_tokens": (
            _body(YES_NO | {"template": _template_of(tok, lim.max_template_tokens)}),
            _body(YES_NO | {"template": _template_of(tok, lim.max_template_tokens + 1)}),
            "template_too_long",
            Q0 + ".template",
        ),
        "max_options": (
            _body(YES_NO | {"options": [f" o{i}" for i in range(lim.max_options)]}),
            _body(YES_NO | {"options": [f" o{i}" for i in range(lim.max_options + 1)]}),
            "too_many_options",
            Q0 + ".options",
        ),
        "max_option_tokens": (
            _body(YES_NO | {"options": [" yes", five]}),
            _body(YES_NO | {"options": [" yes", five + " f"]}),
            "option_too_long",
            Q0 + ".options[1]",
        ),
        "max_combinations": (
            _body(YES_NO | {"template": "{x}:{?}", "combinations": [{"x": str(i)} for i in range(1000)]}),
            _body(YES_NO | {"template": "{x}:{?}", "combinations": [{"x": str(i)} for i in range(1001)]}),
            "too_many_combinations",
            Q0 + ".combinations",
        ),
        "max_placeholders": (
            _body(YES_NO | {"template": "".join(f"{{{n}}}" for n in names[:5]) + ":{?}",
                            "combinations": [dict.fromkeys(names[:5], "1")]}),
            _body(YES_NO | {"template": "".join(f"{{{n}}}" for n in names[:6]) + ":{?}",
                            "combinations": [dict.fromkeys(names[:6], "1")]}),
            "invalid_template",
            Q0 + ".template",
        ),
        "max_inputs": (
            {"inputs": [{"messages": [{"content": "Hi."}]}] * lim.max_inputs,
             "scoring": {"queries": [YES_NO]}},
            {"inputs": [{"messages": [{"content": "Hi."}]}] * (lim.max_inputs + 1),
             "scoring": {"queries": [YES_NO]}},
            "too_many_inputs",
            "inputs",
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def client(gemma_engine):
    app = create_app(Settings("spinf/gemma-3-270m"), gemma_engine)
    with TestClient(app) as client:
        assert loaded(client)["status"] == "ok"
        yield client


def test_every_reported_limit_is_tested_at_its_edge(client, gemma_engine):
    reported = client.get("/health").json()["limits"]
    assert reported == {**LIMITS.reported(), "max_body_bytes": MAX_BODY}
    tested = {*_edges(gemma_engine.model.tokenizer), "max_request_tokens", "max_body_bytes"}
    assert set(reported) == tested


# The image and audio limits are tested at their edges on models that read them (tests/test_media.py,
# tests/test_audio.py).
MEDIA_LIMITS = (*IMAGE_LIMITS, *AUDIO_LIMITS, *VIDEO_LIMITS)
COMPILE_TIME = [
    f.name for f in dataclasses.fields(Limits) if f.name not in ("max_request_tokens", *MEDIA_LIMITS)
]


@pytest.mark.parametrize("limit", COMPILE_TIME)
def test_compile_time_limit_edges(gemma_engine, limit):
    at, past, code, param = _edges(gemma_engine.model.tokenizer)[limit]
    assert _compiles(gemma_engine.model.tokenizer, at) is None
    error = _compiles(gemma_engine.model.tokenizer, past)
    assert error is not None and (error.code, error.param) == (code, param), error


def test_request_token_edge(gemma_engine):
    """2,000,000 processed tokens: 4,000 contents whose trees are 500 tokens each (no floors)."""
    tok, limit = gemma_engine.model.tokenizer, LIMITS.max_request_tokens
    scorer = Scorer(gemma_engine)

    def request(content_tokens: int, copies: int, extra: int = 0) -> dict:
        item = {"messages": [{"content": _text_of(tok, content_tokens)}]}
        items = [item] * copies + [{"messages": [{"content": _text_of(tok, content_tokens + extra)}]}]
        return {"inputs": items, "scoring": {"queries": [YES_NO], "empty_floor": False}}

    [tree] = scorer.plan(request(10, 0)).trees
    per_tree, content = 500, 500 - (len(tree) - 10)
    copies = limit // per_tree - 1
    plan = scorer.plan(request(content, copies))
    assert sum(len(t) for t in plan.trees) == limit
    with pytest.raises(ScoringError) as e:
        scorer.plan(request(content, copies, extra=1))
    assert (e.value.code, e.value.param) == ("too_many_tokens", None)


def test_body_size_edge(client):
    body = (
        b'{"messages": [{"content": "Hi."}], "scoring": {"queries": [{"id": "q", "template": "A:{?}", '
        b'"options": [" yes", " no"]}]}}'
    )
    padded = body + b" " * (MAX_BODY - len(body))  # whitespace is JSON too
    assert client.post("/v1/score", content=padded).status_code == 200
    response = client.post("/v1/score", content=padded + b" ")
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.slow  # one pass of the largest default bucket (6,144 rows on the CPU, fp32)
def test_the_content_limit_is_served_on_the_default_buckets(gemma_engine):
    """A content at the limit is scored in this backend's largest default bucket; one token more is refused
    before any pass."""
    engine = Engine(gemma_engine.model, Buckets(default_sizes()[-1:]))
    text = _text_of(engine.model.tokenizer, LIMITS.max_content_tokens)
    body = _body(text=text) | {"scoring": {"queries": [YES_NO], "empty_floor": False}}
    [result] = engine.score(body)["results"]
    assert result["queries"][0]["combinations"][0]["residual"] < 1
    with pytest.raises(ScoringError) as e:
        engine.score(_body(text=_text_of(engine.model.tokenizer, LIMITS.max_content_tokens + 1)))
    assert (e.value.code, e.value.param) == ("content_too_long", "messages")


def test_a_refusal_quotes_an_excerpt_of_the_input_not_all_of_it(gemma_engine):
    """A 1 MB option over the token limit: the message names it by an excerpt and its length."""
    huge = " word" * 200_000
    with pytest.raises(ScoringError) as e:
        Scorer(gemma_engine).plan(_body(YES_NO | {"options": [" yes", huge]}))
    assert e.value.code == "option_too_long" and len(e.value.message) < 300
    assert "(1,000,000 characters)" in e.value.message
    assert len(ScoringError("invalid_request", "x" * 5_000).message) < 1_100  # and any message is cut


def test_the_floor_cache_is_bounded_in_bytes(gemma_engine):
    """The floors of recent questions are held to a byte budget, least recently used dropped first; a
    question whose floor alone is over the budget is not kept."""
    import numpy as np

    from spinf_jax.layout import QuestionKey

    engine = Engine(gemma_engine.model, gemma_engine.buckets, floor_cache_bytes=40_000)

    def key(i: int, tokens: int = 200) -> QuestionKey:
        return QuestionKey(tuple(range(1000 + i, 1000 + i + tokens)), ((300,), (301,)))

    for i in range(20):
        engine.remember_floor(key(i), np.zeros(2))
        assert engine.floor_cache_held <= 40_000
    kept = engine.cached_floors([key(i) for i in range(20)])
    assert 0 < len(kept) < 20 and key(19) in kept and key(0) not in kept
    engine.remember_floor(key(99, tokens=2_000), np.zeros(2))  # ~72 KB: over the whole budget
    assert key(99, tokens=2_000) not in engine.cached_floors([key(99, tokens=2_000)])
    assert key(19) in engine.cached_floors([key(19)])


def test_an_over_budget_request_is_refused_from_its_shape_before_any_tree_is_built(gemma_engine, monkeypatch):
    """1,001 contents asked a 1,000-combination grid: refused too_many_tokens from the compiled request's
    shape, without building a tree (which took seconds and ~420 MB a request before)."""
    from spinf_jax import scoring

    def no_trees(*args, **kwargs):
        raise AssertionError("a tree was built for a request already over its budget")

    monkeypatch.setattr(scoring, "content_trees", no_trees)
    grid = {"id": "g", "template": "\n\nIs it {tone}?{?}", "options": [" yes", " no"],
            "combinations": "all", "values": {"tone": [f"tone number {i}" for i in range(1000)]}}  # fmt: skip
    body = {"inputs": [{"messages": [{"content": f"Text {i}."}]} for i in range(1001)],
            "scoring": {"queries": [grid]}}  # fmt: skip
    with pytest.raises(ScoringError) as e:
        Scorer(gemma_engine, LIMITS).plan(body)
    assert e.value.code == "too_many_tokens" and "split it" in e.value.message
