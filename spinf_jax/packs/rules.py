"""How a pack's answers become scores, categories and a decision (docs/prompt-packs.md).

A cell reads one option of one question: its p (renormalised over the question's options), its lift
p - floor_p, or its log-lift log p - log floor_p; a question with placeholders averages its combinations.
The cell's score is that value calibrated against normal traffic: a z-score (mean, std) or the fraction of
normal traffic below it (percentiles), else the value as it is. A category combines its cells' scores
(weighted mean, or the largest weighted score); every rule whose category reaches its threshold fires, and
the decision is the gravest label among them (the first label when none fires).
"""

import math
from dataclasses import dataclass

import numpy as np

from spinf_jax.packs.format import Baseline, Category, Cell, Pack, Rule

TINY = 1e-12  # floors of exactly 0 (an option the model never writes on empty content) stay finite


@dataclass(frozen=True)
class CellScore:
    question: str
    option: str
    value: float  # p, lift or log-lift, averaged over combinations
    score: float  # calibrated
    p: float  # the option's p (averaged over combinations)
    floor_p: float | None


def value(cell: Cell, p: float, floor_p: float | None) -> float:
    if cell.measure == "p":
        return p
    if floor_p is None:
        raise ValueError(f"a {cell.measure} cell of question {cell.question!r} needs its floor")
    if cell.measure == "lift":
        return p - floor_p
    return math.log(max(p, TINY)) - math.log(max(floor_p, TINY))


def calibrate(baseline: Baseline | None, v: float) -> float:
    if baseline is None:
        return v
    if baseline.percentiles is not None:
        ranks = np.linspace(0.0, 1.0, len(baseline.percentiles))
        return float(np.interp(v, baseline.percentiles, ranks))
    return (v - baseline.mean) / baseline.std


# Plain Python over a handful of floats: a pack answer has ~100 cells, and numpy's per-call cost on lists of
# one to a few values made these the server's largest host cost per pack request.


def cell_score(
    cell: Cell, options: list[str], combos: list[tuple[np.ndarray, np.ndarray | None]]
) -> CellScore:
    """A cell from its question's combinations: (p over the options, floor_p over the options or None)."""
    k = options.index(cell.option)
    ps = [float(p[k]) for p, _ in combos]
    floors = [None if f is None else float(f[k]) for _, f in combos]
    v = _mean([value(cell, p, f) for p, f in zip(ps, floors, strict=True)])
    floor = None if None in floors else _mean(floors)
    return CellScore(cell.question, cell.option, v, calibrate(cell.baseline, v), _mean(ps), floor)


def category_score(category: Category, scores: list[float]) -> float:
    """scores: its cells' calibrated scores, in the order of category.cells."""
    weighted = [c.weight * s for c, s in zip(category.cells, scores, strict=True)]
    if category.combine == "max":
        return max(weighted)
    return sum(weighted) / sum(c.weight for c in category.cells)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def decide(pack: Pack, scores: dict[str, float]) -> tuple[str, list[Rule]]:
    """The decision over the categories scored (rules about other categories do not fire): the gravest
    label of the rules that fire, and those rules."""
    labels = pack.decision.labels
    fired = [r for r in pack.decision.rules if r.category in scores and scores[r.category] >= r.at_least]
    label = max((r.label for r in fired), key=labels.index, default=labels[0])
    return label, fired
