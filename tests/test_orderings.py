"""Option-order averaging on /v1/score queries: a template lists its options where {options} stands, every
ordering is a branch of the same read, and their log-mean does not depend on how the options are listed."""

import numpy as np
import pytest

from spinf_jax.calibration import Calibration, Workload, apply_temperature
from spinf_jax.errors import ScoringError
from spinf_jax.scoring import Scorer

CONTENT = [{"content": "I was charged twice for my order and want one payment refunded."}]
TOPIC = {
    "id": "topic",
    "template": "\n\nTopic ({options}):{?}",
    "options": [" billing", " shipping", " technical"],
}


@pytest.fixture(scope="module")
def scorer(gemma_engine):
    return Scorer(gemma_engine, calibration=Calibration({"w": Workload(1.7)}))


def _combination(scorer, *queries, **scoring) -> list:
    plan = scorer.plan({"messages": CONTENT, "scoring": {"queries": list(queries), **scoring}})
    response = scorer.finish(plan, scorer.engine.score_trees(plan.trees))
    return [q.combinations[0] for q in response.results[0].queries]


def test_each_ordering_is_the_query_asked_with_that_listing(scorer):
    [averaged] = _combination(scorer, TOPIC | {"orderings": "rotations"})
    listings = [
        "billing, shipping, technical",
        "shipping, technical, billing",
        "technical, billing, shipping",
    ]
    alone = _combination(
        scorer, *({"id": f"r{k}", "template": f"\n\nTopic ({text}):{{?}}", "options": TOPIC["options"]}
                  for k, text in enumerate(listings)),
    )  # fmt: skip
    assert [o.logprob for o in averaged.options] == [o.logprob for o in alone[0].options]
    assert [o.floor_p for o in averaged.options] == [o.floor_p for o in alone[0].options]
    each = np.array([[o.p for o in c.options] for c in alone])
    expected = apply_temperature(np.mean(np.log(each), axis=0), 1.0)
    combined = averaged.combined
    assert combined.orderings == 3 and combined.method == "log-mean"
    np.testing.assert_allclose(combined.probabilities, expected, rtol=1e-12)
    assert combined.top == TOPIC["options"][int(np.argmax(expected))]
    top = int(np.argmax(expected))
    assert combined.agreement == pytest.approx(float(np.mean(np.argmax(each, axis=1) == top)))


@pytest.mark.parametrize("which, relisted", [("all", [2, 0, 1]), ("rotations", [1, 2, 0])])
def test_the_combination_does_not_depend_on_the_listing(scorer, which, relisted):
    options = TOPIC["options"]
    first, second = (
        _combination(scorer, TOPIC | {"orderings": which, "options": o, "workload": "w"})[0]
        for o in (options, [options[i] for i in relisted])
    )
    for block in ("combined", "calibrated"):
        by_text = [dict(zip([o.text for o in c.options], getattr(c, block).probabilities, strict=True))
                   for c in (first, second)]  # fmt: skip
        assert by_text[0] == by_text[1], block
    calibrated = first.calibrated.probabilities
    assert calibrated == pytest.approx(list(apply_temperature(np.log(first.combined.probabilities), 1.7)))
    assert first.calibrated.choice == first.combined.top


def test_orderings_and_combinations(scorer):
    query = {"id": "q", "template": "\n\nIs this about {thing} ({options})?{?}", "options": [" yes", " no"],
             "orderings": "all", "combinations": [{"thing": "money"}, {"thing": "weather"}]}  # fmt: skip
    plan = scorer.plan({"messages": CONTENT, "scoring": {"queries": [query]}})
    response = scorer.finish(plan, scorer.engine.score_trees(plan.trees))
    combinations = response.results[0].queries[0].combinations
    assert [c.values for c in combinations] == [{"thing": "money"}, {"thing": "weather"}]
    assert all(c.combined.orderings == 2 for c in combinations)


@pytest.mark.parametrize(
    "query, code, param",
    [
        (TOPIC | {"template": "\n\nTopic:{?}", "orderings": "all"}, "invalid_template",
         "scoring.queries[0].template"),
        ({"id": "m", "template": "{options} A:{*}", "orderings": "all"}, "invalid_request",
         "scoring.queries[0].orderings"),
        (TOPIC | {"options": [" a", " b", " c", " d", " e"], "orderings": "all"}, "too_many_orderings",
         "scoring.queries[0].orderings"),
        (TOPIC | {"orderings": "all", "combinations": [{"options": "x"}]}, "unknown_placeholder",
         "scoring.queries[0].combinations[0].options"),
    ],
)  # fmt: skip
def test_ordering_errors(scorer, query, code, param):
    with pytest.raises(ScoringError) as e:
        scorer.plan({"messages": CONTENT, "scoring": {"queries": [query]}})
    assert (e.value.code, e.value.param) == (code, param), e.value.message
