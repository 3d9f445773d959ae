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
    assert run.returncode == 1, run.stderr[-2000:]  # a line was skipped
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
    assert cli.main(argv) == 1  # lines were skipped: not a clean run
    err = capsys.readouterr().err
    assert err.index("line 2: not JSON") < err.index("line 6: an object") and "scored 5 in" in err
    ids = [json.loads(line)["input_id"] for line in out.read_text().splitlines()]
    assert ids == ["a", "b", "too-long", "c", "d"]


@pytest.mark.parametrize(
    ("flag", "asked", "said"),
    [
        ("--queries", {"query": [QUERY]}, "--queries: scoring has no field 'query'; did you mean 'queries'?"),
        (
            "--queries",
            [{"id": "q", "template": 5}],
            "--queries: Expected `str`, got `int` - at scoring.queries",
        ),
        (
            "--systemone",
            {"t": {"type": "choice", "criteria": {"a": None}}},
            "--systemone: questions.t.criteria: 1 options",
        ),
    ],
)
def test_bad_questions_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, flag, asked, said):
    from spinf_jax.service import Service

    monkeypatch.setattr(Service, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    source, questions = tmp_path / "in.jsonl", tmp_path / "q.json"
    source.write_text('{"text": "hi"}\n')
    questions.write_text(json.dumps(asked))
    assert cli.main(["score", str(source), "--out", str(tmp_path / "o.jsonl"), flag, str(questions)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spinf-jax score: " + said) and err.count("\n") == 1, err


def test_a_server_that_is_not_there_is_one_line(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source, questions = tmp_path / "in.jsonl", tmp_path / "q.json"
    source.write_text('{"text": "hi"}\n')
    questions.write_text(json.dumps([QUERY]))
    url = f"http://127.0.0.1:{port}"
    argv = [
        "score",
        str(source),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--queries",
        str(questions),
        "--url",
        url,
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spinf-jax score: --url {url}: cannot reach the server (") and err.count("\n") == 1
    assert "is `spinf-jax serve` running there?" in err


def test_the_command_needs_questions(tmp_path, capsys):
    assert cli.main(["score", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "give --queries FILE, --pack ID or --systemone FILE" in capsys.readouterr().err


@pytest.mark.parametrize("line, why", [('{"id": 1}', "text or messages"), ("[1, 2]", "text or messages")])
def test_lines_that_are_not_contents(tmp_path, line, why):
    source = tmp_path / "in.jsonl"
    source.write_text(line + "\n")
    bad = []
    assert list(bulk.read_inputs(source, bad)) == [] and why in bad[0]


SYSTEMONE = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for a refund?"},
    "topic": {"type": "choice", "instructions": "Topic?", "criteria": {"billing": None, "delivery": None}},
}


def test_a_csv_of_states_asked_a_system_one_question_set(gemma_engine, tmp_path, monkeypatch, capsys):
    """`spinf-jax score rows.csv --systemone q.json`: each row a state (its `text`, or the row itself as an
    object), answered as /v1/systemone would answer it alone; a restart skips what is done."""
    from spinf_jax.service import Service

    service = Service.over(gemma_engine)
    monkeypatch.setattr(Service, "load", lambda *args, **kwargs: service)
    source, out, questions = tmp_path / "rows.csv", tmp_path / "out.jsonl", tmp_path / "q.json"
    source.write_text("id,product,complaint\nr1,kettle,the lid broke\nr2,,\nr3,parcel,never arrived\n")
    questions.write_text(json.dumps(SYSTEMONE))
    argv = ["score", str(source), "--out", str(out), "--systemone", str(questions), "--batch", "2"]
    assert cli.main(argv) == 0
    assert "scored 3 in" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_id"] for r in rows] == ["r1", "r2", "r3"]
    state = {"product": "kettle", "complaint": "the lid broke"}
    assert rows[0]["answers"] == service.systemone({"state": state, "questions": SYSTEMONE})["answers"]
    assert rows[0]["usage"]["input_tokens"] > 0 and len(rows[0]["request_sha256"]) == 64
    assert cli.main(argv) == 0
    assert "scored 0 in" in capsys.readouterr().err and out.read_text().count("\n") == 3


def test_states_through_a_server_with_a_system_one_question_set(default_url, tmp_path, capsys):
    source, out, questions = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "q.json"
    lines = [
        {"id": "a", "state": {"order": 7, "text": "refund me"}},
        {"id": "b"},
        {"id": "c", "text": "late"},
    ]
    source.write_text("\n".join(map(json.dumps, lines)) + "\n")
    questions.write_text(json.dumps({"questions": SYSTEMONE, "x_orderings": "rotations"}))
    argv = ["score", str(source), "--out", str(out), "--systemone", str(questions), "--url", default_url]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "line 2: an object with a state" in err and "scored 2 in" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_id"] for r in rows] == ["a", "c"] and "x_agreement" in rows[0]["answers"]["topic"]
    assert cli.main([*argv[:-2], "--queries", str(questions)]) == 2
