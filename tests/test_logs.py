"""Progress and logs (spinf_jax.progress): one line per scoring request and per error, key=value on a terminal
and JSON elsewhere; loading and compiling reported step by step when asked, and not a word otherwise."""

import datetime
import io
import json
import logging
import re
import sys
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from spinf_jax.engine import Engine
from spinf_jax.loader import load_model
from spinf_jax.models.params import params
from spinf_jax.packer import Buckets
from spinf_jax.progress import JsonFormatter, KeyValueFormatter, Progress, log
from spinf_jax.server.app import REQUESTS, Settings, create_app
from spinf_jax.server.protocol import uvicorn_config
from tests.serving import loaded

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny" / "qwen3"
REQUEST_FIELDS = ["request_id", "method", "path", "status", "error", "inputs", "questions", "tokens",
                  "queue_ms", "pass_ms", "total_ms"]  # fmt: skip
QUERIES = [
    {
        "id": "refund",
        "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
        "options": [" yes", " no"],
    },
    {"id": "tone", "template": "\n\nIs the message angry?\nAnswer:{?}", "options": [" yes", " no"]},
]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def spinf_logger():
    """The spinf_jax logger as Python leaves it (no handler, no level, propagating), restored afterwards:
    uvicorn_config, here and in other tests, configures it for the whole process."""
    logger = logging.getLogger("spinf_jax")
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers, logger.level, logger.propagate = [], logging.NOTSET, True
    yield logger
    logger.handlers, logger.level, logger.propagate = saved


def _written(logger: logging.Logger, formatter: logging.Formatter) -> io.StringIO:
    """What the logger writes at info and above, through the formatter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return stream


@pytest.fixture
def lines(spinf_logger):
    """Every spinf_jax log line at info and above, as the JSON formatter writes them, parsed."""
    stream = _written(spinf_logger, JsonFormatter())
    return lambda event: [
        line for line in map(json.loads, stream.getvalue().splitlines()) if line["event"] == event
    ]


@pytest.fixture(scope="module")
def engine(gemma_engine):
    """The default model with one small bucket: one program to compile."""
    return Engine(gemma_engine.model, Buckets((256,), block=64))


def test_a_request_line_carries_every_field(engine, lines):
    body = {
        "inputs": [
            {"id": "a", "messages": [{"role": "user", "content": "I was charged twice for September."}]},
            {
                "id": "b",
                "messages": [{"role": "user", "content": "Where is my parcel?"}],
                "query_ids": ["tone"],
            },
        ],
        "scoring": {"queries": QUERIES},
    }
    decisions = [
        {"id": "team", "question": "Which team?", "options": _options("billing", "shipping")},
        {"id": "urgent", "question": "Is it urgent?", "options": _options("yes", "no")},
    ]
    shared = {"state": {"body": "My card was charged twice."}, "decisions": decisions}
    with TestClient(create_app(Settings("spinf/gemma-3-270m"), engine)) as client:
        assert loaded(client)["status"] == "ok"
        scored = client.post("/v1/score", json=body)
        decided = client.post("/decide/shared", json=shared)
        refused = client.post("/v1/score", content=b"{not json")
        assert client.get("/health").status_code == 200  # not a scoring route, not an error: no line
    assert (scored.status_code, decided.status_code, refused.status_code) == (200, 200, 400), scored.text
    score_line, decide_line, refused_line = lines("request")

    assert list(score_line) == ["ts", "level", "event", *REQUEST_FIELDS]
    assert datetime.datetime.fromisoformat(score_line["ts"]).tzinfo is not None
    assert score_line["request_id"] == scored.headers["x-request-id"]
    assert score_line["request_id"].startswith("req_")
    expected = {"level": "info", "method": "POST", "path": "/v1/score", "status": 200, "error": None}
    expected |= {"inputs": 2, "questions": 3}  # a: both queries; b: the one it names
    assert _some(score_line, expected) == expected
    assert score_line["tokens"] == scored.json()["usage"]["prompt_tokens"] > 0
    assert score_line["queue_ms"] >= 0 and score_line["pass_ms"] > 0
    # The request's time holds its wait and its pass (each rounded to 0.01 ms).
    assert score_line["total_ms"] >= score_line["queue_ms"] + score_line["pass_ms"] - 0.02

    assert decide_line["request_id"] == decided.headers["x-request-id"] != score_line["request_id"]
    expected = {"path": "/decide/shared", "status": 200, "inputs": 1, "questions": 2}
    assert _some(decide_line, expected) == expected
    assert decide_line["tokens"] == decided.json()["processed_tokens"]

    envelope = refused.json()
    assert refused_line["request_id"] == envelope["request_id"] == refused.headers["x-request-id"]
    expected = {"level": "info", "status": 400, "error": "invalid_json", "inputs": None, "tokens": None}
    assert _some(refused_line, expected) == expected and refused_line["total_ms"] >= 0


def _options(*ids: str) -> list[dict]:
    return [{"id": i, "description": i.title()} for i in ids]


def _some(line: dict, like: dict) -> dict:
    return {key: line[key] for key in like}


def test_errors_are_logged_with_their_code_and_status(lines):
    """Outside a `with` block the test client does not start loading the model: it is warming up."""
    client = TestClient(create_app(Settings("spinf/gemma-3-270m", api_keys=("k",))))
    body = {"messages": [{"content": "hi"}], "scoring": {"queries": QUERIES}}
    assert client.post("/v1/score", json=body).status_code == 401
    warming = client.post("/v1/score", json=body, headers={"authorization": "Bearer k"})
    assert warming.status_code == 503
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200  # no line
    got = [(line["path"], line["status"], line["error"]) for line in lines("request")]
    assert got == [
        ("/v1/score", 401, "invalid_api_key"),
        ("/v1/score", 503, "warming_up"),
        ("/v1/nothing", 404, "not_found"),
    ]
    assert lines("request")[1]["request_id"] == warming.json()["request_id"]


def test_a_model_that_fails_to_load_is_an_error_line(lines, tmp_path):
    with TestClient(create_app(Settings(str(tmp_path / "missing")))) as client:
        assert loaded(client)["status"] == "error"
    [failed] = lines("failed")
    assert failed["level"] == "error" and "missing" in failed["error"]


def test_on_a_terminal_a_line_is_key_value(spinf_logger):
    stream = _written(spinf_logger, KeyValueFormatter())
    fields = {
        "request_id": "req_1",
        "path": "/v1/score",
        "status": 400,
        "error": "invalid_json",
        "tokens": None,
    }
    log(REQUESTS, "request", **fields, total_ms=1.25, note='two "words"')
    line = stream.getvalue()
    assert re.fullmatch(
        r"INFO: {5}\d\d:\d\d:\d\d request request_id=req_1 path=/v1/score status=400 error=invalid_json "
        r'total_ms=1.25 note="two \\"words\\""\n',
        line,
    ), line


@pytest.mark.parametrize(
    "stream, formatter", [(Terminal(), KeyValueFormatter), (io.StringIO(), JsonFormatter)]
)
def test_serve_logs_to_stderr_at_its_level_without_an_access_log(
    monkeypatch, spinf_logger, stream, formatter
):
    monkeypatch.setattr(sys, "stderr", stream)
    config = uvicorn_config(None, "127.0.0.1", 8000, "warning")
    assert config.access_log is False and logging.getLogger("uvicorn").handlers  # uvicorn's errors stay
    [handler] = spinf_logger.handlers
    assert isinstance(handler.formatter, formatter) and handler.stream is stream
    log(REQUESTS, "request", status=200)  # hidden at warning
    log(REQUESTS, "request", logging.ERROR, status=500)
    [line] = stream.getvalue().splitlines()
    assert "500" in line


def test_progress_off_a_terminal_is_json_lines_that_add_up(monkeypatch, lines):
    """What `serve` shows while the model loads and compiles, when stderr is a file or a pipe."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # whatever pytest's own stderr is
    settings = Settings(str(TINY), buckets=(256, 512), progress=True)
    with TestClient(create_app(settings)) as client:
        health = loaded(client)
        assert health["status"] == "ok"
    tensors = len(params(load_model(str(TINY), "fp32").decoder))
    load = lines("load")
    assert [line["tensors"] for line in load] == [tensors] * len(load)
    done = [line["tensors_done"] for line in load]
    assert done == sorted(set(done)) and done[-1] == tensors and len(load) < tensors
    compiled = lines("compile")
    assert [(line["bucket"], line["programs_done"], line["programs"]) for line in compiled] == [
        (256, 1, 2),
        (512, 2, 2),
    ]
    assert all(line["seconds"] >= 0 and line["elapsed_s"] >= line["seconds"] - 0.01 for line in compiled)
    # Each program's pass is timed once compiled, and the packer cuts by those times (never a smaller cost
    # for a larger bucket).
    timed = [line["pass_seconds"] for line in compiled]
    assert all(0 < t <= line["seconds"] for t, line in zip(timed, compiled, strict=True))
    assert health["pass_seconds"] == pytest.approx([timed[0], max(timed)], abs=1e-4)
    [ready] = lines("ready")
    assert ready["model"] == str(TINY) and ready["load_s"] >= 0
    assert ready["compile_s"] >= sum(line["seconds"] for line in compiled) - 0.02
    assert "%|" not in sys.stderr.getvalue()  # lines, not bars


def test_progress_on_a_terminal_is_a_bar(lines):
    terminal = Terminal()
    model = load_model(str(TINY), "fp32", Progress(terminal))
    tensors = len(params(model.decoder))
    assert re.search(rf"load: 100%.*{tensors}/{tensors}", terminal.getvalue())
    assert lines("load") == []  # a bar instead of lines


def test_the_library_is_silent_by_default(capsys, caplog):
    caplog.set_level(logging.DEBUG, logger="spinf_jax")
    Engine.load(str(TINY), "fp32", buckets=Buckets((256,), block=64)).warmup()
    assert capsys.readouterr() == ("", "")
    assert [r for r in caplog.records if r.name.startswith("spinf_jax")] == []


def test_a_start_is_ready_with_its_smallest_and_largest_bucket(monkeypatch, lines):
    """With more than two buckets the server is ready once its smallest and largest are compiled; the others
    compile behind it (progress "compile_background"), listed by /health under `compiling` until each has
    joined `buckets`, with a cost of its own in `pass_seconds`."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    settings = Settings(str(TINY), buckets=(256, 512, 1024), progress=True)
    with TestClient(create_app(settings)) as client:
        health = loaded(client)
        assert health["buckets"] + health.get("compiling", []) in ([256, 1024, 512], [256, 512, 1024])
        for _ in range(600):
            if "compiling" not in health:
                break
            time.sleep(0.1)
            health = client.get("/health").json()
        assert health["buckets"] == [256, 512, 1024] and len(health["pass_seconds"]) == 3
    assert [line["bucket"] for line in lines("compile")] == [256, 1024]
    assert [line["bucket"] for line in lines("compile_background")] == [512]
