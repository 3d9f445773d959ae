"""Trees, packing and invariance at the token level (no text): tiny fixtures of every stack, fp32, CPU."""

from pathlib import Path

import numpy as np
import pytest

from spinf_jax.engine import Engine
from spinf_jax.layout import QuestionKey, build_tree
from spinf_jax.loader import load_model
from spinf_jax.models.layers import TreeBatch
from spinf_jax.packer import Buckets, content_trees, pack

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
BOS = 2
QUESTIONS = [
    QuestionKey((11, 12, 13), ((40,), (41,))),
    QuestionKey((14, 15), ((50, 51, 52), (50, 51, 53), (50, 60), (70,))),  # shared option prefixes
    QuestionKey((16,) * 20, ((80, 81), (82, 83, 84, 85, 86))),  # long enough to cross the sliding window
]


@pytest.fixture(scope="module", params=["gemma3", "qwen3", "gemma4", "gemma4-e2b", "gemma4-keqv"])
def engine(request):
    return Engine(load_model(str(TINY / request.param), "fp32"), Buckets((256, 512, 1024), block=32))


def _sequence_logprob(model, ids: list[int], option: tuple[int, ...]) -> float:
    """log P(option | ids) from a plain forward of the whole sequence: the definition being checked."""
    seq = ids + list(option)
    hidden = model.hidden(TreeBatch.sequence(seq))
    rows = np.arange(len(ids) - 1, len(seq) - 1)
    lp, _ = model.logprobs(hidden[rows], np.asarray(option, np.int32)[:, None])
    return float(np.sum(np.asarray(lp, np.float64)))


def _content(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 500, n).tolist()


def test_tree_scores_equal_plain_sequences(engine):
    content = _content(0, 23)
    [scored] = engine.score_trees([build_tree([BOS], content, QUESTIONS)])
    for qi, q in enumerate(QUESTIONS):
        ours = scored.option_logprobs(qi)
        for oi, option in enumerate(q.option_ids):
            expected = _sequence_logprob(engine.model, [BOS, *content, *q.template_ids], option)
            assert ours[oi] == pytest.approx(expected, abs=1e-4), (qi, oi)


def test_scores_bit_identical_alone_packed_and_in_other_buckets(engine):
    target = build_tree([BOS], _content(1, 40), QUESTIONS)
    others = [build_tree([BOS], _content(s, 7 + 13 * s), QUESTIONS[s % 3 :]) for s in range(2, 9)]
    alone = engine.score_trees([target])[0].logprobs
    packed_last = engine.score_trees([*others, target])[-1].logprobs
    packed_middle = engine.score_trees([*others[:3], target, *others[3:]])[3].logprobs
    bigger_bucket = Engine(engine.model, Buckets((1024,), block=32)).score_trees([target])[0].logprobs
    again = engine.score_trees([target])[0].logprobs
    for other in (packed_last, packed_middle, bigger_bucket, again):
        np.testing.assert_array_equal(other, alone)


def test_floor_equals_empty_content(engine):
    q = QUESTIONS[1]
    floor = engine.score_trees([build_tree([BOS], [], [q])])[0].option_logprobs(0)
    for oi, option in enumerate(q.option_ids):
        assert floor[oi] == pytest.approx(
            _sequence_logprob(engine.model, [BOS, *q.template_ids], option), abs=1e-4
        )


def test_big_content_splits_into_trees_that_each_fit():
    buckets = Buckets((256, 512), block=32)
    questions = [QuestionKey((20 + i,) * 30, ((40,), (41,))) for i in range(40)]
    trees = content_trees([BOS], _content(3, 50), questions, buckets)
    assert len(trees) > 1
    assert sum(len(t.options) for t, _ in trees) == len(questions)
    assert [first for _, first in trees] == np.cumsum([0] + [len(t.options) for t, _ in trees[:-1]]).tolist()
    passes = pack([t for t, _ in trees], buckets)
    assert all(p.size in buckets.sizes for p in passes)
    assert sorted(i for p in passes for i in p.tree_ids) == list(range(len(trees)))


def test_tree_layout_is_depth_first_with_spans():
    options = ((1, 2, 3), (1, 4), (5,), (6, 7, 8))
    tree = build_tree([BOS], [7, 8], [QuestionKey((9,), options), QuestionKey((10,), ((3,),))])
    # trunk, template 9, trie nodes (1,) → (1, 2) and (6,) → (6, 7), then the second question's template
    assert tree.tokens == [BOS, 7, 8, 9, 1, 2, 6, 7, 10]
    assert tree.positions == [0, 1, 2, 3, 4, 5, 4, 5, 3]
    assert tree.span_end == [9, 9, 9, 8, 6, 6, 8, 8, 9]
    assert tree.read_rows == [3, 4, 5, 6, 7, 8]
    # option (1, 2, 3): read 1 at the template end, 2 at node (1,), 3 at node (1, 2); (5,) one read
    assert [tree.targets[i] for i in tree.options[0][0]] == [(0, 1), (1, 2), (2, 3)]
    assert [tree.targets[i] for i in tree.options[0][1]] == [(0, 1), (1, 4)]
    assert [tree.targets[i] for i in tree.options[0][2]] == [(0, 5)]
    assert [tree.targets[i] for i in tree.options[1][0]] == [(5, 3)]
