"""Labelled rows for `spinf-jax calibrate`: read from JSON Lines, scored with the model, grouped by workload.

A row is a decision, as /decide takes it, with its answer:

    {"id": "r1", "state": "...", "question": "...", "options": [{"id": "a", "description": "..."}, ...],
     "label": "a", "group": "doc-17", "workload": "triage"}

or a closed question as /v1/score asks it, with the right option's text:

    {"content": "...", "template": "...Answer:{?}", "options": [" yes", " no"], "label": " yes"}

or a typed question as System One asks it, with the right answer (a noul's true or false, a choice's option
name, a score's level number); these calibrate the file's temperatures by question type (or option count),
not a workload:

    {"state": "...", "question": {"type": "choice", "instructions": "...", "criteria": {...}}, "label": "..."}

`group` (optional) keeps rows of one source in one fold and one bootstrap draw; `workload` (optional) names
the workload the row calibrates, else the command's --workload.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spinf_jax import api, calibration, systemone
from spinf_jax.decision_apis import DecisionApis, systemone_questions
from spinf_jax.decisions import Decider
from spinf_jax.decoding import convert
from spinf_jax.errors import ScoringError
from spinf_jax.scoring import Scorer

BATCH = 32  # rows whose trees share passes


class RowError(Exception):
    pass


@dataclass
class Row:
    line: int
    body: dict  # a /decide body, a /v1/score body or a /v1/systemone body
    kind: str  # "decision", "score" or "typed" (then `workload` is the question's type)
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
    if isinstance(raw.get("question"), dict):
        return _typed_row(n, raw, group, orderings, where)
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


def _typed_row(n: int, raw: dict, group: str | None, orderings: str | None, where: str) -> Row:
    body = {"state": raw.get("state"), "questions": {"q": raw["question"]}, "x_orderings": orderings}
    try:
        (question,) = systemone_questions(convert(body, systemone.SystemOneRequest).questions)[1]
    except ScoringError as e:
        field = e.param.replace("questions.q", "question", 1)
        raise RowError(f"{where}: {field}: {e.message}") from None
    label = raw["label"]
    key = {True: "true", False: "false"}.get(label) if question.kind == "noul" else str(label)
    wanted = {"noul": "true or false", "choice": "one of the option names", "score": "a level number"}
    if key not in question.names or (question.kind == "score" and not isinstance(label, int)):
        raise RowError(f"{where}: label {label!r}: a {question.kind}'s label is {wanted[question.kind]}")
    return Row(n, body, "typed", question.names.index(key), group, question.kind)


def score_rows(
    decider: Decider, scorer: Scorer, rows: list[Row], progress=None, apis: DecisionApis | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Each row's log-probabilities over its options (a decision's or a typed question's combined over its
    orderings when it has them), and a question's over its floor (None for the others), in order. Rows are
    planned in batches whose trees share passes; typed rows need `apis`."""
    engine = decider.engine
    for start in range(0, len(rows), BATCH):
        batch = rows[start : start + BATCH]
        planned = []
        for row in batch:
            try:
                if row.kind == "decision":
                    planned.append((decider.finish, decider.plan(_decide_body(row.body))))
                elif row.kind == "typed":
                    body = convert(row.body, systemone.SystemOneRequest)
                    planned.append((_typed_answer(apis), apis.plan_systemone(body)))
                else:
                    planned.append((scorer.finish, scorer.plan(row.body)))
            except Exception as e:
                raise RowError(f"row on line {row.line}: {e}") from e
        scored = engine.score_trees([tree for _, plan in planned for tree in plan.trees])
        k = 0
        for (finish, plan), row in zip(planned, batch, strict=True):
            result = finish(plan, scored[k : k + len(plan.trees)])
            k += len(plan.trees)
            yield _logprobs(result, row.kind)
        if progress is not None:
            progress.update(len(batch))


def _typed_answer(apis: DecisionApis):
    def finish(planned, scored):
        ((answer,),) = apis.reader.answers(planned.plan, scored)
        return answer

    return finish


def _decide_body(body: dict) -> api.DecideRequest:
    return convert(body, api.DecideRequest)


def _logprobs(result, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    if kind == "typed":  # the combination where orderings were asked, as the answer reports it
        return np.log(np.asarray(result.probabilities)), None
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
    summary |= {
        "kind": "/".join(sorted(kinds)),
        "orderings": orderings if kinds & {"decision", "typed"} else None,
    }
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


def fit_by_options(scored: list[tuple[np.ndarray, np.ndarray | None, Row]]) -> tuple[dict, dict]:
    """Typed rows' temperature as a function of their option count, T(n) = max(min, a + b·ln n) (the
    calibration file's temperature_by_options): a temperature fitted by NLL for each count, then a and b by
    least squares on ln n, each count weighted by its rows. Needs rows of at least two counts. Returns the
    file's entry, and each count's rows and temperature."""
    counts: dict[int, list[tuple[np.ndarray, int]]] = {}
    for lp, _, row in scored:
        counts.setdefault(len(lp), []).append((lp, row.label))
    if len(counts) < 2:
        raise calibration.CalibrationError(
            f"temperatures by option count need rows of at least two option counts (all have {min(counts)})"
        )
    ns = sorted(counts)
    ts = [calibration.fit_temperature(counts[n]) for n in ns]
    weights = np.sqrt([len(counts[n]) for n in ns])
    design = np.stack([np.ones(len(ns)), np.log(ns)], axis=1) * weights[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.array(ts) * weights, rcond=None)
    per_count = {str(n): {"rows": len(counts[n]), "temperature": t} for n, t in zip(ns, ts, strict=True)}
    return {"a": float(a), "b": float(b), "min": calibration.MIN_T}, per_count
