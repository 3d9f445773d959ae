"""Temperature scaling: the fit, the metrics, the folds, the file, and `spinf-jax calibrate` end to end."""

import json
import math
import re

import numpy as np
import pytest

from spinf_jax import calibration as cal
from spinf_jax import cli, labelled
from spinf_jax.calibration import CalibrationError
from spinf_jax.errors import ScoringError
from spinf_jax.scoring import Scorer


def _synthetic(temperature: float, n: int = 4000, options: int = 3, seed: int = 1):
    """Rows whose labels are drawn from softmax(z / temperature): the right T to fit is `temperature`."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        z = rng.normal(0, 2, options)
        rows.append((z, int(rng.choice(options, p=cal.apply_temperature(z, temperature)))))
    return rows


@pytest.mark.parametrize("truth", [0.5, 1.0, 3.0])
def test_the_fit_recovers_the_temperature_that_made_the_labels(truth):
    assert cal.fit_temperature(_synthetic(truth)) == pytest.approx(truth, rel=0.12)


def test_the_fit_stays_in_bounds_and_minimises_nll():
    rows = _synthetic(1.8, n=500)
    t = cal.fit_temperature(rows)
    assert cal.nll(rows, t) <= min(cal.nll(rows, t * f) for f in (0.9, 1.1))
    separable = [(np.array([1.0, 0.0]), 0)] * 20  # always right: sharper is always better, down to MIN_T
    assert cal.fit_temperature(separable) == pytest.approx(cal.MIN_T, rel=1e-3)


def test_a_temperature_never_changes_the_answer():
    z = np.array([0.3, -1.2, 2.2, 0.0])
    for t in (0.05, 0.7, 20.0):
        p = cal.apply_temperature(z, t)
        assert int(np.argmax(p)) == 2 and math.isclose(float(np.sum(p)), 1.0)


def test_metrics_on_a_hand_checked_example():
    p = [np.array([0.9, 0.1]), np.array([0.6, 0.4]), np.array([0.2, 0.8]), np.array([0.7, 0.3])]
    labels = [0, 1, 1, 0]
    m = cal.metrics(p, labels)
    assert m["accuracy"] == 0.75
    assert m["balanced_accuracy"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.4) + math.log(0.8) + math.log(0.7)) / 4)
    assert m["brier"] == pytest.approx((0.02 + 0.72 + 0.08 + 0.18) / 4)
    # bins: 0.9 → [0.9, 1.0) right; 0.6 → [0.6, 0.7) wrong; 0.8 → [0.8, 0.9) right; 0.7 → [0.7, 0.8) right
    assert m["ece"] == pytest.approx((0.1 + 0.6 + 0.2 + 0.3) / 4)


def test_folds_keep_groups_together_and_out_of_fold_uses_other_rows():
    groups = [f"doc{i // 7}" for i in range(100)]
    folds = cal.folds(100, groups)
    for g in set(groups):
        assert len({f for f, h in zip(folds, groups, strict=True) if h == g}) == 1
    assert set(folds) == set(range(cal.FOLDS))
    rows = _synthetic(2.0, n=100)
    calibrated, temperatures = cal.out_of_fold(rows, groups)
    assert len(temperatures) == cal.FOLDS and all(p is not None for p in calibrated)
    with pytest.raises(CalibrationError):
        cal.out_of_fold(rows, ["one"] * 100)


def test_the_report_gains_on_miscalibrated_rows():
    """Overconfident scores (labels drawn at T = 3 from z): after T, NLL and ECE drop out of fold, accuracy
    stays, and the intervals hold the point estimates."""
    summary, raw, fitted = cal.report(_synthetic(3.0, n=600), None, draws=200)
    assert summary["temperature"] == pytest.approx(3.0, rel=0.3)
    before, after = summary["before"], summary["after_out_of_fold"]
    assert after["nll"] < before["nll"] and after["ece"] < before["ece"]
    assert after["accuracy"] == before["accuracy"]
    for key in ("before", "after_out_of_fold"):
        for metric, (lo, hi) in summary[key + "_ci95"].items():
            assert lo <= summary[key][metric] <= hi, (key, metric)


@pytest.mark.slow  # the command loads SmolLM2 itself
def test_calibrate_writes_a_file_the_server_accepts(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    texts = {"positive": ["I loved it.", "Wonderful, thank you!", "Great service."],
             "negative": ["I hated it.", "Terrible, never again.", "Awful service."]}  # fmt: skip
    with rows.open("w") as f:
        for label, items in texts.items():
            for i, text in enumerate(items):
                f.write(json.dumps({
                    "id": f"{label}{i}", "state": text, "question": "What is the sentiment?",
                    "options": [{"id": "positive", "description": "Positive"},
                                {"id": "negative", "description": "Negative"}],
                    "label": label, "group": f"g{i}",
                }) + "\n")  # fmt: skip
        f.write(json.dumps({"content": "Fine.", "template": "\n\nSentiment:{?}", "options": [" good", " bad"],
                            "label": " good", "workload": "questions"}) + "\n")  # fmt: skip
        f.write(json.dumps({"content": "Bad.", "template": "\n\nSentiment:{?}", "options": [" good", " bad"],
                            "label": " bad", "workload": "questions"}) + "\n")  # fmt: skip
        for text, label in [("I loved it.", True), ("I hated it.", False), ("Great!", True)]:
            question = {"type": "noul", "instructions": "Is the review positive?"}
            f.write(json.dumps({"state": text, "question": question, "label": label}) + "\n")
        for text, label in [
            ("Refund me.", "Billing"),
            ("It crashes.", "Technical"),
            ("Card declined.", "Billing"),
        ]:
            criteria = {"Billing": None, "Technical": None} | ({"Sales": None} if label == "Billing" else {})
            question = {"type": "choice", "instructions": "Which team?", "criteria": criteria}
            f.write(json.dumps({"state": text, "question": question, "label": label}) + "\n")
    out = tmp_path / "out" / "calibration.json"
    status = cli.main([
        "calibrate", str(rows), "--out", str(out), "--model", "spinf/smollm2-135m-instruct", "--precision",
        "fp32", "--orderings", "rotations", "--workload", "reviews", "--bootstrap", "50", "--by-options",
    ])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    document = json.loads(out.read_text())
    assert set(document["workloads"]) == {"reviews", "questions"}
    reviews = document["workloads"]["reviews"]
    assert reviews["rows"] == 6 and reviews["groups"] == 3 and reviews["orderings"] == "rotations"
    questions = document["workloads"]["questions"]
    assert questions["kind"] == "score" and questions["rule"] in ("argmax", "floor_lift")
    assert set(questions["rule_accuracy"]) == {"argmax", "floor_lift"}
    assert set(questions["thresholds"]) <= {" good", " bad"}
    assert (tmp_path / "out" / "calibration.reviews.png").read_bytes()[:4] == b"\x89PNG"
    loaded = cal.load_calibration(out)
    assert loaded.workloads["reviews"].temperature == reviews["temperature"]
    # Typed rows: a temperature per question type, and by option count (choices of 2 and 3, nouls of 2)
    assert set(document["temperature_by_type"]) == {"noul", "choice"}
    assert document["typed"]["choice"]["rows"] == 3 and document["prompt_version"] == "typed-options-v1"
    assert set(document["typed_by_options"]) == {"2", "3"}
    a, b = document["temperature_by_options"]["a"], document["temperature_by_options"]["b"]
    assert loaded.typed.for_question("choice", 3) == pytest.approx(max(cal.MIN_T, a + b * math.log(3)))
    assert (tmp_path / "out" / "calibration.type-noul.png").exists()
    printed = capsys.readouterr().out
    assert "workload reviews: T = " in printed and "type choice: T = " in printed


def test_calibrate_names_the_bad_row(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"state": "x", "question": "q", "options": [{"id": "a", "description": "A"}], "label": "b"}\n'
    )
    assert cli.main(["calibrate", str(rows), "--out", str(tmp_path / "c.json")]) == 2
    assert f"{rows}:1: label 'b' is not one of the option ids ['a']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("question", "label", "message"),
    [
        ({"type": "noul"}, True, "question.instructions: a noul needs instructions"),
        ({"type": "noul", "instructions": "?"}, "yes", "a noul's label is true or false"),
        ({"type": "choice", "criteria": {"a": None, "b": None}}, "c", "one of the option names"),
        ({"type": "score", "criteria": ["low", "high"]}, "1", "a level number"),
    ],
)
def test_a_bad_typed_row_is_named(tmp_path, question, label, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"state": "x", "question": question, "label": label}) + "\n")
    with pytest.raises(labelled.RowError, match=f"{rows}:1: .*{re.escape(message)}"):
        labelled.read_rows(rows, "default", None)


def test_temperatures_by_option_count_follow_a_line_in_ln_n():
    """Rows of 2, 4 and 8 options whose labels were drawn at T(n) = 0.5 + 0.7·ln n: the fit finds a line
    near it."""
    rng = np.random.default_rng(3)
    scored = []
    for n in (2, 4, 8):
        for _ in range(1500):
            lp = rng.normal(0, 2.5, n)
            label = int(rng.choice(n, p=cal.apply_temperature(lp, 0.5 + 0.7 * math.log(n))))
            scored.append((lp, None, labelled.Row(0, {}, "typed", label, None, "choice")))
    entry, per_count = labelled.fit_by_options(scored)
    assert entry["a"] == pytest.approx(0.5, abs=0.25) and entry["b"] == pytest.approx(0.7, abs=0.15)
    assert [per_count[k]["rows"] for k in ("2", "4", "8")] == [1500, 1500, 1500]
    with pytest.raises(cal.CalibrationError, match="at least two option counts"):
        labelled.fit_by_options(scored[:1500])


def test_thresholds_reach_the_target_precision_with_the_most_recall():
    p = [np.array([x, 1 - x]) for x in (0.95, 0.9, 0.8, 0.7, 0.6, 0.3, 0.2)]
    labels = [0, 0, 1, 0, 1, 1, 1]
    report = cal.thresholds(p, labels, ["spam", "ham"], target=0.75)
    # "spam" at p ≥ 0.7: rows 0-3, three of them spam (0.75), recall 3/3; at 0.6 precision is 0.6
    assert report["spam"] == {"threshold": 0.7, "precision": 0.75, "recall": 1.0}
    # "ham" (1 - x): at p ≥ 0.2 five rows, four of them ham (0.8), recall 4/4; at 0.1 precision is 4/6
    assert report["ham"]["threshold"] == pytest.approx(0.2)
    assert (report["ham"]["precision"], report["ham"]["recall"]) == (0.8, 1.0)
    assert "ham" not in cal.thresholds(p, labels, ["spam", "ham"], target=1.01)


def test_rule_accuracy_compares_argmax_with_floor_lift():
    rows = [
        (np.log([0.7, 0.3]), np.log([0.9, 0.1]), 1),  # the model leans to option 0 whatever it reads
        (np.log([0.95, 0.05]), np.log([0.9, 0.1]), 0),
    ]
    assert cal.rule_accuracy(rows) == {"argmax": 0.5, "floor_lift": 1.0}


@pytest.mark.parametrize(
    "entry, field",
    [
        ({"temperature": 1.0, "rule": "vote"}, "rule"),
        ({"temperature": 1.0, "thresholds": {" yes": 1.5}}, "thresholds"),
        ({"temperature": 1.0, "orderings": "some"}, "orderings"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_a_bad_workload_field_is_named(tmp_path, entry, field):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"workloads": {"w": entry}}))
    with pytest.raises(CalibrationError, match=rf"workloads\.w\.{field}:"):
        cal.load_calibration(path)


SPAM = {"id": "spam", "template": "\n\nIs this message spam?\nAnswer:{?}", "options": [" yes", " no"]}
WORKLOADS = cal.Calibration({
    "spam": cal.Workload(2.0, rule="floor_lift", thresholds={" yes": 0.3}),
    "plain": cal.Workload(0.5),
})  # fmt: skip


def test_a_query_with_a_workload_gets_its_calibrated_block(gemma_engine):
    scorer = Scorer(gemma_engine, calibration=WORKLOADS)
    body = {
        "messages": [{"content": "WIN a FREE cruise!!! Click now to claim your prize."}],
        "scoring": {"queries": [SPAM | {"workload": "spam"}, SPAM | {"id": "plain", "workload": "plain"},
                                SPAM | {"id": "raw"}]},
    }  # fmt: skip
    plan = scorer.plan(body)
    queries = scorer.finish(plan, gemma_engine.score_trees(plan.trees)).results[0].queries
    spam, plain, raw = (q.combinations[0] for q in queries)
    assert raw.calibrated is None
    logprobs = np.array([o.logprob for o in raw.options])
    floor = np.log([o.floor_p for o in raw.options])
    for combo, name in ((spam, "spam"), (plain, "plain")):
        assert [o.logprob for o in combo.options] == list(logprobs)  # a workload changes no native score
        workload = WORKLOADS.workloads[name]
        expected = cal.apply_temperature(logprobs, workload.temperature)
        assert combo.calibrated.probabilities == pytest.approx(list(expected))
        assert combo.calibrated.workload == name and combo.calibrated.rule == workload.rule
    assert spam.calibrated.choice == SPAM["options"][int(np.argmax(logprobs - floor))]
    assert plain.calibrated.choice == SPAM["options"][int(np.argmax(logprobs))]
    assert spam.calibrated.above_threshold == ([" yes"] if spam.calibrated.probabilities[0] >= 0.3 else [])
    assert plain.calibrated.above_threshold == []  # no thresholds fitted


@pytest.mark.parametrize(
    "query, scoring, code, param",
    [
        (SPAM | {"workload": "nobody"}, {}, "unknown_workload", "scoring.queries[0].workload"),
        (
            {"id": "m", "template": "A:{*}", "workload": "plain"},
            {},
            "invalid_request",
            "scoring.queries[0].workload",
        ),
        (SPAM | {"workload": "spam"}, {"empty_floor": False}, "invalid_request", "scoring.empty_floor"),
    ],
)
def test_workload_errors(gemma_engine, query, scoring, code, param):
    body = {"messages": [{"content": "Hello."}], "scoring": {"queries": [query], **scoring}}
    with pytest.raises(ScoringError) as e:
        Scorer(gemma_engine, calibration=WORKLOADS).plan(body)
    assert (e.value.code, e.value.param) == (code, param), e.value.message
    with pytest.raises(ScoringError) as e:  # a server without a calibration file knows no workload
        Scorer(gemma_engine).plan(
            {"messages": [{"content": "Hi."}], "scoring": {"queries": [SPAM | {"workload": "plain"}]}}
        )
    assert e.value.code == "unknown_workload"
