"""Ray Data (spinf_jax.ray): the map_batches stage scores rows as the API does, row by row, with refusals in
`error`; `spinf-jax score --ray local` over Parquet on two actors writes what the bulk command writes in
process, bit for bit, even when an actor is killed mid-job (no row lost, none twice)."""

import json
import os
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spinf_jax import bulk, cli
from spinf_jax.decision_apis import DecisionApis, SystemOneBatches
from spinf_jax.packs.compiled import compile_packs
from spinf_jax.packs.loader import load_packs
from spinf_jax.ray import Scores, as_systemone, template
from spinf_jax.scoring import Scorer
from tests.serving import processes

SCORING = {"queries": [{"id": "late", "template": "\n\nIs the order late?{?}", "options": [" yes", " no"]}]}


def _stage(engine) -> Scores:
    """A Scores over the session's engine (its __init__ loads a model of its own)."""
    stage = Scores.__new__(Scores)
    stage.backend, stage.template = bulk.in_process(Scorer(engine)), template(SCORING, [])
    stage.kind = bulk.SCORING
    return stage


def test_a_stage_asks_a_system_one_question_set(gemma_engine):
    """With `systemone`, a row is a state: its result is that state's System One reply."""
    questions = {"late": {"type": "noul", "instructions": "Is the order late?"}}
    stage = Scores.__new__(Scores)
    apis = DecisionApis(gemma_engine)
    stage.kind, stage.template = bulk.SYSTEMONE, as_systemone(questions)
    stage.backend = bulk.in_process(SystemOneBatches(apis))
    batch = {
        "id": np.array(["a", "b"], dtype=object),
        "text": np.array(["Order 1 is late.", ""], dtype=object),
    }
    out = stage(batch)
    a = json.loads(out["result"][0])
    assert (
        a["input_id"] == "a"
        and a["answers"] == apis.systemone({"state": "Order 1 is late.", "questions": questions})["answers"]
    )
    assert out["result"][1] is None and "a state" in out["error"][1]


def test_a_batch_gets_result_and_error_columns(gemma_engine):
    batch = {
        "id": np.array(["a", "b", None, "d"], dtype=object),
        "text": np.array(["Order 1 is late.", None, "No id here.", "word " * 5000], dtype=object),
        "messages": np.array(
            [None, np.array([{"role": "user", "content": "Where is my parcel?"}]), None, None], dtype=object
        ),
    }
    out = _stage(gemma_engine)(batch)
    assert list(out["id"]) == ["a", "b", None, "d"]  # every column comes back
    alone = {
        "scoring": SCORING,
        "inputs": [{"id": "a", "messages": [{"role": "user", "content": "Order 1 is late."}]}],
    }
    a = json.loads(out["result"][0])
    assert a["input_id"] == "a" and a["queries"] == Scorer(gemma_engine).score(alone)["results"][0]["queries"]
    assert json.loads(out["result"][1])["input_id"] == "b" and out["error"][:2].tolist() == [None, None]
    assert out["result"][2] is None and "has an id" in out["error"][2]
    assert out["result"][3] is None and out["error"][3].startswith("content_too_long")


def test_a_row_may_ask_a_pack_of_its_own(gemma_engine):
    stage = _stage(gemma_engine)
    packs = compile_packs(load_packs([], official=True), gemma_engine.model.tokenizer)
    stage.backend, stage.template = bulk.in_process(Scorer(gemma_engine, packs=packs)), template(None, [])
    batch = {
        "id": np.array(["a", "b", "c"], dtype=object),
        "text": np.array(["Great phone, the battery lasts.", "Hello.", "Hi."], dtype=object),
        "pack": np.array(["spinf/reviews", None, "spinf/nothing"], dtype=object),
    }
    out = stage(batch)
    assert [p["id"] for p in json.loads(out["result"][0])["packs"]] == ["spinf/reviews"]
    assert out["result"][1] is None and "a scoring block is required" in out["error"][1]  # no questions
    assert out["result"][2] is None and "spinf/nothing" in out["error"][2]


def _actors() -> list[int]:
    return [pid for pid, (_, command) in processes().items() if "MapWorker" in command]


@pytest.mark.slow  # a local Ray cluster, two actors each loading a model, one killed and started again
def test_score_on_ray_loses_no_row_when_an_actor_dies(smollm_engine, tmp_path):
    ids = [f"r{i}" for i in range(12)]
    source = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"id": ids, "text": [f"Order {i} is {i * 3} days late." for i in range(12)]}), source
    )
    queries, out = tmp_path / "q.json", tmp_path / "out.jsonl"
    queries.write_text(json.dumps(SCORING))
    argv = ["score", str(source), "--out", str(out), "--queries", str(queries), "--ray", "local", "--devices",
            "2", "--batch", "2", "--model", "spinf/smollm2-135m-instruct", "--precision", "fp32",
            "--buckets", "256"]  # fmt: skip
    job = threading.Thread(target=lambda: cli.main(argv))
    job.start()
    deadline = time.monotonic() + 120  # about 30 s here (a hang once cost CI 300 s: uv run's runtime env)
    while not (out.exists() and out.read_text().count("\n") >= 2):  # both actors are up, rows are coming
        assert job.is_alive() and time.monotonic() < deadline, "no rows came"
        time.sleep(0.2)
    actors = _actors()
    assert len(actors) == 2
    os.kill(actors[0], signal.SIGKILL)
    job.join(timeout=300)
    assert not job.is_alive()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_id"] for r in rows] == ids  # in input order, each once
    one = tmp_path / "one.jsonl"
    (tmp_path / "in.jsonl").write_text(
        "".join(
            json.dumps({"id": i, "text": f"Order {n} is {n * 3} days late."}) + "\n"
            for n, i in enumerate(ids)
        )
    )
    bulk.run(tmp_path / "in.jsonl", one, {"scoring": SCORING}, bulk.in_process(Scorer(smollm_engine)))
    assert out.read_text() == one.read_text()
