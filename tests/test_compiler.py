"""The request compiler: SPEC section 1's rules, their error codes and params, and the tokens it produces."""

import copy
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spinf_jax import compiler
from spinf_jax.answers import Vocabulary
from spinf_jax.api import ChatCompletionRequest, Message, ScoreRequest
from spinf_jax.compiler import (
    CompiledRequest,
    Limits,
    ScoringError,
    Slot,
    compile_request,
    parse_template,
    render_content,
)
from spinf_jax.decoding import convert
from spinf_jax.layout import Extract
from spinf_jax.loader import open_checkpoint, resolve
from spinf_jax.tokenizer import Tokenizer
from tests.profiles import examples
from tests.spec_example import SPEC_REQUEST as SPEC_EXAMPLE


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(open_checkpoint(resolve("spinf/gemma-3-270m")))


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:  # no BOS, byte-level BPE
    return Tokenizer.from_gguf(open_checkpoint(resolve("spinf/smollm2-135m-instruct")))


YES_NO = {"id": "q", "template": "\n\nAnswer:{?}", "options": [" yes", " no"]}


def q(**changes) -> dict:
    """The yes/no query with some fields changed (None removes a field)."""
    query = {**YES_NO, **changes}
    return {k: v for k, v in query.items() if v is not None}


def req(*queries, **top) -> dict:
    return {
        "messages": [{"role": "user", "content": "Hello there."}],
        "scoring": {"queries": list(queries)},
        **top,
    }


def inputs(*items, queries=(YES_NO,)) -> dict:
    return {"inputs": list(items), "scoring": {"queries": list(queries)}}


def msg(text="Hi.") -> list:
    return [{"content": text}]


def compile_body(body, tokenizer, limits: Limits | None = None) -> CompiledRequest:
    """The library's path: a request as Python objects, decoded (spinf_jax.decoding), then compiled."""
    return compile_request(convert(body, ScoreRequest), tokenizer, limits or Limits())


def _raises(body, tokenizer, limits: Limits | None = None) -> ScoringError:
    with pytest.raises(ScoringError) as info:
        compile_body(body, tokenizer, limits)
    return info.value


def _questions(request: CompiledRequest):
    return [qn for content in request.contents for query in content.queries for qn in query.questions]


# --- what compiles ---------------------------------------------------------------------------------


def test_spec_example_compiles(gemma):
    body = copy.deepcopy(SPEC_EXAMPLE)
    del body["packs"], body["scoring"]["queries"][3]
    request = compile_body(body, gemma)
    assert request.model == "spinf/gemma-4-12b-fp8"
    assert request.contents[0].packs == ()
    assert all(q.floor for q in _questions(request))
    (content,) = request.contents
    assert content.input_id == "0"
    assert content.content_ids == tuple(gemma.encode(body["messages"][0]["content"]))
    assert [query.id for query in content.queries] == ["topic", "refund", "sentiment_about"]
    assert all(query.slot is Slot.SCORE for query in content.queries)
    refund = content.queries[1].questions[0]
    assert refund.values == {} and refund.options == (" yes", " no")
    assert refund.template_ids == tuple(gemma.encode("\n\nIs the customer asking for a refund?\nAnswer:"))
    assert refund.option_ids == (tuple(gemma.encode(" yes")), tuple(gemma.encode(" no")))
    assert [qn.values for qn in content.queries[2].questions] == [
        {"tone": "positive", "subject": "the product"},
        {"tone": "positive", "subject": "the support"},
        {"tone": "negative", "subject": "the product"},
        {"tone": "negative", "subject": "the support"},
    ]
    assert content.queries[2].questions[3].template_ids == tuple(
        gemma.encode("\n\nIs the message negative about the support?\nAnswer:")
    )
    # The pieces the engine concatenates are the tokens of the whole text.
    for question in _questions(request):
        text = gemma.decode(list(question.template_ids))
        for option, ids in zip(question.options, question.option_ids, strict=True):
            assert gemma.encode(text + option) == list(question.template_ids + ids)


def test_spec_example_extraction_ends_at_the_implied_closing_quote(gemma):
    body = {key: value for key, value in SPEC_EXAMPLE.items() if key != "packs"}  # packs: test_packs.py
    [month] = [q for q in compile_body(body, gemma).contents[0].queries if q.id == "month"]
    [question] = month.questions
    assert month.slot is Slot.TEXT and question.options == () and not question.floor
    assert question.extract == Extract("text", tuple(gemma.encode('"')), max_answers=5, max_tokens=16)
    assert gemma.decode(list(question.template_ids)).endswith('A: "')


def test_extraction_settings_and_closing_text(gemma):
    queries = [
        {"id": "a", "template": "Total:{$} (total)", "max_answers": 8, "floor": True},
        {"id": "b", "template": "Count:{n}", "max_tokens": 4},
        {"id": "c", "template": "Say: '{*}", "mode": "generate"},
        {"id": "d", "template": "Say: {{{*}}}"},
    ]
    contents = compile_body(req(*queries), gemma).contents[0]
    a, b, c, d = (query.questions[0] for query in contents.queries)
    assert a.extract == Extract("amount", tuple(gemma.encode(" (total)")), 8, 16) and a.floor
    assert b.extract == Extract("number", (), 5, 4) and not b.floor
    assert c.extract == Extract("text", tuple(gemma.encode("'")), 5, 64, generate=True)
    assert (
        d.extract.closing_ids == tuple(gemma.encode("}")) and gemma.decode(list(d.template_ids)) == "Say: {"
    )


def test_options_with_an_extraction_slot_are_refused(gemma):
    error = _raises(req(YES_NO, {"id": "m", "template": "A:{n}", "options": [" 1"]}), gemma)
    assert (error.code, error.param) == ("invalid_request", "scoring.queries[1].options")


def test_number_slots_need_digit_tokens(gemma, monkeypatch):
    no_digits = Vocabulary.anything(8)
    monkeypatch.setattr(compiler, "vocabulary", lambda tokenizer: replace(no_digits, digits=frozenset("12")))
    error = _raises(req({"id": "n", "template": "Count:{n}"}), gemma)
    assert (error.code, error.param) == ("extraction_unsupported", "scoring.queries[0].template")
    assert compile_body(req({"id": "t", "template": "Name:{*}"}), gemma).contents[0].queries[0].id == "t"


def test_defaults_and_ignored_fields(gemma):
    """The chat route's request ignores the chat fields the OpenAI SDKs send; /v1/score's refuses them, as
    it refuses any field it does not have (a misspelling is never read as a field left out)."""
    body = req(YES_NO, temperature=0.2, n=3, model=None)
    body["scoring"]["empty_floor"] = False
    request = compile_request(convert(body, ChatCompletionRequest), gemma, Limits())
    error = _raises(body, gemma)
    assert (error.code, error.param) == ("invalid_request", "temperature")
    assert (request.model, request.contents[0].packs) == (None, ())
    assert not any(q.floor for q in _questions(request))
    assert all(q.floor for q in _questions(compile_body(req(YES_NO), gemma)))


def test_content_rendering():
    messages = [
        {"role": "system", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "three"}]},
        {"content": ""},
    ]
    assert render_content(convert(messages, list[Message]), "messages") == "one\ntwo\nthree\n"


def test_combination_list_keeps_order_and_template_key_order(gemma):
    combos = [{"b": "2", "a": "1"}, {"a": "x", "b": "y"}]
    request = compile_body(req(q(template="{a} and {b}, {a}:{?}", combinations=combos)), gemma)
    questions = request.contents[0].queries[0].questions
    assert [list(qn.values.items()) for qn in questions] == [
        [("a", "1"), ("b", "2")],
        [("a", "x"), ("b", "y")],
    ]
    assert questions[0].template_ids == tuple(gemma.encode("1 and 2, 1:"))


def test_grid_follows_the_template_placeholder_order(gemma):
    query = q(
        template="{b} before {a}:{?}", combinations="all", values={"a": ["1", "2"], "b": ["x", "y", "z"]}
    )
    questions = compile_body(req(query), gemma).contents[0].queries[0].questions
    assert [(qn.values["b"], qn.values["a"]) for qn in questions] == [
        ("x", "1"), ("x", "2"), ("y", "1"), ("y", "2"), ("z", "1"), ("z", "2"),
    ]  # fmt: skip
    assert questions[-1].template_ids == tuple(gemma.encode("z before 2:"))


def test_grid_without_placeholders_is_the_one_empty_combination(gemma):
    request = compile_body(req(q(combinations="all", values={}), q(id="r", combinations=[{}])), gemma)
    assert [[qn.values for qn in query.questions] for query in request.contents[0].queries] == [[{}], [{}]]


def test_literal_braces(gemma):
    parts, slot, closing = parse_template("{{x}} is {y} {{{z}}}:{$}", "t")
    assert (parts, slot, closing) == (["{x} is ", ("y",), " {", ("z",), "}:"], Slot.AMOUNT, "")
    query = q(template="{{x}} is {y} {{{z}}}:{?}", combinations=[{"y": "1", "z": "2"}])
    question = compile_body(req(query), gemma).contents[0].queries[0].questions[0]
    assert question.template_ids == tuple(gemma.encode("{x} is 1 {2}:"))


@pytest.mark.parametrize(
    "template, slot",
    [("A:{?}", Slot.SCORE), ("A: {*}", Slot.TEXT), ("{n}", Slot.NUMBER), ("{a}{$}", Slot.AMOUNT)],
)
def test_parse_template_slots(template, slot):
    assert parse_template(template, "t")[1] is slot


def test_option_boundary_gemma(gemma):
    compile_body(req(q(template="Answer:{?}", options=[" yes"])), gemma)
    error = _raises(req(q(template="Answer: {?}", options=[" no", " yes"])), gemma)
    assert (error.code, error.param) == ("option_boundary", "scoring.queries[0].options[0]")
    assert "' no'" in error.message and "space" in error.message


def test_option_boundary_smollm(smollm):
    assert smollm.prefix() == []
    compile_body(req(q(template="Answer:{?}", options=[" yes", " no"])), smollm)
    error = _raises(req(q(template="\n\nThe cat{?}", options=[" dog", "s"])), smollm)
    assert (error.code, error.param) == ("option_boundary", "scoring.queries[0].options[1]")
    # The check runs per combination: only the filled template that ends in a word glues to "s".
    query = q(template="{x}{?}", options=["s"], combinations=[{"x": "Q:"}, {"x": "The cat"}])
    error = _raises(req(query), smollm)
    assert (error.code, error.param, "'The cat'" in error.message) == (
        "option_boundary", "scoring.queries[0].options[0]", True,
    )  # fmt: skip


def test_no_bos_model_needs_template_text(gemma, smollm):
    query = q(template="{x}{?}", combinations=[{"x": "A:"}, {"x": ""}])
    error = _raises(req(query), smollm)
    assert (error.code, error.param) == ("invalid_template", "scoring.queries[0].template")
    compile_body(req(query), gemma)  # BOS is there to read from


ATOMS = ["Answer", ":", " ", "  ", "\n", "\t", "yes", " yes", "s", "1", "23", "'s", "é", "我们", "?", "-",
         "A", ".."]  # fmt: skip
pieces = st.lists(st.sampled_from(ATOMS), min_size=1, max_size=8).map("".join)


@settings(max_examples=examples(150), deadline=None)
@given(template=pieces, option=pieces)
def test_junction_check_matches_the_whole_text(gemma, smollm, template, option):
    """The boundary check reads only the template's end; it must agree with tokenising the whole text."""
    for tok in (gemma, smollm):
        if not tok.encode(template) or len(tok.encode(option)) > 5:
            continue
        joins = tok.encode(template + option) == tok.encode(template) + tok.encode(option)
        try:
            compile_body(req(q(template=template + "{?}", options=[option])), tok)
            assert joins
        except ScoringError as error:
            assert (error.code, joins) == ("option_boundary", False)


def test_duplicate_options_ignore_case(gemma):
    error = _raises(req(q(options=[" yes", " no", " Yes"])), gemma)
    assert (error.code, error.param) == ("duplicate_option", "scoring.queries[0].options[2]")
    assert "' Yes'" in error.message and "' yes'" in error.message
    compile_body(req(q(options=[" yes", "yes"])), gemma)  # not the same text


def test_many_inputs_with_query_ids_and_own_queries(gemma):
    shared = [YES_NO, q(id="grid", template="{a}?{?}", combinations="all", values={"a": ["x", "y"]})]
    items = []
    for i in range(300):
        kind = i % 3
        item = {"id": f"t{i}", "messages": msg(f"Text number {i}.")}
        if kind == 1:
            item["query_ids"] = ["grid", "q"]
        if kind == 2:
            item["query_ids"] = []
            item["queries"] = [q(id="own", template=f"Is {i} even?{{?}}")]
        items.append(item)
    request = compile_body(inputs(*items, queries=shared), gemma)
    assert [c.input_id for c in request.contents] == [f"t{i}" for i in range(300)]
    assert [query.id for query in request.contents[0].queries] == ["q", "grid"]
    assert [query.id for query in request.contents[1].queries] == ["grid", "q"]
    assert [query.id for query in request.contents[2].queries] == ["own"]
    # Shared queries are compiled once and shared; own ones are each input's.
    assert request.contents[0].queries[0] is request.contents[1].queries[1] is request.contents[3].queries[0]
    assert request.contents[2].queries[0].questions[0].template_ids == tuple(gemma.encode("Is 2 even?"))
    assert request.contents[5].queries[0].questions[0].template_ids == tuple(gemma.encode("Is 5 even?"))
    assert request.contents[7].content_ids == tuple(gemma.encode("Text number 7."))


def test_input_ids_default_to_the_index(gemma):
    request = compile_body(
        inputs({"messages": msg()}, {"id": "b", "messages": msg()}, {"messages": msg()}), gemma
    )
    assert [c.input_id for c in request.contents] == ["0", "b", "2"]


class CountingTokenizer:
    def __init__(self, tok: Tokenizer):
        self.tok, self.batches, self.strings = tok, 0, 0

    def encode(self, text):
        raise AssertionError("the compiler tokenises in batches")

    def encode_batch(self, texts):
        self.batches, self.strings = self.batches + 1, self.strings + len(texts)
        return self.tok.encode_batch(texts)

    def prefix(self):
        return self.tok.prefix()


def test_one_tokenizer_batch_for_a_large_request(gemma):
    values = {"a": [f"thing {i}" for i in range(50)], "b": [f"place {i}" for i in range(20)]}
    options = [f" option{j}" for j in range(100)]
    query = q(template="\n\nIs {a} in {b}?\nAnswer:{?}", options=options, combinations="all", values=values)
    items = [{"messages": msg(f"Content {i}.")} for i in range(15)]  # 1.5M option reads, under 2M
    counting = CountingTokenizer(gemma)
    start = time.perf_counter()
    request = compile_body(inputs(*items, queries=[query]), counting)
    elapsed = time.perf_counter() - start
    assert len(_questions(request)) == 15 * 1000
    # 15 contents + 1,000 filled templates + 100 options + ":" and the 100 joins ":" + option: every filled
    # template ends in text and every option starts with a space, so one character of context decides.
    assert (counting.batches, counting.strings) == (1, 15 + 1000 + 100 + 1 + 100)
    assert elapsed < 10


# --- what fails, with its code and param -----------------------------------------------------------

Q0 = "scoring.queries[0]"
LONG = "word " * 300
CASES = [
    # body shape
    ([], "invalid_request", None),
    ({"scoring": {"queries": [YES_NO]}}, "invalid_request", "messages"),
    ({**req(YES_NO), "inputs": [{"messages": msg()}]}, "invalid_request", "inputs"),
    (req(YES_NO, model=3), "invalid_request", "model"),
    ({"messages": msg()}, "invalid_request", "scoring"),
    ({"messages": msg(), "scoring": []}, "invalid_request", "scoring"),
    ({"messages": msg(), "scoring": {"queries": []}}, "invalid_request", "scoring.queries"),
    ({"messages": msg(), "scoring": {"queries": {"q": YES_NO}}}, "invalid_request", "scoring.queries"),
    ({"messages": msg(), "scoring": {"queries": [YES_NO], "empty_floor": "no"}}, "invalid_request",
     "scoring.empty_floor"),
    (req(YES_NO, packs={"id": "p"}), "invalid_request", "packs"),
    (req(YES_NO, packs=["p"]), "invalid_request", "packs[0]"),
    (req(YES_NO, packs=[{"id": 1}]), "invalid_request", "packs[0].id"),
    (req(YES_NO, packs=[{"id": "p"}, {"id": "p"}]), "invalid_request", "packs[1].id"),
    # content
    ({**req(YES_NO), "messages": []}, "invalid_request", "messages"),
    ({**req(YES_NO), "messages": "Hello"}, "invalid_request", "messages"),
    ({**req(YES_NO), "messages": ["Hello"]}, "invalid_request", "messages[0]"),
    ({**req(YES_NO), "messages": [{"role": "user"}]}, "invalid_request", "messages[0].content"),
    ({**req(YES_NO), "messages": [{"content": 5}]}, "invalid_request", "messages[0].content"),
    ({**req(YES_NO), "messages": [{"content": "\ud800"}]}, "invalid_request", "messages[0].content"),
    ({**req(YES_NO), "messages": [{"content": ["x"]}]}, "invalid_request", "messages[0].content[0]"),
    ({**req(YES_NO), "messages": [{"content": [{"type": "text"}]}]}, "invalid_request",
     "messages[0].content[0].text"),
    ({**req(YES_NO), "messages": [msg()[0], {"content": [{"type": "text", "text": "a"}, {
        "type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, "unsupported_content",
     "messages[1].content[1]"),
    ({**req(YES_NO), "messages": [{"content": [{"type": "input_audio", "input_audio": {}}]}]},
     "unsupported_content", "messages[0].content[0]"),
    ({**req(YES_NO), "messages": [{"content": [{"text": "a"}]}]}, "invalid_request",
     "messages[0].content[0].type"),
    ({**req(YES_NO), "messages": msg(LONG * 14)}, "content_too_long", "messages"),
    # queries
    (req("q"), "invalid_request", Q0),
    (req(q(id=None)), "invalid_request", Q0 + ".id"),
    (req(q(id=7)), "invalid_request", Q0 + ".id"),
    (req(q(id="")), "invalid_request", Q0 + ".id"),
    (req(YES_NO, q(template="B:{?}")), "invalid_request", "scoring.queries[1].id"),
    (req(q(template=None)), "invalid_request", Q0 + ".template"),
    (req(q(template=["A:{?}"])), "invalid_request", Q0 + ".template"),
    # templates
    (req(q(template="Answer:")), "invalid_template", Q0 + ".template"),
    (req(q(template="")), "invalid_template", Q0 + ".template"),
    (req(q(template="{?} Answer:")), "invalid_template", Q0 + ".template"),
    (req(q(template="A:{?}{?}")), "too_many_slots", Q0 + ".template"),
    (req(q(template="A:{*}{?}")), "too_many_slots", Q0 + ".template"),
    (req(q(template="A:{?}\n")), "invalid_template", Q0 + ".template"),
    (req(q(template="A { B:{?}")), "invalid_template", Q0 + ".template"),
    (req(q(template="A } B:{?}")), "invalid_template", Q0 + ".template"),
    (req(q(template="A:{?}}")), "invalid_template", Q0 + ".template"),
    (req(q(template="{my name}:{?}")), "unknown_slot", Q0 + ".template"),
    (req(q(template="{1x}:{?}")), "unknown_slot", Q0 + ".template"),
    (req(q(template="{}:{?}")), "unknown_slot", Q0 + ".template"),
    (req(q(template="{n} things:{?}")), "too_many_slots", Q0 + ".template"),
    (req(q(template="{a}{b}{c}{d}{e}{f}:{?}")), "invalid_template", Q0 + ".template"),
    (req(q(template=LONG + "{?}")), "template_too_long", Q0 + ".template"),
    (req(q(template="{x}{?}", combinations=[{"x": "A:"}, {"x": LONG}])), "template_too_long",
     Q0 + ".template"),
    # placeholders and combinations
    (req(q(template="{x}:{?}")), "unknown_placeholder", Q0 + ".template"),
    (req(q(template="{x}:{?}", combinations=[{"x": "1"}, {}])), "unknown_placeholder",
     Q0 + ".combinations[1]"),
    (req(q(template="{x}:{?}", combinations=[{"x": "1", "y": "2"}])), "unknown_placeholder",
     Q0 + ".combinations[0].y"),
    (req(q(combinations=[{"x": "1"}])), "unknown_placeholder", Q0 + ".combinations[0].x"),
    (req(q(combinations="all", values={"x": ["1"]})), "unknown_placeholder", Q0 + ".values.x"),
    (req(q(values={"x": ["1"]})), "unknown_placeholder", Q0 + ".values.x"),
    (req(q(template="{x}{y}:{?}", combinations="all", values={"x": ["1"]})), "unknown_placeholder",
     Q0 + ".values"),
    (req(q(template="{x}:{?}", combinations=[{"x": 1}])), "invalid_request", Q0 + ".combinations[0].x"),
    (req(q(template="{x}:{?}", combinations=[["1"]])), "invalid_request", Q0 + ".combinations[0]"),
    (req(q(template="{x}:{?}", combinations=[])), "invalid_request", Q0 + ".combinations"),
    (req(q(template="{x}:{?}", combinations="some")), "invalid_request", Q0 + ".combinations"),
    (req(q(template="{x}:{?}", combinations={"x": "1"})), "invalid_request", Q0 + ".combinations"),
    (req(q(template="{x}:{?}", combinations="all")), "invalid_request", Q0 + ".values"),
    (req(q(template="{x}:{?}", values={"x": ["1"]})), "invalid_request", Q0 + ".values"),
    (req(q(template="{x}:{?}", combinations=[{"x": "1"}], values={"x": ["1"]})), "invalid_request",
     Q0 + ".values"),
    (req(q(template="{x}:{?}", combinations="all", values=["1"])), "invalid_request", Q0 + ".values"),
    (req(q(template="{x}:{?}", combinations="all", values={"x": "1"})), "invalid_request",
     Q0 + ".values.x"),
    (req(q(template="{x}:{?}", combinations="all", values={"x": []})), "invalid_request",
     Q0 + ".values.x"),
    (req(q(template="{x}:{?}", combinations="all", values={"x": ["1", None]})), "invalid_request",
     Q0 + ".values.x[1]"),
    (req(q(template="{x}{y}:{?}", combinations="all",
           values={"x": [str(i) for i in range(40)], "y": [str(i) for i in range(30)]})),
     "too_many_combinations", Q0 + ".combinations"),
    (req(q(template="{x}:{?}", combinations=[{"x": "1"}] * 1001)), "too_many_combinations",
     Q0 + ".combinations"),
    # options
    (req(q(options=None)), "invalid_request", Q0 + ".options"),
    (req(q(options=[])), "invalid_request", Q0 + ".options"),
    (req(q(options=" yes")), "invalid_request", Q0 + ".options"),
    (req(q(options=[" yes", 1])), "invalid_request", Q0 + ".options[1]"),
    (req(q(options=[" yes", ""])), "invalid_option", Q0 + ".options[1]"),
    (req(q(options=[" yes", " a b c d e f"])), "option_too_long", Q0 + ".options[1]"),
    (req(q(options=[f" o{i}" for i in range(1001)])), "too_many_options", Q0 + ".options"),
    (req(q(options=[" yes", " no", " YES"])), "duplicate_option", Q0 + ".options[2]"),
    (req(q(template="Answer: {?}")), "option_boundary", Q0 + ".options[0]"),
    (req(q(template="A: {*}")), "invalid_request", Q0 + ".options"),
    # slots
    (req(q(template='A: "{*}" or {?}', options=None)), "too_many_slots", Q0 + ".template"),
    (req(q(template="{n} items:{?}")), "too_many_slots", Q0 + ".template"),
    (req(q(template="A:{#}", options=None)), "unknown_slot", Q0 + ".template"),
    (req(q(template="A:{?} yes")), "invalid_template", Q0 + ".template"),
    (req(q(template="A:{*} {x}", options=None)), "invalid_template", Q0 + ".template"),
    (req(q(template="A:{*}" + " word" * 17, options=None)), "closing_too_long", Q0 + ".template"),
    (req(q(template="A:{*}", options=None, max_answers=9)), "out_of_range", Q0 + ".max_answers"),
    (req(q(template="A:{*}", options=None, max_answers=0)), "out_of_range", Q0 + ".max_answers"),
    (req(q(template="A:{n}", options=None, max_tokens=33)), "out_of_range", Q0 + ".max_tokens"),
    (req(q(template="A:{*}", options=None, mode="generate", max_tokens=129)), "out_of_range",
     Q0 + ".max_tokens"),
    (req(q(template="A:{*}", options=None, mode="generate", max_answers=2)), "invalid_request",
     Q0 + ".max_answers"),
    (req(q(template="A:{*}", options=None, mode="beam")), "invalid_request", Q0 + ".mode"),
    (req(q(template="A:{*}", options=None, max_answers="5")), "invalid_request", Q0 + ".max_answers"),
    (req(q(max_tokens=3)), "invalid_request", Q0 + ".max_tokens"),
    (req(q(floor=True)), "invalid_request", Q0 + ".floor"),
    # inputs
    (inputs(), "invalid_request", "inputs"),
    ({"inputs": {"messages": msg()}, "scoring": {"queries": [YES_NO]}}, "invalid_request", "inputs"),
    (inputs("text"), "invalid_request", "inputs[0]"),
    (inputs({"messages": msg()}, {"messages": "Hi"}), "invalid_request", "inputs[1].messages"),
    (inputs({"id": 1, "messages": msg()}), "invalid_request", "inputs[0].id"),
    (inputs({"id": "", "messages": msg()}), "invalid_request", "inputs[0].id"),
    (inputs({"id": "a", "messages": msg()}, {"id": "a", "messages": msg()}), "invalid_request",
     "inputs[1].id"),
    (inputs({"messages": msg()}, {"id": "0", "messages": msg()}), "invalid_request", "inputs[1].id"),
    (inputs({"messages": msg(), "query_ids": ["q", "nope"]}), "unknown_query", "inputs[0].query_ids[1]"),
    (inputs({"messages": msg(), "query_ids": ["q", "q"]}), "invalid_request", "inputs[0].query_ids[1]"),
    (inputs({"messages": msg(), "query_ids": "q"}), "invalid_request", "inputs[0].query_ids"),
    (inputs({"messages": msg(), "query_ids": [3]}), "invalid_request", "inputs[0].query_ids[0]"),
    (inputs({"messages": msg(), "query_ids": []}), "invalid_request", "inputs[0]"),
    (inputs({"messages": msg()}, queries=[]), "invalid_request", "inputs[0]"),
    (inputs({"messages": msg(), "queries": [q(template="B:{?}")]}), "invalid_request",
     "inputs[0].queries[0].id"),
    (inputs({"messages": msg(), "queries": [q(id="a"), q(id="a")]}), "invalid_request",
     "inputs[0].queries[1].id"),
    (inputs({"messages": msg(), "queries": {"id": "a"}}), "invalid_request", "inputs[0].queries"),
    (inputs({"messages": msg()}, {"messages": msg(), "queries": [q(id="b", options=[" x", " X"])]}),
     "duplicate_option", "inputs[1].queries[0].options[1]"),
    (inputs({"messages": msg()}, {"messages": msg(LONG * 14)}), "content_too_long", "inputs[1].messages"),
    (inputs({"messages": [{"content": [{"type": "video_url"}]}]}), "unsupported_content",
     "inputs[0].messages[0].content[0]"),
]  # fmt: skip


@pytest.mark.parametrize("body, code, param", CASES, ids=[f"{i}-{c[1]}-{c[2]}" for i, c in enumerate(CASES)])
def test_errors(gemma, body, code, param):
    error = _raises(body, gemma)
    assert (error.code, error.param) == (code, param), error.message
    assert error.status == 400
    assert error.message


GRID = q(template="{x}:{?}", combinations="all", values={"x": ["1", "2"]})
LIMIT_CASES = [
    (req(GRID, q(id="r")), Limits(max_questions_per_content=2), "too_many_questions", "scoring.queries"),
    (inputs({"messages": msg(), "query_ids": ["q"]}, {"messages": msg()},
            queries=[YES_NO, GRID | {"id": "g"}]),
     Limits(max_questions_per_content=2), "too_many_questions", "inputs[1]"),
    (inputs(*[{"messages": msg()}] * 3), Limits(max_inputs=2), "too_many_inputs", "inputs"),
    (req(q(options=[" a", " b", " c"])), Limits(max_options=2), "too_many_options", Q0 + ".options"),
    (req(q(options=[" yes", " yes sir"])), Limits(max_option_tokens=1), "option_too_long",
     Q0 + ".options[1]"),
    (req(q(template="\n\nIs it?\nAnswer:{?}")), Limits(max_template_tokens=3), "template_too_long",
     Q0 + ".template"),
    (req(GRID), Limits(max_combinations=1), "too_many_combinations", Q0 + ".combinations"),
    (req(q(template="{a}{b}:{?}", combinations=[{"a": "1", "b": "2"}])), Limits(max_placeholders=1),
     "invalid_template", Q0 + ".template"),
    (req(YES_NO), Limits(max_content_tokens=2), "content_too_long", "messages"),
]  # fmt: skip


@pytest.mark.parametrize("body, limits, code, param", LIMIT_CASES, ids=[c[2] for c in LIMIT_CASES])
def test_limits(gemma, body, limits, code, param):
    error = _raises(body, gemma, limits)
    assert (error.code, error.param) == (code, param), error.message
    compile_body(body, gemma)  # within the default limits


# --- junk never escapes as anything but a ScoringError ---------------------------------------------

KEYS = ["messages", "inputs", "scoring", "queries", "query_ids", "id", "template", "options",
        "combinations", "values", "packs", "content", "role", "type", "text", "empty_floor", "model",
        "x"]  # fmt: skip
STRINGS = ["", "q", "x", "all", "text", "image_url", " yes", " Yes", "A:{?}", "A: {?}", "{x}:{?}", "{?}",
           "{*}", "{", "}}", "{x}{n}", "\ud800", "0", "Hello."]  # fmt: skip
scalars = (
    st.none() | st.booleans() | st.integers(-2, 3) | st.floats(allow_nan=True) | st.sampled_from(STRINGS)
)
json_like = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(KEYS), children, max_size=5)
    ),
    max_leaves=25,
)


def _paths(value, path=()):
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, (*path, key))


def _mutate(body, path, replacement, delete):
    *parents, last = path
    target = body
    for key in parents:
        target = target[key]
    if delete:
        del target[last]
    else:
        target[last] = replacement


KNOWN_CODES = {
    "invalid_request", "invalid_template", "unknown_placeholder", "too_many_combinations", "invalid_option",
    "option_too_long", "too_many_options", "duplicate_option", "option_boundary", "template_too_long",
    "unsupported_content", "content_too_long", "too_many_questions", "too_many_inputs", "unknown_query",
    "too_many_slots", "unknown_slot", "closing_too_long", "out_of_range", "unknown_pack",
}  # fmt: skip


def _compiles_or_refuses(body, tok):
    try:
        assert isinstance(compile_body(body, tok), CompiledRequest)
    except ScoringError as error:
        assert error.code in KNOWN_CODES and isinstance(error.message, str)
        assert error.param is None or isinstance(error.param, str)


@settings(max_examples=examples(300), deadline=None)
@given(body=json_like)
def test_random_junk_is_refused_cleanly(gemma, body):
    _compiles_or_refuses(body, gemma)


MIXED = inputs(
    {"messages": msg(), "query_ids": ["q"]},
    {"id": "b", "messages": [{"content": [{"type": "text", "text": "a"}]}], "queries": [GRID | {"id": "g"}]},
)


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data())
def test_mutated_requests_are_refused_cleanly(smollm, data):
    body = copy.deepcopy(data.draw(st.sampled_from([SPEC_EXAMPLE, MIXED])))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        _mutate(body, path, data.draw(json_like), data.draw(st.booleans()))
    _compiles_or_refuses(body, smollm)
