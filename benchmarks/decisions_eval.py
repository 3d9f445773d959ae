"""Typed decisions on public labelled sets, through the server: what option-order averaging and a fitted
temperature change, with 95% bootstrap intervals. Not run in CI.

For each model and each set (benchmarks/data, made by make_eval_sets.py), it starts `spinf-jax serve` on a
free port and sends every row with `orderings: "rotations"` (16 requests in flight) as a decision to /decide
(mode "decide": SemIf's direct-options-v1 prompt, letters read), as a question to /v1/score whose template
lists the options (mode "score", TEMPLATES below: the options' own words read), and as a System One choice
to /v1/systemone (mode "systemone": the typed-options-v1 prompt, labels read; "systemone-prior": the same
with `x_prior`, each row's answer over the question's answer on an empty state; "systemone-names" and
"systemone-names-prior": the same under the typed-names-v1 contract, the options' names read). Per model,
set and mode it measures:
- accuracy and balanced accuracy of the options as listed (`probabilities`) and order-averaged (`combined`),
  with a paired bootstrap interval of the difference;
- ECE, NLL and Brier before and after a temperature, out of fold (spinf_jax.calibration.report: 5 folds,
  group-disjoint where rows carry a group), for both;
- `combined.agreement` as a confidence signal: accuracy of unanimous rows (every ordering picks the same
  option) against split rows.

    uv run --extra server --extra models python benchmarks/decisions_eval.py --out FILE

Prints a table per model and set and ends with one JSON line; --out writes the JSON too.
"""

import argparse
import json
import shlex
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from common import write_cpu_document
from server_process import start_server, stop_server, wait_ready

from spinf_jax import calibration

DATA = Path(__file__).resolve().parent / "data"
MODELS = ["spinf/smollm2-135m-instruct", "spinf/gemma-3-270m"]
SETS = ["review_sentiment", "boolq"]


def read_set(name: str, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


# The same rows as /v1/score questions, for mode "score": the content is the state, the template lists the
# options where {options} stands, and the options are the row's option ids with a leading space.
TEMPLATES = {
    "review_sentiment": "\n\nThe sentiment of this review ({options}):{?}",
    "boolq": "\n\nQuestion: {question}\nAnswer ({options}):{?}",
}


def ask(url: str, rows: list[dict], mode: str, name: str) -> list[dict]:
    """Every row through the server (16 requests in flight) with orderings "rotations": per row, the option
    ids, their probabilities as listed, and `combined`."""

    def decide(row: dict) -> dict:
        body = {k: row[k] for k in ("id", "state", "question", "options")} | {"orderings": "rotations"}
        reply = post("/decide", body)
        return {k: reply[k] for k in ("option_ids", "probabilities", "combined")}

    def score(row: dict) -> dict:
        ids = [o["id"] for o in row["options"]]
        query = {
            "id": "q",
            "template": TEMPLATES[name],
            "options": [" " + i for i in ids],
            "orderings": "rotations",
        }
        if "{question}" in query["template"]:
            query["combinations"] = [{"question": row["question"]}]
        combination = post(
            "/v1/score", {"messages": [{"content": row["state"]}], "scoring": {"queries": [query]}}
        )["results"][0]["queries"][0]["combinations"][0]
        return {"option_ids": ids, "probabilities": [o["p"] for o in combination["options"]],
                "combined": combination["combined"]}  # fmt: skip

    def systemone(row: dict, prior: bool, contract: str = "typed-options-v1") -> dict:
        ids = [o["id"] for o in row["options"]]
        question = {"type": "choice", "instructions": row["question"],
                    "criteria": {o["id"]: o["description"] for o in row["options"]}}  # fmt: skip
        body = {
            "state": row["state"],
            "questions": {"q": question},
            "x_orderings": "rotations",
            "x_prior": prior,
            "x_contract": contract,
        }
        answer = post("/v1/systemone", body)["answers"]["q"]
        listed = [answer["x_listed"][i] for i in ids]
        combined = [answer["probabilities"][i] for i in ids]
        if prior:  # the listed order over its floor, as a request without orderings would answer
            floor = np.array([answer["x_floor"][i] for i in ids])
            listed = list(np.array(listed) / floor / np.sum(np.array(listed) / floor))
        return {"option_ids": ids, "probabilities": listed,
                "combined": {"probabilities": combined, "agreement": answer["x_agreement"]}}  # fmt: skip

    def post(path: str, body: dict) -> dict:
        response = httpx.post(f"{url}{path}", json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    ask_row = {
        "decide": decide,
        "score": score,
        "systemone": lambda row: systemone(row, False),
        "systemone-prior": lambda row: systemone(row, True),
        "systemone-names": lambda row: systemone(row, False, "typed-names-v1"),
        "systemone-names-prior": lambda row: systemone(row, True, "typed-names-v1"),
    }[mode]
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask_row, rows))


def paired_difference(a: np.ndarray, b: np.ndarray, groups: list[str], draws: int = 2000) -> list[float]:
    """95% bootstrap interval of mean(b) - mean(a) over the same rows, resampling whole groups."""
    rng = np.random.default_rng(0)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    units = list(members.values())
    diffs = []
    for _ in range(draws):
        picked = [i for u in rng.integers(0, len(units), len(units)) for i in units[u]]
        diffs.append(float(np.mean(b[picked]) - np.mean(a[picked])))
    return [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]


def interval(right: np.ndarray, draws: int = 2000) -> list[float] | None:
    if len(right) == 0:
        return None
    rng = np.random.default_rng(0)
    means = [float(np.mean(right[rng.integers(0, len(right), len(right))])) for _ in range(draws)]
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def evaluate(rows: list[dict], replies: list[dict]) -> dict:
    labels = [r["option_ids"].index(row["label"]) for row, r in zip(rows, replies, strict=True)]
    # Sets whose rows are one-per-source (no group, or a group per row) resample rows.
    groups = [row.get("group") or row["id"] for row in rows]
    if len(set(groups)) < 20:  # a handful of big groups (e.g. three review sites) is no basis for folds
        groups = [row["id"] for row in rows]
    listed = [np.log(np.asarray(r["probabilities"])) for r in replies]
    averaged = [np.log(np.asarray(r["combined"]["probabilities"])) for r in replies]
    out = {}
    for name, logprobs in (("listed", listed), ("averaged", averaged)):
        summary, _, _ = calibration.report(list(zip(logprobs, labels, strict=True)), groups, draws=1000)
        out[name] = summary
    right_listed = np.array([int(np.argmax(lp)) == y for lp, y in zip(listed, labels, strict=True)], float)
    right_averaged = np.array(
        [int(np.argmax(lp)) == y for lp, y in zip(averaged, labels, strict=True)], float
    )
    out["averaging_gain"] = {
        "accuracy": float(np.mean(right_averaged) - np.mean(right_listed)),
        "ci95": paired_difference(right_listed, right_averaged, groups),
    }
    agreement = np.array([r["combined"]["agreement"] for r in replies])
    unanimous = agreement == 1.0
    out["agreement"] = {
        "unanimous_rows": int(np.sum(unanimous)),
        "unanimous_accuracy": float(np.mean(right_averaged[unanimous])) if unanimous.any() else None,
        "unanimous_ci95": interval(right_averaged[unanimous]),
        "split_rows": int(np.sum(~unanimous)),
        "split_accuracy": float(np.mean(right_averaged[~unanimous])) if (~unanimous).any() else None,
        "split_ci95": interval(right_averaged[~unanimous]),
    }
    out["first_letter_share"] = float(np.mean([np.argmax(r["probabilities"]) == 0 for r in replies]))
    out["rows"] = len(rows)
    return out


def print_table(model: str, name: str, result: dict) -> None:
    print(f"\n{model} on {name} ({result['rows']} rows)")
    print(f"  {'':<30}{'listed order':>26}{'order-averaged':>26}")
    for metric in ("accuracy", "balanced_accuracy"):
        cells = [
            f"{result[k]['before'][metric]:.3f} [{result[k]['before_ci95'][metric][0]:.3f}, "
            f"{result[k]['before_ci95'][metric][1]:.3f}]"
            for k in ("listed", "averaged")
        ]
        print(f"  {metric:<30}{cells[0]:>26}{cells[1]:>26}")
    for metric in ("ece", "nll", "brier"):
        for stage, label in (("before", "raw"), ("after_out_of_fold", "after T, out of fold")):
            cells = [
                f"{result[k][stage][metric]:.3f} [{result[k][stage + '_ci95'][metric][0]:.3f}, "
                f"{result[k][stage + '_ci95'][metric][1]:.3f}]"
                for k in ("listed", "averaged")
            ]
            print(f"  {metric + ' (' + label + ')':<30}{cells[0]:>26}{cells[1]:>26}")
    t = (result["listed"]["temperature"], result["averaged"]["temperature"])
    print(f"  temperature: listed {t[0]:.3f}, averaged {t[1]:.3f}")
    gain, (lo, hi) = result["averaging_gain"]["accuracy"], result["averaging_gain"]["ci95"]
    print(f"  averaging gain in accuracy: {gain:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    a = result["agreement"]
    print(
        f"  unanimous rows {a['unanimous_rows']}: accuracy {a['unanimous_accuracy']}; "
        f"split rows {a['split_rows']}: accuracy {a['split_accuracy']}"
    )
    print(
        f"  share of rows whose listed-order answer is the first option: {result['first_letter_share']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--sets", nargs="+", default=SETS)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["decide", "score", "systemone", "systemone-prior"],
        help="/decide prompts, /v1/score questions, /v1/systemone choices (plain, and over their floor; "
        "labels read, or with -names the options' names)",
    )
    parser.add_argument("--precision", default="fp32", help="serve's --precision")
    parser.add_argument("--limit", type=int, help="only the first N rows of each set")
    parser.add_argument("--serve-args", default="", help="more options for `spinf-jax serve`")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {}
    for model in args.models:
        log = Path(tempfile.mkstemp(suffix=".log")[1])
        serve_args = [model, "--precision", args.precision, *shlex.split(args.serve_args)]
        process, url = start_server(serve_args, log)
        try:
            health = wait_ready(url, process, timeout=1800)
            for name in args.sets:
                rows = read_set(name, args.limit)
                for mode in args.modes:
                    result = evaluate(rows, ask(url, rows, mode, name))
                    result["system_fingerprint"] = health["system_fingerprint"]
                    results[f"{model} {name} {mode}"] = result
                    print_table(model, f"{name}, {mode}", result)
        finally:
            stop_server(process)
    write_cpu_document(
        "decisions_eval", args.out, precision=args.precision, orderings="rotations", results=results
    )


if __name__ == "__main__":
    main()
