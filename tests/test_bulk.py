"""`spinf-jax score`: a JSON Lines file in process and through a server, bad lines skipped by line number,
results flushed per batch, and a restart that skips exactly what is done for the same request."""

import json
import subprocess
import sys
import threading

import pytest

from spinf_jax import bulk, cli
from spinf_jax.compiler import Limits
from spinf_jax.errors import ScoringError
from spinf_jax.scoring import Scorer

QUERY = {
    "id": "refund",
    "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
    "options": [" yes", " no"],
}
TEMPLATE = {"scoring": {"queries": [QUERY]}}


def _write_inputs(path, long_text: str = "word " * 40):
    lines = [
        json.dumps({"id": "a", "text": "Please refund my order."}),
        "{not json",
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "Thanks, all good."}]}),
        json.dumps({"id": "too-long", "text": long_text}),
        json.dumps({"id": "c", "text": "Where is my parcel?"}),
        json.dumps({"id": "neither"}),
        "",
        json.dumps({"id": "d", "text": "I want my money back."}),
    ]
    path.write_text("\n".join(lines) + "\n")


def test_in_process_skips_bad_lines_and_resumes(gemma_engine, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_inputs(source)
    scorer = Scorer(gemma_engine, Limits(max_content_tokens=20))  # "too-long" is over it
    summary = bulk.run(source, out, TEMPLATE, bulk.in_process(scorer), batch=2)
    assert summary.scored == 4 and summary.already_done == 0
    assert [b.split(":")[0] for b in summary.bad] == ["line 2", "line 4", "line 6"]
    assert "content_too_long" in summary.bad[1]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_id"] for r in rows] == ["a", "b", "c", "d"]
    alone = scorer.score({"messages": [{"content": "Where is my parcel?"}], "scoring": {"queries": [QUERY]}})
    assert rows[2]["queries"] == alone["results"][0]["queries"]  # bits: as asked alone

    # The command's backend (bulk.pipelined): batches in flight, planned while others run and batched by the
    # server's runner, write the same lines, bit for bit, and the same bad ones; leaving stops its threads.
    # (Threads compared as objects: the session's servers in this process have runners of their own.)
    before = set(threading.enumerate())
    with bulk.pipelined(scorer) as backend:
        piped = bulk.run(source, tmp_path / "piped.jsonl", TEMPLATE, backend, batch=1, in_flight=3)
        started = set(threading.enumerate()) - before
    assert (tmp_path / "piped.jsonl").read_text() == out.read_text()
    assert (piped.scored, piped.bad) == (summary.scored, summary.bad)
    runner = [t for t in started if t.name.startswith(("spinf-engine", "spinf-wait", "spinf-finish"))]
    assert {t.name for t in runner} >= {"spinf-engine", "spinf-wait_0"}
    assert not [t for t in runner if t.is_alive()]

    # A restart after a torn last line: the complete lines are skipped, the torn one is scored again.
    out.write_text(out.read_text()[:-20])
    again = bulk.run(source, out, TEMPLATE, bulk.in_process(scorer), batch=2)
    assert (again.scored, again.already_done) == (1, 3)
    # Another question is another request: everything is asked again.
    other = {"scoring": {"queries": [QUERY | {"options": [" yes", " no", " maybe"]}]}}
    assert bulk.run(source, out, other, bulk.in_process(scorer), batch=8).scored == 4


def test_a_batch_over_the_request_token_limit_is_split(gemma_engine, tmp_path):
    """A batch the request limit refuses as a whole is scored in halves, down to one content a request."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    texts = [f"Order {i}: please refund me, the parcel never came." for i in range(5)]
    source.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
    one = Scorer(gemma_engine).plan({"messages": [{"content": texts[0]}], **TEMPLATE})
    per_content = sum(len(tree) for tree in one.trees)
    scorer = Scorer(gemma_engine, Limits(max_request_tokens=2 * per_content + 1))
    with pytest.raises(ScoringError, match="split it"):  # the five as one request
        scorer.score({"inputs": [{"messages": [{"content": t}]} for t in texts], **TEMPLATE})
    summary = bulk.run(source, out, TEMPLATE, bulk.in_process(scorer), batch=5)
    assert (summary.scored, summary.bad) == (5, [])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_id"] for r in rows] == ["0", "1", "2", "3", "4"]


@pytest.mark.slow  # a subprocess that imports JAX
def test_the_command_through_a_server_with_a_pack(default_url, tmp_path):
    url = default_url
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_inputs(source, long_text="word " * 5000)  # over the server's 4,096-token content limit
    queries = tmp_path / "q.json"
    queries.write_text(json.dumps([QUERY]))
    args = [sys.executable, "-m", "spinf_jax.cli", "score", str(source), "--out", str(out), "--queries",
            str(queries), "--pack", "spinf/reviews", "--url", url, "--batch", "3"]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    err = run.stderr
    assert "spinf-jax score: line 4: content_too_long" in err and "scored 4 in" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_id"] for r in rows] == ["a", "b", "c", "d"]
    assert all(r["packs"][0]["id"] == "spinf/reviews" and r["queries"][0]["id"] == "refund" for r in rows)
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)  # everything is there
    second = again.stderr
    assert "scored 0 in" in second and "4 already in the output" in second


def test_the_command_in_process(gemma_engine, tmp_path, monkeypatch, capsys):
    """`spinf-jax score` without --url: the model loaded in this process (the session's engine here),
    batches in flight through its runner, lines in input order, refusals reported by line number."""
    from spinf_jax.service import Service

    monkeypatch.setattr(Service, "load", lambda *args, **kwargs: Service.over(gemma_engine))
    source, out, queries = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "q.json"
    _write_inputs(source)
    queries.write_text(json.dumps([QUERY]))
    argv = ["score", str(source), "--out", str(out), "--queries", str(queries), "--batch", "1"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.index("line 2: not JSON") < err.index("line 6: an object") and "scored 5 in" in err
    ids = [json.loads(line)["input_id"] for line in out.read_text().splitlines()]
    assert ids == ["a", "b", "too-long", "c", "d"]


def test_the_command_needs_questions(tmp_path, capsys):
    assert cli.main(["score", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "give --queries FILE or --pack ID" in capsys.readouterr().err


@pytest.mark.parametrize("line, why", [('{"id": 1}', "text or messages"), ("[1, 2]", "text or messages")])
def test_lines_that_are_not_contents(tmp_path, line, why):
    source = tmp_path / "in.jsonl"
    source.write_text(line + "\n")
    bad = []
    assert list(bulk.read_inputs(source, bad)) == [] and why in bad[0]
