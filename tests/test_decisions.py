"""Typed decisions through the library: the prompt, the reading of the letters, shared = direct bit for bit,
orderings and their combination, workloads, and every decision error."""

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from spinf_jax.calibration import Calibration, Workload, apply_temperature
from spinf_jax.decisions import LETTERS, SYSTEM, Decider, Format
from spinf_jax.errors import ScoringError
from spinf_jax.models.layers import TreeBatch

STATE = "The parcel arrived two weeks late and the box was crushed. Support never answered my emails."
SENTIMENT = {
    "id": "sentiment",
    "question": "What is the customer's sentiment?",
    "options": [
        {"id": "pos", "description": "Positive: the customer is satisfied."},
        {"id": "neg", "description": "Negative: the customer is unhappy."},
        {"id": "neu", "description": "Neutral: neither satisfied nor unhappy."},
    ],
}
URGENT = {
    "id": "urgent",
    "question": "Does this need a reply today?",
    "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
}
TOPIC = {
    "id": "topic",
    "question": "What is the message about?",
    "options": [
        {"id": "delivery", "description": "Delivery or shipping"},
        {"id": "billing", "description": "Billing or payment"},
        {"id": "product", "description": "The product itself"},
        {"id": "other", "description": "Something else"},
    ],
}
CALIBRATION = Calibration({"support": Workload(2.5), "sharp": Workload(0.5)})


# The fast tier decides on SmolLM2; CI on Gemma 3 too (the plain prompt's format alone is in the fast tier).
@pytest.fixture(scope="module", params=["smollm", pytest.param("gemma", marks=pytest.mark.slow)])
def decider(request, smollm_engine, gemma_engine):
    """SmolLM2 reads the chat-templated prompt, Gemma 3 270M (a base model) the plain one."""
    engine = smollm_engine if request.param == "smollm" else gemma_engine
    return Decider(engine, calibration=CALIBRATION)


@pytest.fixture(scope="module")
def smollm(smollm_engine):
    return Decider(smollm_engine, calibration=CALIBRATION)


def _alone(question: dict, **extra) -> dict:
    return {"state": STATE, **question, **extra}


def test_the_prompt_is_semifs_direct_options_format(smollm):
    r = smollm.decide(_alone(SENTIMENT))
    payload = {
        "evidence": STATE,
        "criterion": SENTIMENT["question"],
        "options": [
            {"letter": LETTERS[j], "description": o["description"]}
            for j, o in enumerate(SENTIMENT["options"])
        ],
    }
    text = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{json.dumps(payload, ensure_ascii=False)}"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r["prompt_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert r["prompt_version"] == "direct-options-v1"
    assert r["input_tokens"] == len(smollm.format.tokenizer.encode(text))
    assert r["option_ids"] == ["pos", "neg", "neu"]
    assert sum(r["probabilities"]) == pytest.approx(1.0)


def test_a_base_model_reads_the_plain_prompt(gemma_engine):
    form = Format(gemma_engine.model.tokenizer)
    assert form.version == "direct-options-plain-v1"
    text, state_end = form.render({"a": 1}, "q?", [{"description": "x"}, {"description": "y"}])
    assert text.startswith(SYSTEM + '\n\n{"evidence": {"a": 1}, "criterion": "q?"')
    assert text.endswith("\n\nAnswer:")
    assert text[:state_end].endswith('{"evidence": {"a": 1}')


def test_letters_are_a_plain_forward_of_the_whole_prompt(decider):
    """The tree (the state's trunk, the rest as a branch) gives what one forward of the prompt gives."""
    r = decider.decide(_alone(TOPIC))
    form, model = decider.format, decider.engine.model
    descriptions = [{"description": o["description"]} for o in TOPIC["options"]]
    text, _ = form.render(STATE, TOPIC["question"], descriptions)
    ids = form.tokenizer.encode(text)
    ids = ids if ids[:1] == form.tokenizer.prefix() else form.tokenizer.prefix() + ids
    hidden = model.hidden(TreeBatch.sequence(ids))
    letters = np.asarray(form.label_ids[:4], np.int32)[None, :]
    lp, _ = model.logprobs(hidden[len(ids) - 1 : len(ids)], letters)
    np.testing.assert_allclose(r["option_logits"], np.asarray(lp[0], np.float64), atol=2e-4)
    assert r["probabilities"] == pytest.approx(list(apply_temperature(np.array(r["option_logits"]), 1.0)))


def test_shared_is_bit_identical_to_direct(decider):
    direct = {q["id"]: decider.decide(_alone(q, orderings="rotations")) for q in (SENTIMENT, URGENT, TOPIC)}
    asked = [dict(q, orderings="rotations") for q in (TOPIC, SENTIMENT, URGENT)]
    for decisions in (asked, asked[::-1]):
        shared = decider.decide({"state": STATE, "decisions": decisions})
        assert [r["id"] for r in shared["results"]] == [d["id"] for d in decisions]
        for result in shared["results"]:
            mine = direct[result["id"]]
            for field in (
                "probabilities",
                "option_logits",
                "prompt_sha256",
                "input_tokens",
                "orderings",
                "combined",
            ):
                assert result[field] == mine[field], field
    # The state is read once: fewer tokens than the decisions' prompts together.
    assert shared["processed_tokens"] < sum(
        o_tokens * len(r["orderings"]) for r in direct.values() for o_tokens in [r["input_tokens"]]
    )


def test_orderings_map_back_to_the_options(decider):
    r = decider.decide(_alone(SENTIMENT, orderings="rotations"))
    assert [o["order"] for o in r["orderings"]] == [
        ["pos", "neg", "neu"],
        ["neg", "neu", "pos"],
        ["neu", "pos", "neg"],
    ]
    assert r["orderings"][0]["probabilities"] == r["probabilities"]
    # The rotation that lists "neg" first asks the options in that order: the same prompt as listing them so.
    alone = decider.decide(_alone(dict(SENTIMENT, options=[SENTIMENT["options"][i] for i in (1, 2, 0)])))
    by_id = dict(zip(alone["option_ids"], alone["probabilities"], strict=True))
    assert r["orderings"][1]["probabilities"] == [by_id[i] for i in r["option_ids"]]
    assert r["orderings"][1]["prompt_sha256"] == alone["prompt_sha256"]
    combined = r["combined"]
    assert combined["method"] == "log-mean" and combined["orderings"] == 3
    each = np.array([o["probabilities"] for o in r["orderings"]])
    expected = apply_temperature(np.mean(np.log(each), axis=0), 1.0)
    assert combined["probabilities"] == pytest.approx(list(expected), abs=1e-12)
    top = int(np.argmax(expected))
    assert combined["top"] == r["option_ids"][top]
    assert combined["agreement"] == pytest.approx(float(np.mean(np.argmax(each, axis=1) == top)))
    assert combined["spread"] == pytest.approx(float(np.max(each.max(axis=0) - each.min(axis=0))))


def test_combination_does_not_depend_on_the_order_options_are_listed(decider):
    """ "all" asks every order whichever way the options are listed (3 options: 3! prompts); rotations of a
    rotated list are the same rotations (4 options: 4). Either way the combined probabilities are the same
    bits, per option id."""
    cases = [(SENTIMENT, "all", (2, 0, 1)), (TOPIC, "rotations", (1, 2, 3, 0))]
    prompts = {}
    for question, orderings, order in cases:
        relisted = dict(question, options=[question["options"][i] for i in order])
        first = decider.decide(_alone(question, orderings=orderings, workload="support"))
        second = decider.decide(_alone(relisted, orderings=orderings, workload="support"))
        for block in ("combined", "calibrated"):
            p1 = dict(zip(first["option_ids"], first[block]["probabilities"], strict=True))
            p2 = dict(zip(second["option_ids"], second[block]["probabilities"], strict=True))
            assert p1 == p2, (orderings, block)
            assert first[block]["top"] == second[block]["top"]
        prompts[orderings] = len(first["orderings"])
    assert prompts == {"all": 6, "rotations": 4}


def test_a_workload_adds_calibrated_probabilities_and_keeps_the_answer(decider):
    plain = decider.decide(_alone(SENTIMENT, workload="support"))
    t = CALIBRATION.workloads["support"].temperature
    calibrated = plain["calibrated"]
    assert calibrated["workload"] == "support" and calibrated["temperature"] == t
    assert calibrated["probabilities"] == pytest.approx(
        list(apply_temperature(np.log(plain["probabilities"]), t))
    )
    assert calibrated["top"] == plain["option_ids"][int(np.argmax(plain["probabilities"]))]
    assert max(calibrated["probabilities"]) < max(plain["probabilities"])  # T > 1 softens
    averaged = decider.decide(_alone(SENTIMENT, orderings="rotations", workload="sharp"))
    sharp = averaged["calibrated"]["probabilities"]
    assert sharp == pytest.approx(list(apply_temperature(np.log(averaged["combined"]["probabilities"]), 0.5)))
    assert averaged["calibrated"]["top"] == averaged["combined"]["top"]
    # A shared request's workload is every decision's unless one names its own.
    shared = decider.decide(
        {"state": STATE, "workload": "support", "decisions": [SENTIMENT, dict(URGENT, workload="sharp")]}
    )
    assert [r["calibrated"]["workload"] for r in shared["results"]] == ["support", "sharp"]
    assert shared["results"][0]["calibrated"] == calibrated


def test_json_states_are_written_as_json(smollm):
    state = {"ticket": 4411, "body": "Refund not received, charged twice.", "tags": ["billing", "urgent"]}
    r = smollm.decide({"state": state, **TOPIC})
    text, _ = smollm.format.render(
        state, TOPIC["question"], [{"description": o["description"]} for o in TOPIC["options"]]
    )
    assert (
        '"evidence": {"ticket": 4411, "body": "Refund not received, charged twice.", "tags": ["billing"'
        in text
    )
    assert r["prompt_sha256"] == hashlib.sha256(text.encode()).hexdigest()


OPTIONS_17 = [{"id": f"o{j}", "description": f"option {j}"} for j in range(17)]
ERRORS = [
    (_alone(dict(URGENT, options=URGENT["options"][:1])), "option_count", "options"),
    (_alone(dict(URGENT, options=OPTIONS_17)), "option_count", "options"),
    (_alone(dict(URGENT, options=[URGENT["options"][0]] * 2)), "duplicate_option_id", "options[1].id"),
    ({**URGENT, "state": ""}, "empty_state", "state"),
    ({**URGENT, "state": {}}, "empty_state", "state"),
    ({**URGENT, "state": "   "}, "empty_state", "state"),
    (_alone(URGENT, workload="nobody"), "unknown_workload", "workload"),
    (_alone(dict(URGENT, options=OPTIONS_17[:5]), orderings="all"), "too_many_orderings", "orderings"),
    ({**URGENT, "state": "word " * 5000}, "content_too_long", "state"),
    ({"state": STATE, "decisions": [URGENT, dict(URGENT, id="u2", options=URGENT["options"][:1])]},
     "option_count", "decisions[1].options"),
    ({"state": STATE, "decisions": [URGENT, URGENT]}, "invalid_request", "decisions[1].id"),
    ({"state": STATE, "decisions": [URGENT], "workload": "nobody"}, "unknown_workload",
     "decisions[0].workload"),
    ({**URGENT, "orderings": "some"}, "invalid_request", "orderings"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "code", "param"), ERRORS)
def test_decision_errors_have_their_own_codes(smollm, body, code, param):
    with pytest.raises(ScoringError) as e:
        smollm.decide(copy.deepcopy(body))
    assert (e.value.code, e.value.param) == (code, param), e.value.message


def test_a_tokenizer_without_single_token_letters_is_refused(smollm_engine, monkeypatch):
    tokenizer = smollm_engine.model.tokenizer
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: real(text) * (2 if text == "C" else 1))
    with pytest.raises(ScoringError) as e:
        Format(tokenizer)
    assert e.value.code == "decisions_unsupported" and "'C'" in e.value.message


PARITY = (
    Path(__file__).resolve().parent.parent
    / "fixtures"
    / "references"
    / "decisions"
    / "smollm2-135m.fp32.json"
)


def test_prompts_and_letters_match_transformers(smollm):
    """transformers' apply_chat_template renders the same prompt (sha256), tokenised the same, and its fp32
    forward gives the letters the same log-probabilities (fixtures/record_references.py record-decisions)."""
    reference = json.loads(PARITY.read_text())
    assert reference["system"] == SYSTEM
    for case in reference["cases"]:
        options = [{"id": f"o{j}", "description": d} for j, d in enumerate(case["descriptions"])]
        r = smollm.decide(
            {"id": case["name"], "state": case["state"], "question": case["question"], "options": options}
        )
        assert r["prompt_sha256"] == case["text_sha256"], case["name"]
        assert r["input_tokens"] == len(case["input_ids"])
        np.testing.assert_allclose(
            r["option_logits"], case["letter_logprobs"], atol=2e-4, err_msg=case["name"]
        )


def test_a_thinking_template_is_asked_for_its_answer_not_its_thoughts(smollm_engine):
    """Templates that think by default (Qwen3, Qwen3.5) are rendered with thinking off: the prompt ends with
    the empty think block they then write, so the next token is the lettered answer. (Whether a letter stays
    one token of its own after it is the tokenizer's business: Format checks that, and refuses otherwise.)"""
    tokenizer = copy.copy(smollm_engine.model.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
        "{% else %}<think>\n{% endif %}{% endif %}"
    )
    text = tokenizer.render_chat([{"role": "user", "content": "Which team?"}])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_prompt_too_large_for_the_buckets_is_blamed_on_the_field_that_made_it(smollm):
    """A huge question over a short state is the question's fault (not the state's), in /decide and in
    /decide/shared; a huge state is the state's."""
    options = [{"id": "a", "description": "A"}, {"id": "b", "description": "B"}]
    huge = "why " * 20_000
    cases = [
        ({"id": "d", "state": "short", "question": huge, "options": options}, "question"),
        ({"state": "short", "decisions": [{"id": "a", "question": "Fine?", "options": options},
                                          {"id": "b", "question": huge, "options": options}]},
         "decisions[1].question"),
        ({"id": "d", "state": huge, "question": "Fine?", "options": options}, "state"),
    ]  # fmt: skip
    for body, param in cases:
        with pytest.raises(ScoringError) as e:
            smollm.decide(body)
        assert (e.value.code, e.value.param) in {("question_too_large", param), ("content_too_long", param)}
