"""Prompt packs (issue 15): the file format and its checks, the loader (folders, git), packs in requests
(the same read, the same bits with or without the caller's questions), the server's listing and errors."""

import json
import math
import re
import subprocess
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import yaml

from spinf_jax.cli import main, pack_schema
from spinf_jax.errors import ScoringError
from spinf_jax.packs import rules
from spinf_jax.packs.compiled import compile_packs
from spinf_jax.packs.format import Baseline, PackError, read_pack
from spinf_jax.packs.loader import OFFICIAL, load_packs, split_ref
from spinf_jax.scoring import Scorer
from spinf_jax.server.app import create_app
from spinf_jax.server.settings import Settings
from tests.serving import loaded, serving

REPO = Path(__file__).resolve().parent.parent
TEST_PACKS = REPO / "fixtures" / "packs"
DEMO = yaml.safe_load((TEST_PACKS / "demo.yaml").read_text())
TEXTS = [
    "I know where you live and I will hurt you. Also, refund my order now.",
    "Thanks for the quick delivery, the jacket fits perfectly!",
    "WIN a FREE phone!!! Click the link and send your card number to claim it.",
]


def _write(tmp_path: Path, data: dict, name: str = "pack.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def scorer(gemma_engine) -> Scorer:
    packs = load_packs([str(TEST_PACKS)])
    return Scorer(gemma_engine, packs=compile_packs(packs, gemma_engine.model.tokenizer))


def _body(texts, packs, queries=None) -> dict:
    body = {
        "inputs": [{"id": f"t{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    }
    body["packs"] = packs
    if queries:
        body["scoring"] = {"queries": queries}
    return body


# --- the format --------------------------------------------------------------------------------------


def test_schema_file_is_the_formats():
    assert json.loads((REPO / "packs" / "schema.json").read_text()) == pack_schema()


def _broken(path: str, value):
    data = json.loads(json.dumps(DEMO))
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return data


BROKEN = [
    (("questions", 1, "colour"), "red", "questions[1]", "unknown field"),
    (("questions", 0, "id"), "refund", "questions[1].id", "used twice"),
    (("questions", 0, "template"), "Is it?{?} yes", "questions[0].template", "ends in its {?} slot"),
    (("questions", 0, "workload"), "triage", "questions[0].workload", "calibrates its cells itself"),
    (("questions", 0, "orderings"), "all", "questions[0].orderings", "no orderings"),
    (("categories", 0, "cells", 0, "option"), " maybe", "categories[0].cells[0].option", "not an option"),
    (("categories", 0, "cells", 0, "question"), "nope", "categories[0].cells[0].question", "no question"),
    (("categories", 1, "cells", 2, "baseline"), {"mean": 1.0}, "categories[1].cells[2].baseline", "together"),
    (("decision", "rules", 0, "label"), "ban", "decision.rules[0].label", "not one of decision.labels"),
    (("decision", "rules", 1, "category"), "x", "decision.rules[1].category", "no category"),
    (("id",), "NoSlash", "id", "matching regex"),
    (("version",), None, "", "missing required field `version`"),
    (("presentation",), {"wrapper": "Post: {content} {content}"}, "presentation.wrapper", "exactly once"),
]


@pytest.mark.parametrize(("where", "value", "field", "words"), BROKEN)
def test_a_broken_pack_names_its_file_and_field(tmp_path, where, value, field, words):
    path = _write(tmp_path, _broken(where, value))
    with pytest.raises(PackError) as e:
        read_pack(path)
    assert (e.value.path, e.value.field) == (str(path), field)
    assert words in str(e.value) and str(path) in str(e.value)


def test_a_file_that_is_not_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("id: [unclosed\n")
    with pytest.raises(PackError, match="bad.yaml"):
        read_pack(path)


def test_a_question_the_model_cannot_ask_names_its_field(tmp_path, gemma_engine):
    """Checked with the tokenizer when the pack is compiled: an option that merges with its template."""
    path = _write(
        tmp_path, _broken(("questions", 0, "template"), "\n\nThis message is best described as: {?}")
    )
    with pytest.raises(PackError) as e:
        compile_packs(load_packs([str(tmp_path)], official=False), gemma_engine.model.tokenizer)
    assert (e.value.path, e.value.field) == (str(path), "questions[0].options[0]")
    assert "option_boundary" in str(e.value)


def test_official_packs_load_and_compile(gemma_engine):
    packs = load_packs()
    assert OFFICIAL == REPO / "packs"
    assert {"spinf/moderation", "spinf/support-triage", "spinf/product-listings", "spinf/reviews",
            "spinf/brand-safety", "spinf/entertainment"} <= set(packs)  # fmt: skip
    moderation = packs["spinf/moderation"].pack
    assert len(moderation.categories) == 22
    assert sum(len(c.cells) for c in moderation.categories) >= 100
    compiled = compile_packs(packs, gemma_engine.model.tokenizer)
    assert all(p.loaded.source == "official" for p in compiled.values())


# --- the rules ---------------------------------------------------------------------------------------


def test_cells_categories_and_decision_by_hand():
    pack = read_pack(TEST_PACKS / "demo.yaml")
    [threats, billing] = pack.categories
    p, floor = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.25, 0.1, 0.25, 0.4])
    cell = rules.cell_score(threats.cells[0], list(pack.questions[0].options), [(p, floor)])
    assert math.isclose(cell.value, math.log(0.2 / 0.1)) and cell.score == cell.value
    two = [(np.array([0.6, 0.4]), np.array([0.5, 0.5])), (np.array([0.8, 0.2]), np.array([0.5, 0.5]))]
    about = rules.cell_score(billing.cells[1], [" yes", " no"], two)
    assert math.isclose(about.value, 0.7)  # p, averaged over the combinations
    complaint = rules.cell_score(billing.cells[2], list(pack.questions[0].options), [(p, floor)])
    assert math.isclose(complaint.score, 0.0)  # log(0.4 / 0.4), as a z-score against mean 0, std 0.5
    refund = rules.cell_score(
        billing.cells[0], [" yes", " no"], [(np.array([0.3, 0.7]), np.array([0.5, 0.5]))]
    )
    assert math.isclose(refund.value, -0.2)
    # max of the weighted scores: 0.7 (about), -0.2 (refund), 2 × 0 (complaint)
    assert math.isclose(rules.category_score(billing, [refund.score, about.score, complaint.score]), 0.7)
    assert rules.decide(pack, {"threats": -1.0, "billing": 0.7})[0] == "review"
    assert rules.decide(pack, {"billing": 100.0})[0] == "urgent"  # threats not asked: its rule cannot fire
    assert rules.decide(pack, {"billing": 0.0}) == ("normal", [])
    ranks = Baseline(percentiles=[0.0, 1.0, 3.0])
    assert [rules.calibrate(ranks, v) for v in (-1.0, 0.5, 2.0, 9.0)] == [0.0, 0.25, 0.75, 1.0]


# --- the loader --------------------------------------------------------------------------------------


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_packs_from_a_git_repository_pinned_to_a_ref(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", "-b", "main", cwd=repo)
    _write(repo, DEMO, "demo.yaml")
    _git("add", ".", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v0.1", cwd=repo)
    _git("tag", "v0.1", cwd=repo)
    _write(repo, {**DEMO, "version": "0.2"}, "demo.yaml")
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "v0.2", cwd=repo)
    cache = tmp_path / "cache"
    old = load_packs([f"git+file://{repo}@v0.1"], official=False, cache=cache)["test/demo"]
    new = load_packs([f"file://{repo}"], official=False, cache=cache)["test/demo"]
    assert (old.pack.version, new.pack.version) == ("0.1", "0.2")
    tag = subprocess.run(
        ["git", "rev-parse", "v0.1"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    assert old.commit == tag and old.source == f"file://{repo}" and new.commit != tag
    assert old.path.is_relative_to(cache) and old.path.exists()
    with pytest.raises(
        PackError, match=r"no branch, tag or commit 'no-such-ref' there \(it has: main, v0.1\)"
    ):
        load_packs([f"git+file://{repo}@no-such-ref"], official=False, cache=cache)
    _git("checkout", "-qb", "other", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "empty", "--allow-empty", cwd=repo)
    _git("checkout", "-q", "main", cwd=repo)
    branch = load_packs([f"git+file://{repo}@other"], official=False, cache=cache)["test/demo"]
    assert branch.pack.version == "0.2"  # a branch of the remote, not only the default one


def test_a_repository_or_folder_without_packs_is_refused(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", "-b", "main", cwd=repo)
    (repo / "README.md").write_text("no packs here\n")
    _git("add", ".", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "docs", cwd=repo)
    with pytest.raises(PackError, match=r"no pack files \(.yaml, .yml, .json\) in it at [0-9a-f]{12}"):
        load_packs([f"git+file://{repo}"], official=False, cache=tmp_path / "cache")
    with pytest.raises(PackError, match="no pack files"):
        load_packs([str(repo)], official=False)


def test_a_remote_that_never_answers_fails_within_the_deadline_and_leaves_no_process(tmp_path):
    """An HTTP remote that accepts the connection and says nothing: the load stops at its deadline with a
    clear message, asks nobody for a password, and leaves no git process behind."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    try:
        started = time.monotonic()
        with pytest.raises(PackError, match=r"git clone did not finish within 3 s \(is the remote up\?\)"):
            load_packs(
                [f"http://127.0.0.1:{port}/packs.git"], official=False, cache=tmp_path / "c", git_deadline=3
            )
        assert time.monotonic() - started < 10
        time.sleep(0.2)
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if f"127.0.0.1:{port}".encode() in cmdline.read_bytes():
                    left.append(cmdline.parent.name)
            except OSError:  # a process that ended while we looked
                continue
        assert left == [], left
    finally:
        silent.close()


def test_split_ref():
    assert split_ref("git+file:///srv/packs@v1") == ("file:///srv/packs", "v1")
    assert split_ref("https://example.com/a/packs.git") == ("https://example.com/a/packs.git", None)
    assert split_ref("ssh://git@example.com/packs.git@main") == ("ssh://git@example.com/packs.git", "main")


def test_one_id_in_two_sources_is_refused(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _write(tmp_path / "a", DEMO), _write(tmp_path / "b", DEMO)
    with pytest.raises(PackError, match="also defined in"):
        load_packs([str(tmp_path / "a"), str(tmp_path / "b")], official=False)


def test_serve_refuses_to_start_with_a_broken_pack(tmp_path, capsys):
    path = _write(tmp_path, _broken(("decision", "rules", 0, "label"), "ban"))
    assert main(["serve", "--check", "--packs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--packs: {path}: decision.rules[0].label" in err
    assert main(["serve", "--check", "--packs", str(TEST_PACKS)]) == 0
    assert "test/demo" in capsys.readouterr().out


def test_packs_commands(capsys, tmp_path):
    assert main(["packs", "list", "--packs", str(TEST_PACKS)]) == 0
    listing = capsys.readouterr().out
    assert "test/wrapped" in listing and "spinf/moderation" in listing
    assert main(["packs", "show", "test/demo", "--packs", str(TEST_PACKS), "--no-official-packs"]) == 0
    assert msgspec.yaml.decode(capsys.readouterr().out.split("\n", 1)[1])["id"] == "test/demo"
    assert main(["packs", "validate", "--no-model", str(TEST_PACKS / "demo.yaml")]) == 0
    assert main(["packs", "validate", "--no-model", str(TEST_PACKS)]) == 0  # a folder, as --packs takes it
    (tmp_path / "empty").mkdir()
    assert main(["packs", "validate", "--no-model", str(tmp_path / "empty")]) == 2
    assert "no pack files (.yaml, .yml, .json) in it" in capsys.readouterr().err
    broken = _write(tmp_path, _broken(("categories", 0, "cells", 0, "option"), " maybe"))
    assert main(["packs", "validate", "--no-model", str(broken)]) == 2
    assert "categories[0].cells[0].option" in capsys.readouterr().err


# --- requests ----------------------------------------------------------------------------------------


def _packs_of(response) -> dict:
    return {r["input_id"]: r["packs"] for r in response["results"]}


def test_a_packs_result_is_the_same_bits_however_it_is_asked(scorer):
    """Alone, with the caller's own questions (before and after it in the tree), among other contents, and
    beside another pack: the same categories, decision and cells."""
    packs = [{"id": "test/demo", "cells": True}]
    own = [{"id": "spam", "template": "\n\nIs this spam?\nAnswer:{?}", "options": [" yes", " no"]}]
    alone = _packs_of(scorer.score(_body(TEXTS[:1], packs)))["t0"]
    with_own = _packs_of(scorer.score(_body(TEXTS[:1], packs, own)))["t0"]
    among = _packs_of(scorer.score(_body(TEXTS[::-1], [*packs, {"id": "test/wrapped"}], own)))["t2"]
    assert alone == with_own == among[:1]
    [demo] = alone
    assert demo["decision"] == {"label": "review", "rules": [{"category": "threats", "at_least": -100.0,
                                                             "label": "review"}]}  # fmt: skip
    assert [c["question"] for c in demo["cells"]] == ["kind", "refund", "about", "kind"]


def test_a_wrapping_pack_reads_the_content_apart(scorer):
    """Its questions read "Customer email:\\n" + content + "\\n--", and their floor is the wrapper around
    empty content: the same as asking the wrapped text directly, with the floor asked the same way."""
    [[wrapped]] = _packs_of(scorer.score(_body(TEXTS[2:], [{"id": "test/wrapped", "cells": True}]))).values()
    query = {"id": "kind", "template": "\n\nThis email is best described as:{?}",
             "options": [" friendly", " a threat", " spam", " a complaint"]}  # fmt: skip
    direct = scorer.score(_body([f"Customer email:\n{TEXTS[2]}\n--", "Customer email:\n\n--"], [], [query]))
    p = [c["combinations"][0]["options"][2]["p"] for r in direct["results"] for c in r["queries"]]
    [cell] = wrapped["cells"]
    assert cell["p"] == pytest.approx(p[0], abs=1e-6) and cell["floor_p"] == pytest.approx(p[1], abs=1e-6)
    assert cell["value"] == pytest.approx(math.log(p[0] / p[1]), abs=1e-5)


def test_categories_asked_are_the_only_ones_scored(scorer):
    def ask(categories=None):
        ref = {"id": "test/demo"} if categories is None else {"id": "test/demo", "categories": categories}
        response = scorer.score(_body(TEXTS[:1], [ref]))
        [[result]] = _packs_of(response).values()
        return result, response["usage"]["prompt_tokens_details"]["query_tokens"]

    (both, all_tokens), (threats, fewer) = ask(), ask(["threats"])
    assert [c["id"] for c in threats["categories"]] == ["threats"] and threats["categories"][0] in both[
        "categories"
    ]
    assert fewer < all_tokens  # only the question its cells read
    billing, _ = ask(["billing"])
    assert billing["decision"]["label"] == "normal"  # the threats rule cannot fire when threats is not asked


@pytest.mark.parametrize(
    ("ref", "code", "param"),
    [
        ({"id": "nobody/missing"}, "unknown_pack", "packs[0].id"),
        ({"id": "test/demo", "version": "9"}, "unknown_pack", "packs[0].version"),
        ({"id": "test/demo", "categories": ["nope"]}, "invalid_request", "packs[0].categories[0]"),
        ({"id": "test/demo", "categories": []}, "invalid_request", "packs[0].categories"),
    ],
)
def test_pack_errors(scorer, ref, code, param):
    with pytest.raises(ScoringError) as e:
        scorer.score(_body(TEXTS[:1], [ref]))
    assert (e.value.code, e.value.param) == (code, param)


# --- the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(gemma_engine):
    settings = Settings("spinf/gemma-3-270m", packs=load_packs([str(TEST_PACKS)]))
    with serving(create_app(settings, gemma_engine)) as url:
        yield url


def test_server_lists_and_scores_packs(url, scorer):
    listed = httpx.get(f"{url}/v1/packs").json()["data"]
    demo = next(p for p in listed if p["id"] == "test/demo")
    assert demo["source"] == str(TEST_PACKS) and demo["categories"] == ["threats", "billing"]
    assert {p["id"] for p in listed} >= {"spinf/moderation", "test/wrapped"}
    health = loaded(httpx.Client(base_url=url))
    assert [p["id"] for p in health["packs"]] == [p["id"] for p in listed]
    body = _body(TEXTS[:2], [{"id": "test/demo", "cells": True}])
    over_http = httpx.post(f"{url}/v1/score", json=body, timeout=300)
    assert over_http.status_code == 200, over_http.text
    assert _packs_of(over_http.json()) == _packs_of(scorer.score(body))
    bad = httpx.post(f"{url}/v1/score", json=_body(TEXTS[:1], [{"id": "test/demo", "version": "2"}]))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "packs[0].version"


def test_openai_sdk_sends_packs_in_extra_body(url, scorer):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": TEXTS[0]}]
    reply = client.chat.completions.create(
        model="spinf/gemma-3-270m", messages=messages, extra_body={"packs": [{"id": "test/demo"}]}
    )
    direct = scorer.score({"messages": messages, "packs": [{"id": "test/demo"}]})
    assert reply.model_extra["results"][0]["packs"] == direct["results"][0]["packs"]


# --- calibration -------------------------------------------------------------------------------------

NORMAL = [
    "Thanks for the quick delivery, everything arrived fine.",
    "What time does the store open on Sunday?",
    "I love this blue jacket, great fit.",
    "Can you tell me how to reset my password?",
    "My order number is 1234, where is it?",
    "Is there a discount for students?",
]
LABELLED = [
    ("I will find you and hurt you.", ["threats"]),
    ("You will regret this, I'm coming for you tonight.", ["threats"]),
    ("Refund me now, I was charged twice.", ["billing"]),
    ("Nice shoes.", []),
]


def test_calibration_sets_baselines_and_thresholds_it_can_justify(scorer, tmp_path):
    from spinf_jax.packs import calibrate

    pack = read_pack(TEST_PACKS / "demo.yaml")
    normal = [calibrate.Row([{"role": "user", "content": t}]) for t in NORMAL]
    labelled = [calibrate.Row([{"role": "user", "content": t}], tuple(c)) for t, c in LABELLED]
    targets = {"normal": 0.5, "review": 0.5, "urgent": 0.9}
    calibrated, report = calibrate.calibrate_pack(scorer, pack, normal, labelled, targets)
    # Baselines: each cell's mean and std over the normal rows' raw values.
    raw = calibrate.cell_values(scorer, pack.id, normal)
    first = calibrated.categories[0].cells[0].baseline
    assert first.items == 6 and first.mean == pytest.approx(raw[:, 0].mean(), abs=1e-6)
    assert first.std == pytest.approx(raw[:, 0].std(), abs=1e-6)
    # Every rule kept reaches its label's precision on these rows, as recomputed here; the others are
    # reported as dropped.
    scores = calibrate.category_scores(
        calibrated, np.concatenate([calibrate.cell_values(scorer, pack.id, labelled), raw])
    )
    tags = [set(c) for _, c in LABELLED] + [set()] * len(NORMAL)
    for rule in calibrated.decision.rules:
        positive = np.array([rule.category in t for t in tags])
        fired = scores[rule.category] >= rule.at_least
        assert (
            positive[fired].mean() == pytest.approx(rule.precision) and rule.precision >= targets[rule.label]
        )
    reported = {(c["id"], r["label"]) for c in report["categories"] for r in c["rules"]}
    assert reported == {(r.category, r.label) for r in pack.decision.rules}
    assert calibrated.calibrated_on[0].fingerprint == scorer.engine.fingerprint
    assert (calibrated.calibration.normal_items, calibrated.calibration.labelled_items) == (6, 4)
    # The file written is a valid pack whose scores are now z-scores against normal traffic: over the normal
    # rows, a cell's scores have mean 0.
    out = tmp_path / "demo.yaml"
    calibrate.write_pack(calibrated, out)
    assert read_pack(out) == calibrated
    packs = compile_packs(load_packs([str(tmp_path)], official=False), scorer.engine.model.tokenizer)
    result = Scorer(scorer.engine, packs=packs).score(_body(NORMAL, [{"id": "test/demo"}]))
    threats = [r["packs"][0]["categories"][0]["score"] for r in result["results"]]
    assert np.mean(threats) == pytest.approx(0.0, abs=1e-4)


@pytest.mark.slow  # the command loads the default model itself
def test_calibrate_command(tmp_path, capsys):
    (tmp_path / "packs").mkdir()
    (tmp_path / "packs" / "demo.yaml").write_text((TEST_PACKS / "demo.yaml").read_text())
    (tmp_path / "normal.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in NORMAL[:3]))
    (tmp_path / "labelled.jsonl").write_text(
        "".join(json.dumps({"text": t, "categories": c}) + "\n" for t, c in LABELLED)
    )
    args = ["packs", "calibrate", "test/demo", "--packs", str(tmp_path / "packs"), "--no-official-packs",
            "--traffic", str(tmp_path / "normal.jsonl"), "--labelled", str(tmp_path / "labelled.jsonl"),
            "--target", "urgent=0.6", "--report", str(tmp_path / "report.json")]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "threats" in out and "wrote" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["normal_items"], report["labelled_items"]) == (3, 4)
    pack = read_pack(tmp_path / "packs" / "demo.yaml")
    assert pack.calibration.normal_items == 3 and pack.categories[0].cells[0].baseline.items == 3


@pytest.mark.parametrize(("calibrated_at", "warned"), [("bf16", True), ("fp32", False)])
def test_a_pack_calibrated_at_another_precision_is_warned_of_at_start(
    gemma_engine, tmp_path, caplog, calibrated_at, warned
):
    """The session's engine runs fp32: a pack calibrated for the model at bf16 only gets a warning line
    naming both precisions and what to do; one calibrated at fp32 gets none."""
    import logging

    from litestar.testing import TestClient

    on = [{"model": "spinf/gemma-3-270m", "precision": calibrated_at}]
    _write(tmp_path, {**DEMO, "calibrated_on": on}, "demo.yaml")
    settings = Settings("spinf/gemma-3-270m", packs=load_packs([str(tmp_path)], official=False))
    app = create_app(settings, gemma_engine)
    with caplog.at_level(logging.WARNING, logger="spinf_jax.progress"), TestClient(app) as client:
        assert loaded(client)["status"] == "ok"
    lines = [r.getMessage() for r in caplog.records if "pack_precision" in r.getMessage()]
    assert bool(lines) == warned, lines
    if warned:
        assert (
            "calibrated_at=bf16" in lines[0]
            and "served_at=fp32" in lines[0]
            and "--precision bf16" in lines[0]
        )


def test_the_docs_example_decides_as_the_docs_say(gemma_engine):
    """docs/prompt-packs.md's first request, on the default model, gets the decision its answer shows, with
    the category that fired first among the scores (the doc's numbers are bf16's, as `serve` runs it; this
    engine is fp32, where the same rules fire)."""
    doc = (Path(__file__).parent.parent / "docs" / "prompt-packs.md").read_text()
    request, answer = re.findall(r"```json\n(.*?)```", doc, re.S)[:2]
    shown = json.loads("{" + answer.replace(", ...", "") + "}")["packs"][0]
    got = gemma_engine.score(json.loads(request))["results"][0]["packs"][0]
    assert got["decision"]["label"] == shown["decision"]["label"] == "block"
    assert [r["category"] for r in got["decision"]["rules"]] == [
        r["category"] for r in shown["decision"]["rules"]
    ]
    best = max(got["categories"], key=lambda c: c["score"])
    assert best["id"] == shown["categories"][0]["id"]
