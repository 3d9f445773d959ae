"""The scoring engine end to end on Gemma 3 270M: the SPEC's example, equivalence, invariance, the floor."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spinf_jax.compiler import Limits, ScoringError
from spinf_jax.engine import Engine
from spinf_jax.layout import build_tree
from spinf_jax.loader import Model
from spinf_jax.models import abstract_decoder
from spinf_jax.models.layers import TreeBatch
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision
from spinf_jax.scoring import Scorer
from tests import engines
from tests.spec_example import QUERY_POOL, scores_by_question, without_extraction

SPEC_EXAMPLE = without_extraction()
TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
OTHER_TEXTS = [
    "Review: the kettle boils fast but the lid broke after a week. Two stars.",
    "The city council approved the new cycle lanes on Thursday after a long debate about parking.",
    "Hello, my parcel was marked delivered yesterday but it never arrived. Order 55120.",
]


@pytest.fixture(scope="module")
def engine(gemma_engine):
    return gemma_engine


# bf16 on the real model in the full tier (`pytest -m full`): its own programs to compile, 44 s of CI's time;
# test_layout checks bf16 invariance on the tiny fixtures in every run.
@pytest.fixture(scope="module", params=["fp32", pytest.param("bf16", marks=pytest.mark.full)])
def engine_in(request):
    return engines.engine("spinf/gemma-3-270m", request.param)


def _options(response, input_index, query_id, combination=0):
    queries = {q["id"]: q for q in response["results"][input_index]["queries"]}
    return queries[query_id]["combinations"][combination]


def test_spec_example_end_to_end(engine):
    # An engine of its own, so its floor cache is empty whatever ran before in this process: the floors are
    # computed, and counted in the usage (its programs are the session engine's).
    engine = Engine(engine.model, engine.buckets)
    r = engine.score(SPEC_EXAMPLE)
    assert r["object"] == "score" and r["id"].startswith("score-")
    assert r["system_fingerprint"].startswith("fp_") and r["model"] == "spinf/gemma-3-270m"
    [result] = r["results"]
    assert result["input_id"] == "0"
    assert [q["id"] for q in result["queries"]] == ["topic", "refund", "sentiment_about"]
    combos = result["queries"][2]["combinations"]
    assert [c["values"] for c in combos] == [
        {"tone": t, "subject": s} for t in ("positive", "negative") for s in ("the product", "the support")
    ]
    for query in result["queries"]:
        for combo in query["combinations"]:
            lps = np.array([o["logprob"] for o in combo["options"]])
            assert np.all(lps < 0)
            assert sum(o["p"] for o in combo["options"]) == pytest.approx(1.0)
            assert sum(o["floor_p"] for o in combo["options"]) == pytest.approx(1.0)
            assert combo["residual"] == pytest.approx(1 - np.exp(lps).sum())
            assert 0 <= combo["floor_residual"] <= 1
    topic = _options(r, 0, "topic")
    assert max(topic["options"], key=lambda o: o["p"])["text"] == " billing"
    usage = r["usage"]
    details = usage["prompt_tokens_details"]
    assert details["content_tokens"] == 1 + len(
        engine.model.tokenizer.encode(SPEC_EXAMPLE["messages"][0]["content"])
    )
    assert details["query_tokens"] > 0 and details["floor_tokens"] > 0
    assert usage["prompt_tokens"] == sum(details.values())
    for w in r["warnings"]:
        assert w["code"] == "low_option_mass" and w["input_id"] == "0"


def test_scores_equal_plain_forwards(engine):
    """(a) every option's log-prob equals a plain forward of BOS + content + template + option."""
    r = engine.score(SPEC_EXAMPLE)
    tok, model = engine.model.tokenizer, engine.model
    content = tok.encode(SPEC_EXAMPLE["messages"][0]["content"])
    for query in SPEC_EXAMPLE["scoring"]["queries"][:2]:
        ids = tok.prefix() + content + tok.encode(query["template"].replace("{?}", ""))
        for option in _options(r, 0, query["id"])["options"]:
            option_ids = tok.encode(option["text"])
            seq = ids + option_ids
            hidden = model.hidden(TreeBatch.sequence(seq))
            rows = np.arange(len(ids) - 1, len(seq) - 1)
            lp, _ = model.logprobs(hidden[rows], np.asarray(option_ids, np.int32)[:, None])
            assert option["logprob"] == pytest.approx(float(np.sum(lp)), abs=2e-4)


def _many_inputs(position: int) -> dict:
    body = copy.deepcopy(SPEC_EXAMPLE)
    messages = body.pop("messages")
    inputs = [
        {"id": f"other{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(OTHER_TEXTS)
    ]
    inputs.insert(position, {"id": "target", "messages": messages})
    body["inputs"] = inputs
    return body


def test_content_scores_bit_identical_alone_packed_other_bucket_and_calls(engine):
    """(b) a content's scores do not depend on its neighbours, its position, the bucket, or the call."""
    alone = engine.score(SPEC_EXAMPLE)["results"][0]["queries"]
    for position in (0, 2, 3):
        r = engine.score(_many_inputs(position))
        [target] = [x for x in r["results"] if x["input_id"] == "target"]
        assert target["queries"] == alone
    other_buckets = Engine(engine.model, Buckets((1024, 2048), block=64))
    assert other_buckets.score(SPEC_EXAMPLE)["results"][0]["queries"] == alone
    assert engine.score(SPEC_EXAMPLE)["results"][0]["queries"] == alone


@settings(max_examples=2, deadline=None, derandomize=True)
@given(data=st.data())
def test_question_scores_bit_identical_whatever_else_is_asked(engine_in, data):
    """A (content, question, combination, option) score is the same bits whatever else the request asks:
    a subset of the questions in another order, the questions picked by `query_ids` or given per input,
    other inputs around it; and the floor is the same too."""
    message = SPEC_EXAMPLE["messages"]
    everything = {"messages": message, "scoring": {"queries": QUERY_POOL}}
    want = {key[1:]: value for key, value in scores_by_question(engine_in.score(everything)).items()}
    picked = data.draw(
        st.lists(st.sampled_from(QUERY_POOL), min_size=1, max_size=5, unique_by=lambda q: q["id"])
    )
    ids = [q["id"] for q in picked]
    n_others = data.draw(st.integers(0, 3), label="other inputs")
    order = data.draw(st.permutations(range(n_others + 1)), label="input order")
    for how in ("queries", "query_ids", "own queries"):
        target = {"id": "target", "messages": message}
        if how == "query_ids":
            target["query_ids"], queries = ids, QUERY_POOL
        elif how == "own queries":
            target["queries"], queries = picked, []
        else:
            queries = picked
        inputs = [target]
        for i, text in enumerate(OTHER_TEXTS[:n_others]):  # each asked one question, the same way
            other = {"id": f"o{i}", "messages": [{"role": "user", "content": text}]}
            question = QUERY_POOL[(i * 3) % len(QUERY_POOL)]
            if how == "query_ids":
                other["query_ids"] = [question["id"]]
            elif how == "own queries":
                other["queries"] = [question]
            inputs.append(other)
        body = {"inputs": [inputs[k] for k in order], "scoring": {"queries": queries}}
        got = scores_by_question(engine_in.score(body))
        mine = {key[1:]: value for key, value in got.items() if key[0] == "target"}
        assert {key[0] for key in mine} == set(ids)
        for key, value in mine.items():
            assert value == want[key], (how, key)


def test_floor_equals_scoring_empty_content(engine):
    """(c) the floor is the same question scored on empty content."""
    body = copy.deepcopy(SPEC_EXAMPLE)
    refund = body["scoring"]["queries"][1]
    floored = _options(engine.score(body), 0, "sentiment_about", 2)
    empty = {
        "messages": [{"role": "user", "content": ""}],
        "scoring": {"queries": [refund], "empty_floor": False},
    }
    on_empty = _options(engine.score(empty), 0, "refund")
    with_floor = _options(engine.score({**body, "scoring": {"queries": [refund]}}), 0, "refund")
    # A lone question on empty content is exactly the floor's tree: the same bits.
    assert [o["floor_p"] for o in with_floor["options"]] == [o["p"] for o in on_empty["options"]]
    assert with_floor["floor_residual"] == on_empty["residual"]
    assert "floor_p" in floored["options"][0]


def test_processed_token_limit_counts_contents_questions_and_floors(engine):
    engine = Engine(engine.model, engine.buckets)  # no floors cached yet
    body = _many_inputs(1)
    plan = Scorer(engine).plan(body)
    total = sum(len(tree) for tree in plan.trees)
    assert len(plan.floor_keys) > 0  # floors are part of what is counted
    assert Scorer(engine, Limits(max_request_tokens=total)).plan(body).trees == plan.trees
    with pytest.raises(ScoringError) as e:
        Scorer(engine, Limits(max_request_tokens=total - 1)).plan(body)
    assert e.value.code == "too_many_tokens" and e.value.param is None


def test_floor_skipped_when_asked(engine):
    body = copy.deepcopy(SPEC_EXAMPLE)
    body["scoring"]["empty_floor"] = False
    r = engine.score(body)
    assert r["usage"]["prompt_tokens_details"]["floor_tokens"] == 0
    combo = _options(r, 0, "refund")
    assert "floor_residual" not in combo and "floor_p" not in combo["options"][0]


def test_floors_are_cached_across_calls():
    # A new engine: no floors cached yet.
    engine = Engine(engines.model("spinf/smollm2-135m-instruct"), Buckets((256, 512), block=64))
    first = engine.score(SPEC_EXAMPLE)
    second = engine.score(SPEC_EXAMPLE)
    assert first["usage"]["prompt_tokens_details"]["floor_tokens"] > 0
    assert second["usage"]["prompt_tokens_details"]["floor_tokens"] == 0
    assert second["results"] == first["results"]


def test_unknown_pack_is_a_clear_error(engine):
    with pytest.raises(ScoringError) as e:
        engine.score({**SPEC_EXAMPLE, "packs": [{"id": "nobody/missing"}]})
    assert e.value.code == "unknown_pack"


def test_buckets_must_hold_two_row_tiles_at_least(engine):
    # A one-tile pass would be an inlined loop, which rounds differently from the loop body.
    model = engine.model.with_row_tile(256)
    for sizes in ((256, 1024), (512, 640)):
        with pytest.raises(ValueError, match="multiple of 256 and at least 512"):
            Engine(model, Buckets(sizes))
    Engine(model, Buckets((512, 1024)))


def test_a_row_tile_given_to_load_reaches_the_model_and_the_fingerprint():
    tiny = str(engines.TINY / "llama")
    tiled = Engine.load(tiny, "fp32", row_tile=64, buckets=Buckets((256,)))
    assert tiled.model.row_tile == 64 and tiled.fingerprint_parts["row_tile"] == "64"
    assert Engine.load(tiny, "fp32", buckets=Buckets((256,))).fingerprint != tiled.fingerprint
    with pytest.raises(ValueError, match="multiple of 256 and at least 512"):
        Engine.load(tiny, "fp32", row_tile=256, buckets=Buckets((256,)))


def test_bucket_program_can_be_inspected(engine):
    memory = engine.lowered(256).compile().memory_analysis()
    assert memory.temp_size_in_bytes > 0


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_pass_temporaries_do_not_grow_with_depth(family):
    """XLA once kept every layer's tile-loop outputs alive at once (18 GiB in a 16k-token pass of a 12B
    model): a pass's buffers beyond the weights must not grow with the number of layers."""
    config = json.loads((TINY / family / "config.json").read_text())

    def temporaries(layers: int) -> int:
        cfg_dict = {**config, "num_hidden_layers": layers}
        if family == "gemma3":
            cfg_dict["layer_types"] = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6)
        model = Model("abstract", abstract_decoder(cfg_dict, Precision.FP32), None, digest="abstract")
        engine = Engine(model, Buckets((256,), block=32))
        return engine.lowered(256).compile().memory_analysis().temp_size_in_bytes

    # Twice the layers: kept-alive outputs would double the temporaries. Two repeats of the 6-layer period
    # against four: one repeat would be no loop at all (XLA inlines a loop that runs once), and a loop holds
    # one repeat's weights sliced out of the stack, the same at any depth.
    shallow, deep = temporaries(12), temporaries(24)
    assert deep <= shallow * 1.05, (shallow, deep)


def test_a_launch_queued_behind_another_keeps_at_most_two_passes_on_the_device(engine, monkeypatch):
    """Engine.launch(behind=): the server's runner queues a full batch behind the last pass of the one
    before. The passes of both count towards IN_FLIGHT: the new launch waits for the older launch's oldest
    passes (it does not read them back: their launcher does), then reads its own oldest, so no more than
    two passes are ever on the device. Every tree of both launches gets its results. The device is a fake
    here: each pass's output is ready once something waits for it."""
    on_device, read, most = [], [], [0]

    class Output:
        def __init__(self):
            self.ready = False

        def is_ready(self):
            return self.ready

        def block_until_ready(self):
            self.ready = True
            return self

    def launch_pass(p):
        most[0] = max(most[0], sum(not o.ready for o in on_device) + 1)
        on_device.append(Output())
        return (on_device[-1],)

    def results(p, output):  # reading a pass back waits for it
        output.block_until_ready()
        read.append(on_device.index(output))
        return np.zeros(8, np.float32), np.zeros(8, np.int32)

    monkeypatch.setattr(engine, "_launch_pass", launch_pass)
    monkeypatch.setattr(engine, "_results", results)
    trees = [build_tree([2], [10 + i], []) for i in range(6)]
    one_each = SimpleNamespace(  # a pass per tree
        passes=lambda n: [
            SimpleNamespace(tree_ids=[t], target_offset=[0], read_offset=[0], size=256) for t in range(n)
        ]
    )
    first = engine.launch(trees[:3], one_each)
    assert len(first.running) == 2  # the third pass read the first back
    second = engine.launch(trees[3:], one_each, behind=first)
    assert most[0] == 2 and first.running  # the first's passes were waited for, not read back
    assert all(o.ready for o in on_device[:4])
    assert [s.tree for s in engine.collect(first) + engine.collect(second)] == trees
    assert sorted(read) == list(range(6))  # every pass read back once
