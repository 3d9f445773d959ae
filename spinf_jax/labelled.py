"""Labelled rows for `spinf-jax calibrate`: read from JSON Lines, scored with the model, grouped by workload.

A row is a decision, as /decide takes it, with its answer:

    {"id": "r1", "state": "...", "question": "...", "options": [{"id": "a", "description": "..."}, ...],
     "label": "a", "group": "doc-17", "workload": "triage"}

or a closed question as /v1/score asks it, with the right option's text:

    {"content": "...", "template": "...Answer:{?}", "options": [" yes", " no"], "label": " yes"}

`group` (optional) keeps rows of one source in one fold and one bootstrap draw; `workload` (optional) names
the workload the row calibrates, else the command's --workload.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spinf_jax import api, calibration
from spinf_jax.decisions import Decider
from spinf_jax.decoding import convert
from spinf_jax.scoring import Scorer

BATCH = 32  # rows whose trees share passes


class RowError(Exception):
    pass


@dataclass
class Row:
    line: int
    body: dict  # a /decide body or a /v1/score body
    kind: str  # "decision" or "score"
    label: int  # the right option's index
    group: str | None
    workload: str


def read_rows(path: str | Path, workload: str, orderings: str | None) -> list[Row]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                rows.append(_row(n, line, workload, orderings, f"{path}:{n}"))
    if not rows:
        raise RowError(f"{path}: no rows")
    return rows


def _row(n: int, line: str, workload: str, orderings: str | None, where: str) -> Row:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise RowError(f"{where}: not JSON: {e}") from None
    if not isinstance(raw, dict) or "label" not in raw:
        raise RowError(f"{where}: a row is an object with a label")
    group = None if raw.get("group") is None else str(raw["group"])
    workload = raw.get("workload") or workload
    if "question" in raw:
        ids = [o.get("id") for o in raw.get("options") or [] if isinstance(o, dict)]
        if raw["label"] not in ids:
            raise RowError(f"{where}: label {raw['label']!r} is not one of the option ids {ids}")
        body = {k: raw[k] for k in ("state", "question", "options") if k in raw}
        body |= {"id": str(raw.get("id", n)), "orderings": orderings}
        return Row(n, body, "decision", ids.index(raw["label"]), group, workload)
    if "template" in raw:
        options = raw.get("options") or []
        if raw["label"] not in options:
            raise RowError(f"{where}: label {raw['label']!r} is not one of the options {options}")
        body = {
            "messages": [{"content": raw.get("content", "")}],
            "scoring": {"queries": [{"id": "q", "template": raw["template"], "options": options}]},
        }  # fmt: skip
        return Row(n, body, "score", options.index(raw["label"]), group, workload)
    raise RowError(
        f"{where}: a row is a decision (state, question, options) or a question (content, template)"
    )


def score_rows(
    decider: Decider, scorer: Scorer, rows: list[Row], progress=None
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Each row's log-probabilities over its options (a decision's combined over its orderings when it has
    them), and a question's over its floor (None for a decision), in order. Rows are planned in batches
    whose trees share passes."""
    engine = decider.engine
    for start in range(0, len(rows), BATCH):
        batch = rows[start : start + BATCH]
        planned = []
        for row in batch:
            try:
                if row.kind == "decision":
                    planned.append((decider, decider.plan(_decide_body(row.body))))
                else:
                    planned.append((scorer, scorer.plan(row.body)))
            except Exception as e:
                raise RowError(f"row on line {row.line}: {e}") from e
        scored = engine.score_trees([tree for _, plan in planned for tree in plan.trees])
        k = 0
        for (owner, plan), row in zip(planned, batch, strict=True):
            result = owner.finish(plan, scored[k : k + len(plan.trees)])
            k += len(plan.trees)
            yield _logprobs(result, row.kind)
        if progress is not None:
            progress.update(len(batch))


def _decide_body(body: dict) -> api.DecideRequest:
    return convert(body, api.DecideRequest)


def _logprobs(result, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    if kind == "decision":
        p = result.combined.probabilities if result.combined is not None else result.probabilities
        return np.log(np.asarray(p)), None
    options = result.results[0].queries[0].combinations[0].options
    return np.array([o.logprob for o in options]), np.log([o.floor_p for o in options])


def fit_workload(
    scored: list[tuple[np.ndarray, np.ndarray | None, Row]], orderings: str | None, target: float, draws: int
) -> tuple[dict, list[np.ndarray], list[np.ndarray]]:
    """One workload's entry of the calibration file (calibration.report, plus, for questions, the choice rule
    and per-option thresholds), with the rows' probabilities before and after (out of fold) for the plot."""
    groups = [row.group for *_, row in scored]
    if all(g is None for g in groups):
        groups = None
    else:  # a row without a group is a group of its own
        groups = [
            g if g is not None else f"row-{row.line}" for g, (*_, row) in zip(groups, scored, strict=True)
        ]
    labelled = [(lp, row.label) for lp, _, row in scored]
    summary, raw, fitted = calibration.report(labelled, groups, draws)
    kinds = {row.kind for *_, row in scored}
    summary |= {"kind": "/".join(sorted(kinds)), "orderings": orderings if "decision" in kinds else None}
    if kinds == {"score"}:
        accuracy = calibration.rule_accuracy([(lp, floor, row.label) for lp, floor, row in scored])
        summary["rule_accuracy"] = accuracy
        summary["rule"] = "floor_lift" if accuracy["floor_lift"] > accuracy["argmax"] else "argmax"
        options = {tuple(row.body["scoring"]["queries"][0]["options"]) for *_, row in scored}
        if len(options) == 1:  # thresholds are per option text: only where every row lists the same options
            p = [calibration.apply_temperature(lp, summary["temperature"]) for lp, _ in labelled]
            report = calibration.thresholds(p, [y for _, y in labelled], list(options.pop()), target)
            summary["target_precision"] = target
            summary["threshold_report"] = report
            summary["thresholds"] = {option: entry["threshold"] for option, entry in report.items()}
    return summary, raw, fitted
