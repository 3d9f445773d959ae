"""Per-workload temperatures: one number T per workload that turns a model's option probabilities into
calibrated ones, p_cal ∝ p^(1/T), fitted by NLL on that workload's labelled rows. T > 0 never changes
which option is most likely: calibration changes how sure an answer says it is, not the answer.

The calibration file (written by `spinf-jax calibrate`, read by `spinf-jax serve --calibration`) is JSON:

    {"version": 1, "model": ..., "system_fingerprint": ..., "workloads": {name: {"temperature": T, ...}}}

Typed questions (the decision APIs' noul / choice / score) may also take temperatures by type and by option
count, as decision checkpoints ship them (decider's decider_config.json), at the file's top level:

    "temperature": T,                                        every typed answer
    "temperature_by_type": {"noul": T, "choice": T, "score": T},   a missing type uses "temperature"
    "temperature_by_options": {"a": a, "b": b, "min": m}     T(n) = max(m, a + b·ln n) for n options; it
                                                             replaces the two above

A request's workload, where it names one, comes first. A file needs workloads, typed temperatures, or both.

It is checked fail-closed: a file that is missing, does not parse, or holds a T that is not a finite number
in [MIN_T, MAX_T] stops the server from starting.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MIN_T, MAX_T = 0.05, 20.0
BINS = 10  # top-label ECE's equal-width confidence bins
FOLDS = 5


class CalibrationError(Exception):
    pass


RULES = ("argmax", "floor_lift")


@dataclass(frozen=True)
class Workload:
    temperature: float
    orderings: str | None = None  # the orderings its rows were scored with (the file's "orderings")
    # For /v1/score queries: how the choice is made (the most likely option, or the one most lifted over its
    # floor: log p - log floor_p), and per option text the calibrated p at which its precision reached the
    # target on the labelled rows.
    rule: str = "argmax"
    thresholds: dict[str, float] = field(default_factory=dict)


TYPES = ("noul", "choice", "score")


@dataclass(frozen=True)
class TypedTemperatures:
    """Temperatures of typed answers by type and option count (the module's docstring)."""

    temperature: float | None = None
    by_type: dict[str, float] = field(default_factory=dict)
    by_options: tuple[float, float, float] | None = None  # (a, b, min): T(n) = max(min, a + b·ln n)

    def for_question(self, kind: str, options: int) -> float | None:
        if self.by_options is not None:
            a, b, least = self.by_options
            return min(MAX_T, max(least, a + b * math.log(options)))
        return self.by_type.get(kind, self.temperature)

    def __bool__(self) -> bool:
        return self.temperature is not None or bool(self.by_type) or self.by_options is not None


@dataclass(frozen=True)
class Calibration:
    workloads: dict[str, Workload]
    path: str = ""
    typed: TypedTemperatures = field(default_factory=TypedTemperatures)


def load_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file; raises CalibrationError naming the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: expected a JSON object")
    typed = _typed(data, str(path))
    workloads = data.get("workloads", {} if typed else None)
    if not isinstance(workloads, dict) or not (workloads or typed):
        raise CalibrationError(
            f"{path}: workloads: expected an object of at least one workload (or typed temperatures)"
        )
    checked = {name: _workload(entry, f"{path}: workloads.{name}") for name, entry in workloads.items()}
    return Calibration(checked, str(path), typed)


def _temperature(value, where: str) -> float:
    if not _is_number(value) or not MIN_T <= value <= MAX_T:
        raise CalibrationError(f"{where}: expected a finite number in [{MIN_T}, {MAX_T}], got {value!r}")
    return float(value)


def _typed(data: dict, path: str) -> TypedTemperatures:
    t = data.get("temperature")
    t = None if t is None else _temperature(t, f"{path}: temperature")
    by_type = data.get("temperature_by_type") or {}
    if not isinstance(by_type, dict) or set(by_type) - set(TYPES):
        raise CalibrationError(
            f"{path}: temperature_by_type: expected {{type: T}} with types {', '.join(TYPES)}"
        )
    by_type = {k: _temperature(v, f"{path}: temperature_by_type.{k}") for k, v in by_type.items()}
    by_options = data.get("temperature_by_options")
    if by_options is not None:
        where = f"{path}: temperature_by_options"
        if not isinstance(by_options, dict) or not {"a", "b"} <= set(by_options) <= {"a", "b", "min"}:
            raise CalibrationError(f'{where}: expected {{"a": ..., "b": ..., "min"?: ...}}')
        a, b = by_options["a"], by_options["b"]
        if not (_is_number(a) and _is_number(b)):
            raise CalibrationError(f"{where}: a and b must be finite numbers")
        least = _temperature(by_options.get("min", MIN_T), f"{where}.min")
        by_options = (float(a), float(b), least)
    return TypedTemperatures(t, by_type, by_options)


def _workload(entry, where: str) -> Workload:
    entry = entry if isinstance(entry, dict) else {}
    t = entry.get("temperature")
    if not _is_number(t) or not MIN_T <= t <= MAX_T:
        raise CalibrationError(
            f"{where}.temperature: expected a finite number in [{MIN_T}, {MAX_T}], got {t!r}"
        )
    orderings = entry.get("orderings")
    if orderings not in (None, "rotations", "all"):
        raise CalibrationError(f"{where}.orderings: {orderings!r} is not rotations or all")
    rule = entry.get("rule", "argmax")
    if rule not in RULES:
        raise CalibrationError(f"{where}.rule: {rule!r} is not one of {', '.join(RULES)}")
    thresholds = entry.get("thresholds") or {}
    if not isinstance(thresholds, dict) or not all(
        _is_number(v) and 0 <= v <= 1 for v in thresholds.values()
    ):
        raise CalibrationError(f"{where}.thresholds: expected {{option: a probability}}")
    return Workload(float(t), orderings, rule, {k: float(v) for k, v in thresholds.items()})


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def apply_temperature(logprobs: np.ndarray, temperature: float) -> np.ndarray:
    """Probabilities ∝ exp(logprobs / T) over the options (log-probabilities or logits: shifts cancel)."""
    z = np.asarray(logprobs, np.float64) / temperature
    w = np.exp(z - np.max(z))
    return w / np.sum(w)


# ---------------------------------------------------------------------------------------------------------
# Fitting and measuring. Rows are (log-probabilities over their options, index of the right option); rows
# may have different numbers of options.


def nll(rows: list[tuple[np.ndarray, int]], temperature: float = 1.0) -> float:
    return float(np.mean([-math.log(max(apply_temperature(lp, temperature)[y], 1e-300)) for lp, y in rows]))


def fit_temperature(rows: list[tuple[np.ndarray, int]]) -> float:
    """The T in [MIN_T, MAX_T] of least NLL. NLL is convex in 1/T (a log-sum-exp minus a linear term), so a
    golden-section search over 1/T finds its minimum on the interval."""
    lo, hi = 1 / MAX_T, 1 / MIN_T
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(rows, 1 / a), nll(rows, 1 / b)
    for _ in range(80):  # the interval shrinks by 0.618 a step: 80 steps leave ~1e-16 of it
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = nll(rows, 1 / a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(rows, 1 / b)
    return float(1 / ((lo + hi) / 2))


def metrics(probabilities: list[np.ndarray], labels: list[int]) -> dict[str, float]:
    """Accuracy, balanced accuracy (mean recall over the labels present), NLL, Brier (squared error over all
    options, summed per row, averaged), and top-label ECE over BINS equal-width bins."""
    top = np.array([int(np.argmax(p)) for p in probabilities])
    y = np.array(labels)
    right = top == y
    conf = np.array([float(np.max(p)) for p in probabilities])
    recalls = [float(np.mean(right[y == label])) for label in np.unique(y)]
    brier = [float(np.sum((p - np.eye(len(p))[t]) ** 2)) for p, t in zip(probabilities, labels, strict=True)]
    bins = np.minimum((conf * BINS).astype(int), BINS - 1)
    ece = sum(
        abs(float(np.mean(right[bins == b])) - float(np.mean(conf[bins == b]))) * np.mean(bins == b)
        for b in range(BINS)
        if np.any(bins == b)
    )
    return {
        "accuracy": float(np.mean(right)),
        "balanced_accuracy": float(np.mean(recalls)),
        "nll": float(
            np.mean([-math.log(max(p[t], 1e-300)) for p, t in zip(probabilities, labels, strict=True)])
        ),
        "brier": float(np.mean(brier)),
        "ece": float(ece),
    }


def folds(n: int, groups: list[str] | None, k: int = FOLDS, seed: int = 0) -> np.ndarray:
    """Each row's fold; rows of one group share a fold (group-disjoint), assigned in a seeded shuffle."""
    rng = np.random.default_rng(seed)
    keys = groups if groups is not None else [str(i) for i in range(n)]
    distinct = sorted(set(keys))
    fold_of = dict(zip(distinct, rng.permutation(len(distinct)) % k, strict=True))
    return np.array([fold_of[key] for key in keys])


def out_of_fold(
    rows: list[tuple[np.ndarray, int]], groups: list[str] | None
) -> tuple[list[np.ndarray], list[float]]:
    """Each row's probabilities under the temperature fitted on the other folds, and those temperatures."""
    if len(set(groups if groups is not None else range(len(rows)))) < 2:
        raise CalibrationError("out-of-fold measurement needs rows of two groups at least")
    assigned = folds(len(rows), groups)
    calibrated: list[np.ndarray | None] = [None] * len(rows)
    temperatures = []
    for fold in range(FOLDS):
        held = np.flatnonzero(assigned == fold)
        if len(held) == 0 or len(held) == len(rows):
            continue
        t = fit_temperature([rows[i] for i in np.flatnonzero(assigned != fold)])
        temperatures.append(t)
        for i in held:
            calibrated[i] = apply_temperature(rows[i][0], t)
    return calibrated, temperatures


def bootstrap(
    probabilities: list[np.ndarray],
    labels: list[int],
    groups: list[str] | None,
    draws: int = 1000,
    seed: int = 0,
) -> dict[str, list[float]]:
    """95% percentile intervals of every metric, resampling rows (or whole groups, when rows have them)."""
    rng = np.random.default_rng(seed)
    keys = groups if groups is not None else [str(i) for i in range(len(labels))]
    members: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    units = list(members.values())
    samples: dict[str, list[float]] = {}
    for _ in range(draws):
        picked = [i for u in rng.integers(0, len(units), len(units)) for i in units[u]]
        for name, value in metrics([probabilities[i] for i in picked], [labels[i] for i in picked]).items():
            samples.setdefault(name, []).append(value)
    return {
        name: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] for name, v in samples.items()
    }


def reliability_plot(curves: dict[str, tuple[list[np.ndarray], list[int]]], path: Path, title: str) -> None:
    """A reliability diagram (accuracy against confidence per bin) of each named set of predictions."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the plot goes to a file
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfectly calibrated")
    for name, (probabilities, labels) in curves.items():
        conf = np.array([float(np.max(p)) for p in probabilities])
        right = np.array([int(np.argmax(p)) == y for p, y in zip(probabilities, labels, strict=True)])
        bins = np.minimum((conf * BINS).astype(int), BINS - 1)
        used = [b for b in range(BINS) if np.any(bins == b)]
        ax.plot(
            [float(np.mean(conf[bins == b])) for b in used],
            [float(np.mean(right[bins == b])) for b in used],
            marker="o",
            label=f"{name} (ECE {metrics(probabilities, labels)['ece']:.3f})",
        )
    ax.set(
        xlabel="confidence (top option's probability)",
        ylabel="accuracy",
        xlim=(0, 1),
        ylim=(0, 1),
        title=title,
    )
    ax.legend(loc="upper left")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def report(
    rows: list[tuple[np.ndarray, int]], groups: list[str] | None, draws: int = 1000
) -> tuple[dict, list[np.ndarray], list[np.ndarray]]:
    """What `spinf-jax calibrate` writes for one workload: T fitted on every row, and the metrics before and
    after temperature scaling measured out of fold, each with its bootstrap interval; with the rows'
    probabilities before and after (out of fold), for the plot."""
    raw = [apply_temperature(lp, 1.0) for lp, _ in rows]
    labels = [y for _, y in rows]
    calibrated, fold_temperatures = out_of_fold(rows, groups)
    return (
        {
            "temperature": fit_temperature(rows),
            "rows": len(rows),
            "groups": len(set(groups)) if groups is not None else None,
            "fold_temperatures": fold_temperatures,
            "before": metrics(raw, labels),
            "before_ci95": bootstrap(raw, labels, groups, draws),
            "after_out_of_fold": metrics(calibrated, labels),
            "after_out_of_fold_ci95": bootstrap(calibrated, labels, groups, draws),
        },
        raw,
        calibrated,
    )


def thresholds(
    probabilities: list[np.ndarray], labels: list[int], options: list[str], target: float
) -> dict[str, dict]:
    """Per option: the lowest calibrated p at which "p ≥ threshold" picks rows of that option with precision
    ≥ target, with its precision and recall; options that never reach the target are left out."""
    out = {}
    for j, option in enumerate(options):
        p = np.array([float(q[j]) for q in probabilities])
        positive = np.array(labels) == j
        for t in np.unique(p):  # ascending: the first that reaches the target keeps the most recall
            picked = p >= t
            precision = float(np.mean(positive[picked]))
            if precision >= target:
                recall = float(np.sum(picked & positive) / max(1, np.sum(positive)))
                out[option] = {"threshold": float(t), "precision": precision, "recall": recall}
                break
    return out


def rule_accuracy(rows: list[tuple[np.ndarray, np.ndarray, int]]) -> dict[str, float]:
    """Accuracy of picking the most likely option, and the option most lifted over its floor (log p - log
    floor_p), over rows of (log-probabilities, floor log-probabilities, label)."""
    return {
        "argmax": float(np.mean([int(np.argmax(lp)) == y for lp, _, y in rows])),
        "floor_lift": float(np.mean([int(np.argmax(lp - fl)) == y for lp, fl, y in rows])),
    }


def table(name: str, summary: dict) -> str:
    """The report of one fit ("workload triage", "type choice"), as a few lines of text."""
    lines = [f"{name}: T = {summary['temperature']:.4g} over {summary['rows']} rows"]
    lines.append(f"  {'metric':<18}{'raw':>24}{'after T (out of fold)':>28}")
    for metric in ("accuracy", "balanced_accuracy", "nll", "brier", "ece"):
        cells = []
        for key in ("before", "after_out_of_fold"):
            lo, hi = summary[key + "_ci95"][metric]
            cells.append(f"{summary[key][metric]:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"  {metric:<18}{cells[0]:>24}{cells[1]:>28}")
    return "\n".join(lines)
