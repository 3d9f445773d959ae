"""Extraction slots (issue 14): answers decoded from the pass's keys and values, the search's rules, and the
same guarantees as scores (bits independent of companions, bucket and order)."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from spinf_jax import engine as engine_module
from spinf_jax.engine import HISTORY_STEPS, Engine
from spinf_jax.extraction import CANDIDATES, SlotSearch
from spinf_jax.layout import SEARCH_WIDTH, Extract, QuestionKey, build_tree
from spinf_jax.loader import default_row_tile
from spinf_jax.packer import Buckets, pack
from tests import engines
from tests.spec_example import SPEC_REQUEST

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
RNG = np.random.default_rng(14)
CONTENTS = [RNG.integers(3, 500, n).tolist() for n in (25, 70, 9)]
TEMPLATES = [RNG.integers(3, 500, n).tolist() for n in (6, 3, 20)]
SEARCH = QuestionKey(tuple(TEMPLATES[0]), extract=Extract(max_answers=8, max_tokens=5))
GENERATE = QuestionKey(tuple(TEMPLATES[1]), extract=Extract(max_tokens=7, generate=True))
CLOSED = QuestionKey(tuple(TEMPLATES[2]), extract=Extract(closing_ids=(11, 12), max_tokens=4))
OPTIONS = QuestionKey(tuple(TEMPLATES[1]), ((5,), (6, 7), (6, 9)))


def _buckets(*multiples: int) -> Buckets:
    """Buckets of these multiples of the smallest this backend allows (row tiles: 256 on the CPU, 2,048 on
    GPUs), so the tests run on both."""
    least = max(256, 2 * default_row_tile())
    return Buckets(tuple(least * m for m in multiples), block=64)


def _engine(family: str, precision: str = "fp32") -> Engine:
    return engines.engine(family, precision, _buckets(1, 2).sizes, 64)


@pytest.fixture(scope="module", params=["gemma3", "qwen3", "gemma4-e2b", "qwen3_5"])
def tiny(request) -> Engine:
    return _engine(request.param)


def test_decoded_answers_score_like_the_same_tokens_as_options(tiny):
    """Decoding reads the pass's keys and values and its own path: the log-prob of every answer equals the
    same tokens scored as an option in a tree pass (the arithmetic differs, the math does not)."""
    [scored] = tiny.score_trees([build_tree([2], CONTENTS[0], [SEARCH, GENERATE])])
    searched, [generated] = scored.answers
    assert len(searched) >= 8 and scored.decode_tokens > 0
    assert [a.logprob for a in searched] == sorted((a.logprob for a in searched), reverse=True)
    assert all(len(a.tokens) == 5 for a in searched)  # no end tokens without a tokenizer: the length bound
    as_options = [QuestionKey(SEARCH.template_ids, tuple(a.tokens for a in searched[:4]))]
    as_options.append(QuestionKey(GENERATE.template_ids, (generated.tokens,)))
    [check] = tiny.score_trees([build_tree([2], CONTENTS[0], as_options)])
    np.testing.assert_allclose(check.option_logprobs(0), [a.logprob for a in searched[:4]], atol=3e-5)
    np.testing.assert_allclose(check.option_logprobs(1), [generated.logprob], atol=3e-5)


@pytest.mark.parametrize(
    "family, precision",
    # bf16 in the full tier (`pytest -m full`): 76 s of CI's time for programs of its own; test_layout
    # checks bf16 invariance on the tiny fixtures in every run.
    [("gemma3", "fp32"), ("qwen3_5", "fp32"), pytest.param("gemma3", "bf16", marks=pytest.mark.full)],
)
def test_answers_bit_identical_whatever_the_companions(family, precision):
    """Alone, with other questions (options, other slots, in other orders), packed after other contents,
    and in another bucket: the same answers, bit for bit. And a {?} question's scores do not change when an
    extraction slot joins it (the pass then runs the program that also returns keys and values, and on
    Qwen3.5 the recurrent states at the slots)."""
    engine = _engine(family, precision)
    # Only the larger of the engine's buckets: a content alone goes in the smaller one (and any bucket's
    # programs, compiled once, are the same for every engine of the model).
    other_bucket = Engine(engine.model, buckets=_buckets(2))

    def answers(e, contents, questions, which):
        """The answers of `question` (in `questions`) for the content at index `which`."""
        trees = [build_tree([2], c, questions) for c in contents]
        slot = [q for q in questions if q.extract].index(question)
        return e.score_trees(trees)[which].answers[slot]

    for question in (SEARCH, GENERATE, CLOSED):
        alone = answers(engine, CONTENTS[:1], [question], 0)
        assert alone
        others = [q for q in (SEARCH, OPTIONS, GENERATE, CLOSED) if q != question]
        assert answers(engine, CONTENTS[:1], [*others, question], 0) == alone
        assert answers(engine, CONTENTS[:1], [question, *others[::-1]], 0) == alone
        assert answers(engine, [*CONTENTS[1:], CONTENTS[0]], [*others, question], 2) == alone
        assert answers(other_bucket, [CONTENTS[0], *CONTENTS[1:]], [GENERATE, question], 0) == alone
    plain = engine.score_trees([build_tree([2], CONTENTS[1], [OPTIONS])])[0].option_logprobs(0)
    mixed = engine.score_trees([build_tree([2], CONTENTS[1], [SEARCH, OPTIONS])])[0].option_logprobs(1)
    assert plain.tobytes() == mixed.tobytes()


def test_a_decode_step_holds_no_more_history_than_its_budget(monkeypatch):
    """A step's history (its rows × HISTORY_STEPS columns × a row's keys and values) stays within
    HISTORY_BYTES: where a width's step sizes would not fit (at Gemma 3 12B's shape a 1,024-row generated
    step's is 54 GiB), its steps take fewer rows, every slot is still answered, in more steps, and a slot's
    answers are the same whatever its companions."""
    engine = _engine("gemma3")
    config = json.loads((TINY / "gemma3" / "config.json").read_text())
    kv = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4  # fp32
    assert engine._history_row_bytes == (kv, 0)
    assert engine.step_sizes(1) == engine.step_sizes(SEARCH_WIDTH) == engine.decode_sizes  # 16, 32, 64
    # 8 generated rows fit, and 24 searched ones: one slot a step of 8 rows, two a step of 16
    monkeypatch.setattr(engine_module, "HISTORY_BYTES", 8 * HISTORY_STEPS[1] * kv)
    assert engine.step_sizes(1) == (8,) and engine.step_sizes(SEARCH_WIDTH) == (16,)
    held = []
    step = engine._step

    def recorded(weights, cache, history, *rest, **options):
        held.append(sum(a.nbytes for a in jax.tree.leaves(history)))
        return step(weights, cache, history, *rest, **options)

    monkeypatch.setattr(engine, "_step", recorded)
    questions = [SEARCH, GENERATE, CLOSED, QuestionKey((9, 8), extract=Extract(max_tokens=3, generate=True))]
    # three searched slots: two groups
    questions.append(QuestionKey((7, 7, 7), extract=Extract(max_answers=3, max_tokens=2)))
    together = engine.score_trees([build_tree([2], CONTENTS[0], questions)])[0].answers
    assert all(together) and max(held) <= engine_module.HISTORY_BYTES
    for i, question in enumerate(questions):
        assert engine.score_trees([build_tree([2], CONTENTS[0], [question])])[0].answers[0] == together[i]


def test_warmup_trees_fit_a_recurrent_models_passes():
    """A recurrent model's pass holds at most max_slots slots: each warm-up tree is one pass, and its slots
    still take every decode size, generated slots where they fit beside the searched ones."""
    engine = Engine(engines.model("qwen3_5"), _buckets(2))
    trees = engine._extraction_warmup_trees()
    searched = [sum(not s.extract.generate for s in t.slots) * SEARCH_WIDTH for t in trees]
    generated = [sum(s.extract.generate for s in t.slots) for t in trees]
    assert [engine._rows(rows, SEARCH_WIDTH) for rows in searched] == list(engine.decode_sizes)  # 16, 32, 64
    assert [engine._rows(rows, 1) for rows in generated[:-1]] == list(engine.decode_sizes[:-1])
    # The generated slots that take the largest step are there only where they fit beside the searched ones:
    # on the CPU (steps of 16, 32, 64 rows) 33 of them would not fit beside 5 searched ones in one pass; on
    # GPUs (one 1,024-row step) one does.
    needed = (0, *engine.decode_sizes)[-2] + 1
    fits = searched[-1] // SEARCH_WIDTH + needed <= engine.buckets.max_slots
    assert generated[-1] == (needed if fits else 0)
    assert all(len(pack([t], engine.buckets)) == 1 for t in trees)


# ---------------------------------------------------------------------------------------------------------
# The search's rules, on made-up numbers

ENDS = np.zeros(32, bool)
ENDS[30] = True  # a newline


def _candidates(*pairs):
    """[CANDIDATES] log-probs and tokens from (token, p) pairs, the rest impossible."""
    lp, tok = np.full(CANDIDATES, -np.inf), np.zeros(CANDIDATES, np.int32)
    for i, (token, p) in enumerate(pairs):
        lp[i], tok[i] = math.log(p), token
    return lp, tok


def test_a_multi_token_closing_text_is_forced_and_counted():
    search = SlotSearch(Extract(closing_ids=(7, 8), max_tokens=3), ENDS)
    search.start(*_candidates((5, 0.6), (7, 0.3)), outside=-1.0)
    assert [(h.answer, h.closed) for h in search.live] == [((5,), 0), ((), 1)]
    feeds = search.feeds()
    assert feeds == [(5, (), -1), (7, (), 8)]  # the closing hypothesis has its next token forced
    lp, tok = _candidates((7, 0.5), (6, 0.4))
    search.advance(np.stack([lp, lp]), np.stack([tok, tok]), np.log([0.1, 0.9]), np.zeros(2))
    [(tokens, logprob)] = [(d.tokens, d.logprob) for d in search.finished]
    assert tokens == () and math.isclose(logprob, math.log(0.3 * 0.9))
    assert [(h.answer, h.closed, h.pending) for h in search.live] == [((5,), 1, 7), ((5, 6), 0, 6)]
    assert search.live[0].columns == search.live[1].columns == (0,)


def test_an_answer_at_its_length_bound_must_close_or_ends_there():
    closed = SlotSearch(Extract(closing_ids=(7,), max_tokens=1), ENDS)
    closed.start(*_candidates((5, 0.5)), outside=-1.0)
    assert closed.feeds() == [(5, (), 7)]
    open_ended = SlotSearch(Extract(max_tokens=1), ENDS)
    open_ended.start(*_candidates((5, 0.5), (30, 0.2)), outside=-1.0)
    assert [d.tokens for d in open_ended.finished] == [(5,), ()]
    np.testing.assert_allclose([d.logprob for d in open_ended.finished], np.log([0.5, 0.2]))
    assert open_ended.done


def test_a_number_ends_with_the_mass_that_cannot_continue_it():
    search = SlotSearch(Extract(kind="number", max_tokens=4), ENDS)
    search.start(*_candidates((1, 0.5), (2, 0.25)), outside=math.log(0.25))
    assert search.finished == []  # an empty number is no answer
    lp, tok = _candidates((3, 0.1))
    search.advance(np.stack([lp, lp]), np.stack([tok, tok]), np.zeros(2), np.log([0.8, 0.5]))
    assert [d.tokens for d in search.answers()] == [(1,), (2,)]
    np.testing.assert_allclose([d.logprob for d in search.answers()], np.log([0.5 * 0.8, 0.25 * 0.5]))


def test_the_search_stops_when_no_hypothesis_can_beat_the_answers_it_has():
    search = SlotSearch(Extract(max_answers=1, max_tokens=8), ENDS)
    search.start(*_candidates((30, 0.6), (5, 0.3)), outside=-1.0)
    assert [d.tokens for d in search.finished] == [()] and search.done
    search = SlotSearch(Extract(max_answers=2, max_tokens=8), ENDS)
    search.start(*_candidates((30, 0.6), (5, 0.3)), outside=-1.0)
    assert not search.done


# ---------------------------------------------------------------------------------------------------------
# The default model, from text


def test_readme_example_ranks_answers_on_the_default_model(gemma_engine):
    body = {
        "messages": SPEC_REQUEST["messages"],
        "scoring": {
            "queries": [
                *SPEC_REQUEST["scoring"]["queries"][:2],
                {"id": "month", "template": '\n\nQ: Which month was charged twice?\nA: "{*}"'},
                {"id": "month_generated", "template": '\n\nQ: Which month was charged twice?\nA: "{*}"',
                 "mode": "generate"},
            ]
        },
    }  # fmt: skip
    response = gemma_engine.score(body)
    by_id = {q["id"]: q["combinations"][0] for q in response["results"][0]["queries"]}
    answers = by_id["month"]["answers"]
    assert answers[0]["text"] == "September" and len(answers) == 5
    assert abs(sum(a["p"] for a in answers) - 1) < 1e-9
    assert math.isclose(by_id["month"]["residual"], 1 - sum(math.exp(a["logprob"]) for a in answers))
    # Generated and searched slots decode in groups of other widths (1 and 8 rows), other programs: the same
    # answer, with log-probs equal up to f32 summation order (bit-equal on AMD EPYC, 2e-6 apart on Xeon).
    [generated] = by_id["month_generated"]["answers"]
    assert generated["text"] == answers[0]["text"] and generated["p"] == 1.0
    assert generated["logprob"] == pytest.approx(answers[0]["logprob"], abs=1e-4)
    assert response["usage"]["prompt_tokens_details"]["decode_tokens"] > 0
    # The same slot asked alone: the same bits.
    alone = gemma_engine.score({**body, "scoring": {"queries": [body["scoring"]["queries"][2]]}})
    assert alone["results"][0]["queries"][0]["combinations"][0]["answers"] == answers


def test_numbers_and_amounts_have_values(gemma_engine):
    content = "Invoice 2231 from Northwind Traders.\nTotal due: $1,250.00 by March 3. 14 people will attend."
    body = {
        "messages": [{"role": "user", "content": content}],
        "scoring": {
            "queries": [
                {"id": "total", "template": "\n\nQ: What is the total amount due?\nA:{$}", "max_answers": 3},
                {"id": "people", "template": "\n\nQ: How many people will attend?\nA:{n}", "floor": True},
            ]
        },
    }
    total, people = (q["combinations"][0] for q in gemma_engine.score(body)["results"][0]["queries"])
    assert total["answers"][0] | {"logprob": 0, "p": 0} == {
        "text": "$1,250.00", "value": 1250.0, "currency": "USD", "logprob": 0, "p": 0
    }  # fmt: skip
    assert len(total["answers"]) == 3 and "floor_answers" not in total
    assert people["answers"][0]["value"] == 14.0 and people["answers"][0]["text"] == "14"
    assert all(isinstance(a["value"], float) for a in people["answers"] + people["floor_answers"])


def test_warmup_compiles_every_extraction_program(monkeypatch):
    """`warmup(extraction=True, background=True)` (what `serve` does) compiles what a small request's slots
    run (the smallest bucket's first decode steps), and `warmup(extraction=True)` what extraction runs in
    every bucket: a request with searched and generated slots compiles nothing after the first, nor a large
    one after the second, and a second warmup runs nothing. Two decode sizes here, to keep it short; warmup
    covers each size the same way."""
    engine = Engine(engines.model("gemma3"), _buckets(1, 2, 3))
    engine.decode_sizes = engine.decode_sizes[:2]
    programs = (engine_module._extract_pass, engine_module._first_candidates, engine_module._decode_step)
    monkeypatch.setattr(engine, "_compile_rest", lambda *args: None)  # the middle bucket: not asked here
    engine.warmup(extraction=True, background=True)
    assert engine._warm_extraction == {(engine.buckets.sizes[0], True)}
    compiled = [f._cache_size() for f in programs]
    questions = [QuestionKey((5, 6), extract=Extract()), QuestionKey((7,), extract=Extract(generate=True))]
    [scored] = engine.score_trees([build_tree([2], list(range(20, 60)), questions)])
    assert len(scored.answers[0]) > 1 and len(scored.answers[1]) == 1  # searched, generated
    assert [f._cache_size() for f in programs] == compiled
    engine.warmup(extraction=True)
    sizes = engine.buckets.sizes
    assert len(sizes) == 3 and {(size, False) for size in sizes} <= engine._warm_extraction
    compiled = [f._cache_size() for f in programs]
    many = [QuestionKey((5, 6 + i), extract=Extract()) for i in range(8)]  # rows past the first decode size
    many += [QuestionKey((7 + i,), extract=Extract(generate=True)) for i in range(20)]
    engine.score_trees([build_tree([2], list(range(20, 60)), many)])
    assert [f._cache_size() for f in programs] == compiled
    engine._extract_and_decode = lambda *_: pytest.fail("warmed buckets are not run again")
    engine.warmup(extraction=True)
