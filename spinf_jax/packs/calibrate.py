"""`spinf-jax packs calibrate`: a pack's baselines from normal traffic, and its thresholds from labelled rows.

1. Every row is scored with the pack (cells asked for), so each cell's raw value (p, lift or log-lift) is
   known per row.
2. Baselines: each cell's mean and standard deviation over the normal traffic; a cell's score then is its
   z-score, and a category's score the weighted mean of those.
3. Thresholds, from labelled rows (`{"text", "categories": [...]}`) with the normal traffic as negatives:
   for each rule, the lowest category score whose precision reaches the rule label's target. A rule no
   threshold can give that precision is dropped (and the report says so).
4. The report: per category, positives, base rate, AUC (ties count half), and each rule's threshold with the
   precision and recall it has on these rows.

Rows are JSON Lines with "text" (or "messages", as in a request).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import yaml

from spinf_jax.packs.format import Baseline, CalibratedOn, CalibrationData, Pack, Rule
from spinf_jax.packs.rules import calibrate, category_score
from spinf_jax.scoring import Scorer

BATCH = 16  # rows per request


@dataclass(frozen=True)
class Row:
    messages: list[dict]
    categories: tuple[str, ...] = ()


def read_rows(path: str | Path, labelled: bool = False) -> list[Row]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages = item.get("messages") or [{"role": "user", "content": item["text"]}]
            categories = tuple(item.get("categories", ())) if labelled else ()
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f'{path}:{n}: a row is a JSON object with "text" (or "messages"): {e}') from None
        rows.append(Row(messages, categories))
    return rows


def cell_values(scorer: Scorer, pack_id: str, rows: list[Row], progress=None) -> np.ndarray:
    """[rows, cells]: each cell's raw value per row, cells in the pack's order (category by category)."""
    out = []
    for start in range(0, len(rows), BATCH):
        batch = rows[start : start + BATCH]
        body = {
            "inputs": [{"messages": r.messages} for r in batch],
            "packs": [{"id": pack_id, "cells": True}],
        }
        for result in scorer.score(body)["results"]:
            out.append([c["value"] for c in result["packs"][0]["cells"]])
        if progress is not None:
            progress.update(len(batch))
    return np.array(out, np.float64)


def baselines(values: np.ndarray) -> list[Baseline]:
    """One baseline per cell (column): mean and std over the normal rows, so a cell's score is a z-score.
    Percentiles would saturate: every value above the largest normal one scores 1, which ties the clear
    cases with each other and left no threshold for several categories when the official packs were first
    calibrated with them."""
    std = np.maximum(values.std(axis=0), 1e-6)  # a cell constant on normal traffic still has a scale
    return [
        Baseline(mean=round(float(m), 6), std=round(float(s), 6), items=len(values))
        for m, s in zip(values.mean(axis=0), std, strict=True)
    ]


def with_baselines(pack: Pack, found: list[Baseline]) -> Pack:
    it = iter(found)
    categories = [
        msgspec.structs.replace(
            c, cells=[msgspec.structs.replace(cell, baseline=next(it)) for cell in c.cells]
        )
        for c in pack.categories
    ]
    return msgspec.structs.replace(pack, categories=categories)


def category_scores(pack: Pack, values: np.ndarray) -> dict[str, np.ndarray]:
    """Per category, its score on every row [rows], from raw cell values and the pack's baselines."""
    scores, k = {}, 0
    for category in pack.categories:
        n = len(category.cells)
        per_row = []
        for row in values[:, k : k + n]:
            cells = [calibrate(c.baseline, v) for c, v in zip(category.cells, row, strict=True)]
            per_row.append(category_score(category, cells))
        scores[category.id] = np.array(per_row)
        k += n
    return scores


def auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """The probability that a positive row outscores a negative one (ties half); None without both."""
    pos, neg = scores[positive], scores[~positive]
    if len(pos) == 0 or len(neg) == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def threshold(scores: np.ndarray, positive: np.ndarray, target: float) -> tuple[float, float, float] | None:
    """The lowest score at which (score ≥ it) has precision ≥ target: (threshold, precision, recall)."""
    for t in np.unique(scores):
        fired = scores >= t
        precision = positive[fired].mean()
        if precision >= target:
            return float(t), float(precision), float(positive[fired].sum() / max(positive.sum(), 1))
    return None


def calibrate_pack(
    scorer: Scorer,
    pack: Pack,
    normal: list[Row],
    labelled: list[Row],
    targets: dict[str, float],
    progress=None,
) -> tuple[Pack, dict]:
    """The pack with baselines (and, with labelled rows, thresholds), and the report."""
    values_normal = cell_values(scorer, pack.id, normal, progress)
    calibrated = with_baselines(pack, baselines(values_normal))
    report: dict = {"pack": pack.id, "normal_items": len(normal), "labelled_items": len(labelled)}
    rules = list(pack.decision.rules)
    if labelled:
        values = np.concatenate([cell_values(scorer, pack.id, labelled, progress), values_normal])
        scores = category_scores(calibrated, values)
        tags = [set(r.categories) for r in labelled] + [set() for _ in normal]
        rules, report["categories"] = [], []
        for category in calibrated.categories:
            positive = np.array([category.id in t for t in tags])
            line = {"id": category.id, "positives": int(positive.sum()), "base_rate": float(positive.mean()),
                    "auc": auc(scores[category.id], positive), "rules": []}  # fmt: skip
            for rule in (r for r in pack.decision.rules if r.category == category.id):
                found = (
                    threshold(scores[category.id], positive, targets[rule.label]) if positive.any() else None
                )
                if found is None:
                    line["rules"].append(
                        {
                            "label": rule.label,
                            "dropped": f"no threshold has precision ≥ {targets[rule.label]}",
                        }
                    )
                    continue
                at, precision, recall = found
                rules.append(
                    Rule(
                        category=category.id,
                        at_least=at,
                        label=rule.label,
                        precision=precision,
                        recall=recall,
                    )
                )
                line["rules"].append(
                    {"label": rule.label, "at_least": at, "precision": precision, "recall": recall}
                )
            report["categories"].append(line)
    model = scorer.engine.model
    calibrated = msgspec.structs.replace(
        calibrated,
        decision=msgspec.structs.replace(pack.decision, rules=rules),
        calibrated_on=[
            CalibratedOn(
                model=model.name, fingerprint=scorer.engine.fingerprint, precision=model.precision.value
            )
        ],
        calibration=CalibrationData(
            source=pack.calibration.source if pack.calibration else "unnamed",
            normal_items=len(normal),
            labelled_items=len(labelled),
            notes=pack.calibration.notes if pack.calibration else "",
        ),
    )
    return calibrated, report


def default_targets(pack: Pack) -> dict[str, float]:
    """Precision asked of each label's rules: 0.9 for the gravest, 0.7 for the others."""
    labels = pack.decision.labels
    return {label: 0.9 if label == labels[-1] else 0.7 for label in labels}


def write_pack(pack: Pack, path: Path) -> None:
    """The pack as YAML (or JSON for a .json path), absent fields left out."""
    data = _without_nulls(msgspec.to_builtins(pack))
    if path.suffix == ".json":
        path.write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n")
        return
    path.write_text(yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110))


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class _Dumper(yaml.SafeDumper):
    """Strings with a newline (templates) in double quotes with escapes, as the official packs write them."""


_Dumper.add_representer(
    list,
    lambda dumper, items: dumper.represent_sequence(
        "tag:yaml.org,2002:seq", items, flow_style=all(not isinstance(i, (dict, list)) for i in items)
    ),
)
_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style='"' if "\n" in text or text[:1] == " " else None
    ),
)


def report_table(report: dict) -> str:
    lines = [
        f"{report['pack']}: {report['normal_items']} normal rows, {report['labelled_items']} labelled rows"
    ]
    if "categories" in report:
        lines.append(f"{'category':<24}{'pos':>5}{'base':>7}{'AUC':>7}  rules (threshold, precision, recall)")
        for c in report["categories"]:
            auc_text = "  -  " if c["auc"] is None else f"{c['auc']:.3f}"
            rules = "; ".join(
                f"{r['label']}: dropped ({r['dropped']})" if "dropped" in r
                else f"{r['label']} ≥ {r['at_least']:.3f} (P {r['precision']:.2f}, R {r['recall']:.2f})"
                for r in c["rules"]
            )  # fmt: skip
            lines.append(f"{c['id']:<24}{c['positives']:>5}{c['base_rate']:>7.3f}{auc_text:>7}  {rules}")
    return "\n".join(lines)
