"""Trees, packing and invariance at the token level (no text): tiny fixtures of every stack, fp32, CPU."""

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spinf_jax.engine import Engine, Scored
from spinf_jax.layout import (
    KEEP_NONE,
    KEEP_SLOT,
    KEEP_TRUNK,
    START_RUNNING,
    START_SLOT,
    START_TRUNK,
    START_ZERO,
    Extract,
    QuestionKey,
    build_tree,
    question_chunks,
)
from spinf_jax.models.layers import TreeBatch
from spinf_jax.packer import Buckets, content_trees, cut, pack, read_trees
from tests import engines
from tests.trees import POOL

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
BOS = 2
QUESTIONS = [
    QuestionKey((11, 12, 13), ((40,), (41,))),
    QuestionKey((14, 15), ((50, 51, 52), (50, 51, 53), (50, 60), (70,))),  # shared option prefixes
    QuestionKey((16,) * 20, ((80, 81), (82, 83, 84, 85, 86))),  # long enough to cross the sliding window
]


FAMILIES = [
    "gemma3",
    "qwen3",
    "gemma4",
    "gemma4-e2b",
    "gemma4-keqv",
    "qwen3_5",
    "qwen3_moe",
    "gemma4-moe",
]


def _engine(family: str, precision: str) -> Engine:
    return engines.engine(family, precision, (256, 512, 1024), block=32)


def test_option_logprobs_sum_each_options_targets_as_numpy_does():
    """Scored.option_logprobs sums every option of a tree at once; each sum has the bits of np.sum over that
    option's targets in float64 (what it was before), for options of one to five tokens side by side."""
    tree = build_tree([BOS], [5, 6, 7], QUESTIONS)
    logprobs = -np.random.default_rng(0).exponential(3.0, len(tree.targets)).astype(np.float32)
    scored = Scored(tree, logprobs, np.zeros(len(tree.read_rows), np.int32))
    for i, options in enumerate(tree.options):
        want = [np.sum(logprobs[idx], dtype=np.float64) for idx in options]
        assert scored.option_logprobs(i).tobytes() == np.array(want).tobytes()


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request):
    return _engine(request.param, "fp32")


# bf16 for every stack but the mixtures of experts, whose layers are those of their dense families (each here
# in bf16) but for the experts, which round per token like any row-local work: fp32 there keeps CI's compile
# time down. Qwen3.5 MoE is Qwen3.5's layers (here) with Qwen3 MoE's experts (here): parity only
# (tests/test_parity.py), for the same reason.
MOE = ("qwen3_moe", "gemma4-moe")
PRECISIONS = [(f, "fp32") for f in FAMILIES] + [(f, "bf16") for f in FAMILIES if f not in MOE]


@pytest.fixture(scope="module", params=PRECISIONS, ids=str)
def any_engine(request):
    return _engine(*request.param)


def _sequence_logprob(model, ids: list[int], option: tuple[int, ...]) -> float:
    """log P(option | ids) from a plain forward of the whole sequence: the definition being checked."""
    seq = ids + list(option)
    hidden = model.hidden(TreeBatch.sequence(seq))
    rows = np.arange(len(ids) - 1, len(seq) - 1)
    lp, _ = model.logprobs(hidden[rows], np.asarray(option, np.int32)[:, None])
    return float(np.sum(np.asarray(lp, np.float64)))


def _content(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 500, n).tolist()


# A tree's scores equal plain forwards through attention and recurrence: the mixtures of experts' feed-forward
# is row-local, and their attention is their dense families' (here), so they are left out of this one.
@pytest.fixture(scope="module", params=[f for f in FAMILIES if f not in MOE])
def dense_engine(request):
    return _engine(request.param, "fp32")


def test_tree_scores_equal_plain_sequences(dense_engine):
    engine = dense_engine
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
    # Trees start on 16-row boundaries: packed, the target shares its first attention block with another.
    offsets = [o for p in pack([*others, target], engine.buckets) for o in p.row_offset]
    assert offsets[-1] % engine.buckets.block and all(o % engine.buckets.align == 0 for o in offsets)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data())
def test_question_scores_bit_identical_whatever_else_is_asked(any_engine, data):
    """A (content, question) score is the same bits whatever other questions the content is asked, in any
    order, duplicated, whatever else shares the pass (another content, the same content with other questions,
    empty content), in any bucket; and a question's floor is its score on empty content among others."""
    content = _content(11, 37)
    full = any_engine.score_trees([build_tree([BOS], content, POOL)])[0]
    want = {q: full.option_logprobs(i) for i, q in enumerate(POOL)}
    floors = {}
    picked = data.draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=12), label="questions")
    neighbour = data.draw(st.sampled_from(["none", "other content", "same content", "empty content"]))
    target = build_tree([BOS], content, picked)
    companions = {
        "none": [],
        "other content": [build_tree([BOS], _content(12, 90), POOL[::2])],
        "same content": [build_tree([BOS], content, POOL[::-3])],
        "empty content": [build_tree([BOS], [], picked[::-1])],
    }[neighbour]
    before = data.draw(st.booleans(), label="companions first")
    trees = [*companions, target] if before else [target, *companions]
    scored = any_engine.score_trees(trees)[len(companions) if before else 0]
    for i, q in enumerate(picked):
        np.testing.assert_array_equal(scored.option_logprobs(i), want[q], err_msg=str(q))
    if neighbour == "empty content":
        on_empty = any_engine.score_trees(trees)[0 if before else 1]
        for i, q in enumerate(picked[::-1]):
            if q not in floors:
                floors[q] = any_engine.score_trees([build_tree([BOS], [], [q])])[0].option_logprobs(0)
            np.testing.assert_array_equal(on_empty.option_logprobs(i), floors[q], err_msg=str(q))


def test_content_split_across_trees_scores_the_same_bits():
    """A content whose questions overflow the largest bucket is read once per tree; each question's score is
    the same as when all of them fit in one tree."""
    engine = _engine("gemma3", "fp32")
    content = _content(13, 60)
    questions = POOL * 3
    one_tree = engine.score_trees([build_tree([BOS], content, questions)])[0]
    split = content_trees([BOS], content, questions, Buckets((256,), block=32))
    assert len(split) > 1
    for (tree, first), scored in zip(split, engine.score_trees([t for t, _ in split]), strict=True):
        for i in range(len(tree.options)):
            np.testing.assert_array_equal(scored.option_logprobs(i), one_tree.option_logprobs(first + i))


def test_sequence_read_at_every_row_scores_the_same_bits_split_over_trees(engine):
    """Parity's trees: a plain sequence read at every row, one tree or several (reads over the bucket's
    capacity), the same bits either way, equal to plain forwards, with the argmax of each read."""
    ids = _content(21, 120)
    reads = {t: [ids[t + 1] if t + 1 < len(ids) else 7, 5, 9] for t in range(len(ids))}
    whole = read_trees(ids, reads, engine.buckets)
    # 360 targets: over the 256 a 256-row bucket holds at one target per row
    split = read_trees(ids, reads, Buckets((256,), block=32, targets_per_row=1))
    assert len(whole) == 1 and len(split) == 2
    [one] = engine.score_trees(whole)
    parts = engine.score_trees(split)
    assert [r for s in parts for r in s.tree.read_rows] == one.tree.read_rows == list(range(len(ids)))
    np.testing.assert_array_equal(
        np.concatenate([s.option_logprobs(i) for s in parts for i in range(len(s.tree.read_rows))]),
        np.concatenate([one.option_logprobs(i) for i in range(len(ids))]),
    )
    np.testing.assert_array_equal(np.concatenate([s.top_tokens for s in parts]), one.top_tokens)
    hidden = engine.model.hidden(TreeBatch.sequence(ids))
    lp, top = engine.model.logprobs(hidden[: len(ids)], np.asarray(list(reads.values()), np.int32))
    np.testing.assert_allclose(
        np.concatenate([one.option_logprobs(i) for i in range(len(ids))]), np.ravel(lp), atol=1e-4
    )
    np.testing.assert_array_equal(one.top_tokens, top)


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


def _partitions(n: int):
    """Every way to cut n trees, in order, into consecutive passes: lists of (start, end)."""
    if n == 0:
        yield []
        return
    for start in range(n):
        for rest in _partitions(start):
            yield [*rest, (start, n)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=7),
    overhead=st.sampled_from([0, 64, 256]),
    timed=st.none() | st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3),
)
def test_passes_are_the_cheapest_cut_of_the_trees_in_order(sizes, overhead, timed):
    """pack cuts the trees, in order, where the passes cost least (of equal costs, the fewest passes),
    against every possible cut; every tree lands once, in its order. A pass costs its rows plus a pass's
    overhead, or with measured times (Buckets.measured) what its bucket took."""
    buckets = Buckets((256, 512, 1024), block=64, pass_overhead=overhead)
    if timed is not None:
        buckets = buckets.measured(timed)
        assert list(buckets.pass_costs) == list(np.maximum.accumulate(timed))
    trees = [build_tree([BOS], _content(1, n), [QuestionKey((9, 9), ((40,), (41,)))]) for n in sizes]

    def cost(cut) -> tuple[float, int]:
        total = 0
        for start, end in cut:
            group = trees[start:end]
            used = (sum(buckets.aligned(len(t)) for t in group), sum(len(t.read_rows) for t in group),
                    sum(len(t.targets) for t in group))  # fmt: skip
            fitting = [s for s in buckets.sizes if buckets.fits(s, *used)]
            if not fitting:
                return (float("inf"), len(cut))
            total += buckets.cost(fitting[0])
        return (total, len(cut))

    passes = pack(trees, buckets)
    assert [i for p in passes for i in p.tree_ids] == list(range(len(trees)))
    got = (sum(buckets.cost(p.size) for p in passes), len(passes))
    best = min(cost(cut) for cut in _partitions(len(trees)))
    if timed is None:
        assert got == best
    else:  # sums of floats: two cuts of equal cost may differ in the last bit, so ties are not compared
        assert got[0] == pytest.approx(best[0])
    # The same search's cost for every prefix: what the server's runner weighs holding requests back by.
    # And the measured seconds of each prefix's last pass: when the runner expects the device to end it.
    cuts = cut(trees, buckets)
    assert len(cuts.cost) == len(trees) + 1 and cuts.cost[0] == 0
    for i in range(1, len(trees) + 1):
        prefix = pack(trees[:i], buckets)
        assert cuts.cost[i] == pytest.approx(sum(buckets.cost(p.size) for p in prefix))
        assert cuts.last_seconds(i) == (
            0.0 if timed is None else pytest.approx(buckets.cost(prefix[-1].size))
        )


def test_a_few_contents_take_small_passes_not_the_largest():
    """Four 1,200-token contents: two 4,096-row passes, not one of 16,384 (what filling the largest bucket
    gave); fifteen fill a 16,384-row pass again (it holds fourteen)."""
    buckets = Buckets((4096, 16384))
    contents = [
        build_tree([BOS], _content(i, 1150), [QuestionKey((9,) * 14, ((40,), (41,)))]) for i in range(15)
    ]
    assert buckets.largest // buckets.aligned(len(contents[0])) == 14
    assert [p.size for p in pack(contents[:4], buckets)] == [4096, 4096]
    assert [p.size for p in pack(contents, buckets)] == [4096, 16384]
    with pytest.raises(ValueError, match="does not fit the largest bucket"):
        pack([build_tree([BOS], _content(0, 20_000), [])], buckets)


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
    # each row's parent: the row before it on its path
    assert tree.parent == [-1, 0, 1, 2, 3, 4, 3, 6, 2]


def test_recurrent_chunks_start_from_their_own_questions_states():
    """Recurrent layers run the trunk in 64-row chunks from zeros, each template from the trunk's last state
    (a long one in chunks of its own), each run of whole option subtrees from its template's last state, and
    an empty template's options from the trunk's; nothing depends on the other questions."""
    questions = [
        QuestionKey((9,) * 70, ((1, 2, 3), (1, 4), (5,), (6, 7, 8))),
        QuestionKey((), ((3, 4), (5,))),
        QuestionKey((10,), ((3,),)),
    ]
    tree = build_tree([BOS], list(range(5, 105)), questions)  # trunk 101 rows
    assert tree.recurrent_chunks() == [
        (0, 64, START_ZERO, KEEP_NONE), (64, 37, START_RUNNING, KEEP_TRUNK),  # the trunk
        (101, 64, START_TRUNK, KEEP_NONE), (165, 6, START_RUNNING, KEEP_SLOT),  # a 70-token template
        (171, 4, START_SLOT, KEEP_NONE),  # its trie: (1,) → (1, 2), (6,) → (6, 7)
        (175, 1, START_TRUNK, KEEP_NONE),  # (3,) below the trunk's last row
        (176, 1, START_TRUNK, KEEP_NONE),  # a template with one-token options: no trie
    ]  # fmt: skip
    alone = build_tree([BOS], list(range(5, 105)), questions[:1]).recurrent_chunks()
    assert alone == tree.recurrent_chunks()[:5]
    # With no trunk at all the template starts from zeros; the rest is the same chunks, 101 rows earlier.
    on_empty = build_tree([], [], questions[:1]).recurrent_chunks()
    assert on_empty == [(0, 64, START_ZERO, KEEP_NONE), *((a - 101, *rest) for a, *rest in alone[3:])]
    assert sum(question_chunks(q) for q in questions) == 5


def test_recurrent_passes_hold_their_chunks_and_refuse_long_option_subtrees():
    """A pass of a recurrent model holds at most one chunk per 16 rows (each costs a step whether it holds
    rows or not): many small questions split passes that their rows alone would not; likewise at most
    max_slots extraction slots. Options sharing a first token whose subtree outgrows a chunk are refused
    with a clear error."""
    buckets = Buckets((256, 512), block=32, recurrent=True)
    questions = [QuestionKey((20 + i,), ((40,), (41,))) for i in range(40)]
    trees = [tree for tree, _ in content_trees([BOS], _content(3, 20), questions, buckets)]
    assert all(len(t.recurrent_chunks()) <= buckets.max_chunks(512) for t in trees) and len(trees) > 1
    # 96 rows, which one 256-row pass would hold, but 41 chunks: 32 fit in a 512-row pass, 16 in a 256-row one
    assert sum(buckets.aligned(len(t)) for t in trees) == 96
    assert [len(t.recurrent_chunks()) for t in trees] == [32, 10]
    assert [p.size for p in pack(trees, buckets)] == [512, 256]
    for p in pack(trees, buckets):
        assert (p.chunks[:, 1] > 0).sum() <= buckets.max_chunks(p.size) == len(p.chunks)
    # Each extraction slot hands its recurrent states to decoding: a pass holds max_slots of them.
    slots = [QuestionKey((30 + i,), extract=Extract()) for i in range(40)]
    trees = [tree for tree, _ in content_trees([BOS], [5], slots, Buckets((1024,), block=32, recurrent=True))]
    assert [len(t.slots) for t in trees] == [32, 8]
    passes = pack(trees, Buckets((1024,), block=32, recurrent=True))
    assert [len(p.tree_ids) for p in passes] == [1, 1] and all(len(p.export_rows) == 32 for p in passes)
    many = tuple((1, i, i + 100, 7) for i in range(2, 40))  # nodes (1,), (1, i), (1, i, i + 100): 77 rows
    with pytest.raises(ValueError, match="subtree of 77 tokens"):
        content_trees([BOS], [5], [QuestionKey((9,), many)], buckets)


def test_a_background_warmup_packs_into_each_bucket_once_it_is_compiled():
    """warmup(background=True), the server's start: the smallest and largest bucket compiled and timed at
    once, the middle one on a thread; until it is compiled trees go to the others, afterwards into it too,
    at a cost between the measured ones. Every tree keeps its bits throughout."""
    shared = _engine("qwen3", "fp32")  # (256, 512, 1024): every bucket compiled already
    engine = Engine(shared.model, shared.buckets)
    gate, program = threading.Event(), engine.program

    def held(size, args=None):  # the middle bucket's compile waits for the gate
        if size == 512 and args is None:
            assert gate.wait(60)
        return program(size, args)

    engine.program = held
    thread = engine.warmup(background=True)
    assert engine.buckets.sizes == (256, 1024) and engine.compiling == (512,)
    small, large = engine.buckets.pass_costs
    trees = [build_tree([BOS], _content(0, 300), QUESTIONS)]  # ~350 rows: a pass of 1,024, or of 512
    passes = []
    engine.on_pass = lambda size, seconds: passes.append(size)
    before = engine.score_trees(trees)
    gate.set()
    thread.join(60)
    assert engine.buckets.sizes == (256, 512, 1024) and engine.compiling == ()
    first, middle, last = engine.buckets.pass_costs  # the middle one interpolated, never out of order
    assert (first, last) == (small, large) and small <= middle <= large
    after = engine.score_trees(trees)
    assert passes == [1024, 512]
    expected = shared.score_trees(trees)
    # An engine over buckets that carry measured costs (a warmed engine's) packs and compiles as any other.
    again = Engine(engine.model, engine.buckets).score_trees(trees)
    for got in (before, after, again):
        for tree, want in zip(got, expected, strict=True):
            np.testing.assert_array_equal(tree.logprobs, want.logprobs)


def test_a_bucket_that_fails_to_compile_in_the_background_is_left_out(monkeypatch):
    """The server serves on without it, with an error line: the buckets compiled before ready hold every
    request."""
    shared = _engine("qwen3", "fp32")
    engine, program, logged = Engine(shared.model, shared.buckets), shared.program, []

    def failing(size, args=None):
        if size == 512 and args is None:
            raise MemoryError("no room to autotune")
        return program(size, args)

    engine.program = failing
    monkeypatch.setattr("spinf_jax.engine.log", lambda logger, event, level, **fields: logged.append(fields))
    engine.warmup(background=True).join(60)
    assert engine.buckets.sizes == (256, 1024) and engine.compiling == ()
    assert logged == [{"bucket": 512, "error": "MemoryError: no room to autotune"}]
