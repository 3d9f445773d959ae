"""How a pack's answers become scores, categories and a decision (docs/prompt-packs.md).

A question's value is its positive option's p (renormalised over the options), or its lift p - floor_p; a
question with placeholders averages its combinations. Its score is that value calibrated against normal
traffic: a z-score (mean, std) or the fraction of normal traffic below it (percentiles), else the value as
it is. A category combines its cells' scores (weighted mean, or the largest weighted score); every rule whose
category reaches its threshold fires, and the decision is the gravest label among them (the first label when
none fires).
"""

from dataclasses import dataclass

import numpy as np

from spinf_jax.packs.format import Baseline, Category, Pack, PackQuestion, Rule


@dataclass(frozen=True)
class CellScore:
    question: str
    value: float  # p or lift, averaged over combinations
    score: float  # calibrated
    p: float  # the positive option's p (averaged over combinations)
    floor_p: float | None


def value(
    question: PackQuestion, p: np.ndarray, floor_p: np.ndarray | None
) -> tuple[float, float, float | None]:
    """(value, positive p, positive floor_p) of one combination: p and floor_p over the question's options."""
    k = question.options.index(question.positive)
    floor = None if floor_p is None else float(floor_p[k])
    if question.measure == "lift":
        if floor is None:
            raise ValueError(f"question {question.id!r} measures lift and needs its floor")
        return float(p[k]) - floor, float(p[k]), floor
    return float(p[k]), float(p[k]), floor


def calibrate(baseline: Baseline | None, v: float) -> float:
    if baseline is None:
        return v
    if baseline.percentiles is not None:
        ranks = np.linspace(0.0, 1.0, len(baseline.percentiles))
        return float(np.interp(v, baseline.percentiles, ranks))
    return (v - baseline.mean) / baseline.std


def cell(question: PackQuestion, combos: list[tuple[np.ndarray, np.ndarray | None]]) -> CellScore:
    """A question's cell from its combinations' (p over options, floor_p over options or None)."""
    parts = [value(question, p, floor_p) for p, floor_p in combos]
    v = float(np.mean([x[0] for x in parts]))
    floors = [x[2] for x in parts]
    floor = None if any(f is None for f in floors) else float(np.mean(floors))
    return CellScore(
        question.id, v, calibrate(question.baseline, v), float(np.mean([x[1] for x in parts])), floor
    )


def category_score(category: Category, cells: dict[str, CellScore]) -> float:
    weights = np.array([c.weight for c in category.cells])
    scores = np.array([cells[c.question].score for c in category.cells])
    if category.combine == "max":
        return float(np.max(weights * scores))
    return float(np.sum(weights * scores) / np.sum(weights))


def decide(pack: Pack, scores: dict[str, float]) -> tuple[str, list[Rule]]:
    """The decision over the categories scored (rules about other categories do not fire): the gravest
    label of the rules that fire, and those rules."""
    labels = pack.decision.labels
    fired = [r for r in pack.decision.rules if r.category in scores and scores[r.category] >= r.at_least]
    label = max((r.label for r in fired), key=labels.index, default=labels[0])
    return label, fired
