"""Honest back-pressure: Retry-After from the queue's own measured rate, a full queue refused before the
body is read, abandoned requests dropped before their pass, and shutdown that answers what it accepted."""

import asyncio
import itertools
import socket
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import uvicorn
from litestar.testing import TestClient

from spinf_jax.errors import ScoringError
from spinf_jax.runner import LAUNCH_LEAD, Runner
from spinf_jax.server import app as app_module
from spinf_jax.server import protocol
from spinf_jax.server.app import Settings, create_app
from tests.serving import loaded

BODY = {
    "messages": [{"content": "Hello there."}],
    "scoring": {"queries": [{"id": "q", "template": "\n\nAnswer:{?}", "options": [" yes", " no"]}]},
}


class SlowEngine:
    """Scores at 1,000 tokens per second once `gate` is open, and remembers what it scored."""

    def __init__(self):
        self.buckets = SimpleNamespace(largest=10**9)
        self.gate = threading.Event()
        self.scored: list[list] = []

    @staticmethod
    def cut(trees):
        """A pass per token: no prefix costs less per token than the whole batch; costs are not seconds."""
        return SimpleNamespace(
            cost=[float(sum(len(t) for t in trees[:i])) for i in range(len(trees) + 1)],
            last_seconds=lambda end: 0.0,
        )

    def launch(self, trees, cuts=None, behind=None):
        """Engine.launch's handle: the batch runs (one pass) once the gate is open and something waits."""
        ran = threading.Lock()

        def wait(leaving=0):
            self.gate.wait()
            if not leaving and ran.acquire(blocking=False):
                time.sleep(sum(len(t) for t in trees) / 1000)

        return SimpleNamespace(trees=trees, wait=wait)

    def collect(self, launched):
        launched.wait()
        self.scored.append(launched.trees)
        return [len(t) for t in launched.trees]


def _runner(max_queue=8) -> tuple[Runner, SlowEngine]:
    engine = SlowEngine()
    return Runner(engine, max_queue=max_queue, max_delay=0.0), engine


def _submit(runner: Runner, tokens: int):
    return runner.submit(SimpleNamespace(trees=[[0] * tokens]), lambda plan, scored: scored)


def test_retry_after_is_the_queue_over_the_measured_rate():
    runner, engine = _runner()
    assert runner.retry_after() == 1  # nothing measured yet
    engine.gate.set()
    _submit(runner, 200).result(timeout=10)  # measures ~1,000 tokens/s
    engine.gate.clear()
    futures = [_submit(runner, 1000) for _ in range(6)]  # 6,000 tokens: about 6 s of work
    assert 4 <= runner.retry_after() <= 8
    engine.gate.set()
    for f in futures:
        f.result(timeout=30)
    assert runner.retry_after() == 1  # nothing left


def test_quiet_waits_for_the_device_and_holds_launches_back():
    """Runner.quiet (what the profiler starts and stops in): entered only once the batch on the device has
    run and been read; no batch is launched inside it; what queued meanwhile runs after it."""
    runner, engine = _runner()
    first = _submit(runner, 100)
    time.sleep(0.2)  # launched: on the "device" until the gate opens
    entered, leave, seen = threading.Event(), threading.Event(), []

    def profile():
        with runner.quiet():
            entered.set()
            seen.append(len(engine.scored))
            leave.wait()

    thread = threading.Thread(target=profile)
    thread.start()
    assert not entered.wait(0.3)  # the device is busy
    engine.gate.set()
    assert entered.wait(10) and seen == [1] and first.result(timeout=10) == [100]
    second = _submit(runner, 50)
    time.sleep(0.3)
    assert not second.done() and len(engine.scored) == 1  # not launched while quiet
    leave.set()
    assert second.result(timeout=10) == [50]
    thread.join(timeout=10)
    runner.close()
    with runner.quiet():  # a profile that ends after shutdown
        pass


def test_a_cancelled_request_is_dropped_before_its_pass():
    runner, engine = _runner()
    first = _submit(runner, 10)  # the engine thread takes it and waits at the gate
    time.sleep(0.2)
    left, stays = _submit(runner, 20), _submit(runner, 30)
    assert left.cancel()  # its client hung up while it was queued
    engine.gate.set()
    assert first.result(timeout=10) == [10] and stays.result(timeout=10) == [30]
    assert [len(t) for batch in engine.scored for t in batch] == [10, 30]
    assert runner.retry_after() == 1 and runner.depth == 0


def test_shutdown_answers_what_was_accepted():
    runner, engine = _runner()
    futures = [_submit(runner, 10) for _ in range(3)]
    engine.gate.set()
    runner.close()
    assert [f.result(timeout=1) for f in futures] == [[10]] * 3


def test_shutdown_fails_what_it_cannot_finish(monkeypatch):
    runner, engine = _runner()
    _submit(runner, 10)  # holds the engine thread at the gate
    time.sleep(0.2)
    waiting = _submit(runner, 10)
    monkeypatch.setattr(runner._thread, "join", lambda timeout: None)  # the thread does not finish in time
    runner.close()
    with pytest.raises(ScoringError) as e:
        waiting.result(timeout=1)
    assert e.value.code == "shutting_down" and e.value.status == 503
    engine.gate.set()


async def _post(app, messages: list[dict]) -> list[dict]:
    """POST /v1/score over raw ASGI: the client sends `messages`, then nothing more; returns what the app
    sent back."""
    sent = []

    async def receive():
        return messages.pop(0) if messages else await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/score", "raw_path": b"/v1/score", "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("t", 80),
        "root_path": "", "app": app, "state": {},
    }  # fmt: skip
    await app(scope, receive, send)
    return sent


def test_a_body_that_stops_halfway_times_out(gemma_engine, monkeypatch):
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.5)
    app = create_app(Settings("spinf/gemma-3-270m"), gemma_engine)
    with TestClient(app):
        half = {"type": "http.request", "body": b'{"messages": [', "more_body": True}
        start = time.monotonic()
        sent = asyncio.run(_post(app, [half]))
        assert 0.5 <= time.monotonic() - start < 5
        assert sent[0]["status"] == 408
        assert msgspec.json.decode(sent[1]["body"])["error"]["code"] == "request_timeout"


def test_a_full_queue_refuses_before_reading_the_body(gemma_engine):
    app = create_app(Settings("spinf/gemma-3-270m", max_queue=1), gemma_engine)
    with TestClient(app) as client:
        assert loaded(client)["status"] == "ok"
        runner = app.state.server.runner
        runner._pending = 1  # the queue is full
        try:
            # The body is not even JSON: a 429 shows it was never read.
            response = client.post("/v1/score", content=b"{not json")
            assert response.status_code == 429
            assert response.json()["error"]["code"] == "concurrency_limit"
            assert int(response.headers["retry-after"]) >= 1
        finally:
            runner._pending = 0
        assert client.post("/v1/score", json=BODY).status_code == 200


def test_a_client_that_leaves_is_not_scored(gemma_engine, monkeypatch):
    """Over ASGI: the body arrives, then the client hangs up while the engine is busy; its plan is dropped
    before the pass and the engine never scores it."""
    app = create_app(Settings("spinf/gemma-3-270m"), gemma_engine)
    with TestClient(app) as client:
        assert loaded(client)["status"] == "ok"
        runner = app.state.server.runner
        gate, scored = threading.Event(), []
        real = runner.engine.launch

        def gated(trees, cuts=None, behind=None):
            gate.wait()
            scored.append(len(trees))
            return real(trees, cuts, behind)

        monkeypatch.setattr(runner.engine, "launch", gated)
        busy = threading.Thread(target=lambda: client.post("/v1/score", json=BODY))
        busy.start()  # holds the engine thread at the gate
        time.sleep(0.5)

        body = {"type": "http.request", "body": msgspec.json.encode(BODY), "more_body": False}
        sent = asyncio.run(_post(app, [body, {"type": "http.disconnect"}]))
        assert sent[0]["status"] == 499
        assert runner.depth == 1  # still queued (cancelled): the runner drops it when it gets to it
        gate.set()
        busy.join(timeout=60)
        time.sleep(0.5)
        # One launch, the busy request's: its tree, and its floor's unless an earlier test in this process
        # cached it (so the count of trees depends on the order). The abandoned one never reached a pass.
        assert len(scored) == 1 and scored[0] in (1, 2)
        assert runner.depth == 0


def test_headers_that_never_finish_lose_their_connection(gemma_engine, monkeypatch):
    monkeypatch.setattr(protocol, "HEADER_TIMEOUT_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = protocol.uvicorn_config(
        create_app(Settings("spinf/gemma-3-270m"), gemma_engine), "127.0.0.1", port
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            start = time.monotonic()
            assert slow.recv(1024) == b""  # closed by the server
            assert 0.4 <= time.monotonic() - start < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as prompt:  # others are served
            prompt.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert prompt.recv(1024).startswith(b"HTTP/1.1 ")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as malformed:  # the envelope, as JSON
            malformed.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
            reply = b""
            while chunk := malformed.recv(4096):
                reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
            error = msgspec.json.decode(body)["error"]
            assert error["code"] == "invalid_request" and "malformed HTTP request" in error["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class Handle:
    """Engine.launch's handle for a batch of two passes: `last` set, the device is on its last pass; `done`
    set, it is done."""

    def __init__(self, trees, behind):
        self.trees, self.behind = trees, behind
        self.last, self.done = threading.Event(), threading.Event()

    def wait(self, leaving=0):
        (self.last if leaving else self.done).wait()


def test_batches_are_queued_behind_the_last_pass_and_results_are_read_off_the_engine_thread():
    """While a batch runs, the requests that arrive make the next batch. It is launched behind the running
    batch once the device is on that batch's last pass (the device does not wait for the host between them);
    before that, more requests may join it, up to the largest bucket, which then waits for the last pass.
    Results are read on the waiter thread and the answers built on finisher threads: the engine thread only
    gathers and launches."""
    launched, reads, threads = [], [], []

    class Device:
        buckets = SimpleNamespace(largest=4)  # tokens
        cut = staticmethod(SlowEngine.cut)

        def launch(self, trees, cuts=None, behind=None):
            launched.append(Handle(trees, behind))
            return launched[-1]

        def collect(self, handle):
            reads.append((len(handle.trees), threading.current_thread().name))
            return [len(t) for t in handle.trees]

    def finish(plan, scored):
        threads.append(threading.current_thread().name)
        return scored

    def until(condition):
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    busy = []  # the device's seconds on each batch (the busy-time metric)
    runner = Runner(Device(), max_queue=8, max_delay=0.0, on_batch=busy.append)
    first = runner.submit(SimpleNamespace(trees=[[0]]), finish)
    until(lambda: launched)
    later = [runner.submit(SimpleNamespace(trees=[[0]]), finish) for _ in range(2)]
    time.sleep(0.1)  # the device is not on the first batch's last pass yet: the two wait for company
    assert len(launched) == 1
    launched[0].last.set()
    until(lambda: len(launched) == 2)  # launched behind the first batch's last pass
    assert launched[1].behind is launched[0] and len(launched[1].trees) == 2
    later += [runner.submit(SimpleNamespace(trees=[[0]]), finish) for _ in range(4)]
    time.sleep(0.1)  # four tokens fill the largest bucket: they wait for the second batch's last pass
    assert len(launched) == 2 and not first.done() and not reads  # the first batch is still on the device
    time.sleep(0.2)
    launched[0].done.set()
    assert first.result(timeout=10) == [1]
    launched[1].last.set()
    until(lambda: len(launched) == 3)
    assert launched[2].behind is launched[1] and len(launched[2].trees) == 4
    for handle in launched[1:]:
        handle.last.set()
        handle.done.set()
    assert [f.result(timeout=10) for f in later] == [[1]] * 6
    runner.close()
    assert reads == [(1, "spinf-wait_0"), (2, "spinf-wait_0"), (4, "spinf-wait_0")]
    # A batch's device time starts when the one before is done, not at its launch: no second counted
    # twice. Its requests' queue time runs until then.
    assert busy[0] > 0.2 and busy[1] < 0.1 and busy[2] < 0.1
    assert all(f.queue_s > 0.2 for f in later) and all(f.pass_s < 0.1 for f in later)
    assert "spinf-engine" not in threads and len(threads) == 7
    # A batch gathered with the device idle goes on its own, not behind anything.
    assert launched[0].behind is None


def test_the_next_batch_takes_what_comes_until_just_before_the_last_pass_ends():
    """With the passes' seconds measured, a batch gathered while the device runs is launched LAUNCH_LEAD
    before the running batch's last pass should end, not as soon as the device is on it: a request that
    comes during that pass still joins."""
    launched = []

    class Device:
        buckets = SimpleNamespace(largest=100)

        @staticmethod
        def cut(trees):
            return SimpleNamespace(
                cost=[float(i) for i in range(len(trees) + 1)], last_seconds=lambda end: 0.4
            )

        def launch(self, trees, cuts=None, behind=None):
            launched.append((Handle(trees, behind), time.perf_counter()))
            return launched[-1][0]

        def collect(self, handle):
            return [len(t) for t in handle.trees]

    runner = Runner(Device(), max_queue=8, max_delay=0.0)
    first = runner.submit(SimpleNamespace(trees=[[0]]), lambda plan, scored: scored)
    deadline = time.monotonic() + 10
    while not launched:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    later = [runner.submit(SimpleNamespace(trees=[[0]]), lambda plan, scored: scored)]
    on_last = time.perf_counter()
    launched[0][0].last.set()  # the device is on the first batch's last pass, 0.4 s from its end
    time.sleep(0.1)
    later.append(runner.submit(SimpleNamespace(trees=[[0]]), lambda plan, scored: scored))
    time.sleep(0.1)
    assert len(launched) == 1  # still gathering
    while len(launched) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle, at = launched[1]
    assert len(handle.trees) == 2 and handle.behind is launched[0][0]
    assert 0.4 - LAUNCH_LEAD - 0.05 <= at - on_last < 0.4  # before the pass ends, not much earlier
    for h, _ in launched:
        h.last.set()
        h.done.set()
    assert [f.result(timeout=10) for f in [first, *later]] == [[1]] * 3
    runner.close()


class Buckets2048:
    """Passes in buckets every 2,048 rows, a pass costing its rows: what Engine.cut gives."""

    buckets = SimpleNamespace(largest=10**9)

    def __init__(self):
        self.events, self.done = [], threading.Event()

    @staticmethod
    def cut(trees):
        rows = [-(-sum(len(t) for t in trees[:i]) // 2048) * 2048 for i in range(len(trees) + 1)]
        return SimpleNamespace(cost=[float(r) for r in rows], last_seconds=lambda end: 0.0)

    def launch(self, trees, cuts=None, behind=None):
        self.events.append(("launch", len(trees)))
        return SimpleNamespace(trees=trees, wait=lambda leaving=0: self.done.wait())

    def collect(self, launched):
        return [len(t) for t in launched.trees]


@pytest.mark.parametrize("hold_back, launches", [(True, [1, 5, 1]), (False, [1, 6])])
def test_a_batch_leaves_its_last_requests_for_the_next_where_that_costs_less_per_token(hold_back, launches):
    """Six 1,200-token requests that came while a pass ran: five fill 6,144 rows (98% useful), six would
    take 8,192 (88%), so the sixth leads the next batch, and is launched with it whatever that costs; every
    request is answered. A batch gathered with the device idle goes whole. `serve --no-hold-back` launches
    the six at once."""
    device = Buckets2048()
    runner = Runner(device, max_queue=16, max_delay=0.0, hold_back=hold_back)
    first = _submit(runner, 1200)
    deadline = time.monotonic() + 10
    while not device.events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    later = [_submit(runner, 1200) for _ in range(6)]
    time.sleep(0.1)
    device.done.set()
    assert [f.result(timeout=10) for f in [first, *later]] == [[1200]] * 7
    runner.close()
    assert device.events == [("launch", n) for n in launches]
    # Held once at most: with a held request at its head a batch launches at least that one.
    batch = [(SimpleNamespace(trees=[[0] * n]), None, SimpleNamespace(tokens=n)) for n in (2000, 600)]
    assert runner._split(batch, 0)[:2] == (batch[:1], batch[1:])  # 2,048 rows for 2,000 tokens, not 4,096
    assert runner._split(batch, 2)[:2] == (batch, [])


def _plan(trees: int, tokens: int = 10):
    return SimpleNamespace(trees=[[t] * tokens for t in range(trees)])


def test_a_large_request_takes_turns_with_the_small_ones_that_come_meanwhile():
    """A request of 40 trees where a pass holds 50 tokens runs 5 trees a slice; small requests sent while it
    runs go into a launch of their own before its next slice, instead of waiting for all of its slices (or
    for the next one's pass), and its answer is every tree in order."""
    engine = SlowEngine()
    engine.buckets = SimpleNamespace(largest=50)
    runner = Runner(engine, max_queue=64, max_delay=0.0, hold_back=False)
    large = runner.submit(_plan(40), lambda plan, scored: scored)
    time.sleep(0.2)  # its first slice is at the gate
    small = [runner.submit(SimpleNamespace(trees=[[99] * 3]), lambda plan, scored: scored) for _ in range(3)]
    engine.gate.set()
    assert [f.result(timeout=10) for f in small] == [[3]] * 3
    assert large.result(timeout=10) == [10] * 40
    passes = [[t[0] for t in batch] for batch in engine.scored]
    assert passes[0] == [0, 1, 2, 3, 4] and passes[1] == [99, 99, 99]  # the small ones, then the next slice
    assert passes[2] == [5, 6, 7, 8, 9]
    assert sum(len(p) for p in passes) == 43 and all(len([t for t in p if t != 99]) <= 5 for p in passes)
    assert large.queue_s is not None and large.pass_s > 0  # its log line: first wait, all its passes
    assert runner.depth == 0 and runner.retry_after() == 1


def test_small_requests_that_keep_coming_do_not_starve_a_large_one():
    """Small requests arriving all the time: a launch of small ones at most between two slices, so the large
    request advances a slice every other launch."""
    engine = SlowEngine()
    engine.buckets = SimpleNamespace(largest=50)
    runner = Runner(engine, max_queue=256, max_delay=0.0, hold_back=False)
    large = runner.submit(_plan(40), lambda plan, scored: scored)
    engine.gate.set()
    small = []
    while not large.done():
        small.append(runner.submit(SimpleNamespace(trees=[[99] * 3]), lambda plan, scored: scored))
        time.sleep(0.005)
    assert large.result(timeout=10) == [10] * 40 and all(f.result(timeout=10) == [3] for f in small)
    runner.close()
    slices = [i for i, batch in enumerate(engine.scored) if any(t[0] != 99 for t in batch)]
    assert len(slices) == 8 and all(b - a <= 2 for a, b in itertools.pairwise(slices))


def test_a_large_request_whose_client_leaves_stops_between_slices():
    engine = SlowEngine()
    engine.buckets = SimpleNamespace(largest=50)
    runner = Runner(engine, max_queue=64, max_delay=0.0, hold_back=False)
    first = runner.submit(SimpleNamespace(trees=[[7] * 10]), lambda plan, scored: scored)
    time.sleep(0.2)  # at the gate
    large = runner.submit(_plan(40), lambda plan, scored: scored)
    assert large.cancel()  # queued, its first slice not launched: the client left
    engine.gate.set()
    assert first.result(timeout=10) == [10]
    time.sleep(0.3)
    assert [[t[0] for t in batch] for batch in engine.scored] == [[7]] and runner.depth == 0


def test_a_slice_that_fails_fails_its_request_once(monkeypatch):
    engine = SlowEngine()
    engine.buckets = SimpleNamespace(largest=50)
    runner = Runner(engine, max_queue=64, max_delay=0.0, hold_back=False)
    calls = []

    def collect(launched):
        calls.append(len(launched.trees))
        if len(calls) == 2:
            raise RuntimeError("device fault")
        return [len(t) for t in launched.trees]

    monkeypatch.setattr(engine, "collect", collect)
    large = runner.submit(_plan(40), lambda plan, scored: scored)
    engine.gate.set()
    with pytest.raises(RuntimeError, match="device fault"):
        large.result(timeout=10)
    time.sleep(0.3)
    assert len(calls) <= 3  # the slices after the failure are not launched (one may have been, behind it)


def test_a_running_large_request_that_is_abandoned_launches_no_more_slices():
    engine = SlowEngine()
    engine.buckets = SimpleNamespace(largest=50)
    runner = Runner(engine, max_queue=64, max_delay=0.0, hold_back=False)
    large = runner.submit(_plan(40), lambda plan, scored: scored)
    time.sleep(0.2)  # its first slice launched, at the gate
    assert not large.cancel()  # running: not cancelled as a Future, but stopped
    engine.gate.set()
    with pytest.raises(Exception, match="abandoned"):
        large.result(timeout=10)
    time.sleep(0.3)
    assert len(engine.scored) <= 2 and runner.depth == 0


def test_a_request_past_its_deadline_is_answered_504_and_the_server_goes_on(gemma_engine):
    app = create_app(Settings("spinf/gemma-3-270m", request_deadline_s=0.001), gemma_engine)
    with TestClient(app) as client:
        assert loaded(client)["status"] == "ok"
        response = client.post("/v1/score", json=BODY)
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["code"] == "deadline_exceeded" and "0.001 s" in error["message"]
        assert client.get("/health").json()["status"] == "ok"


def test_sigterm_closes_keep_alive_connections_cleanly():
    """On shutdown (SIGTERM, Ctrl-C) a response in flight says `Connection: close`, and a request sent on an
    idle keep-alive connection just after the signal is answered (with `Connection: close`), not reset; an
    idle connection is closed once DRAIN_IDLE_S has passed."""
    release = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = protocol.uvicorn_config(app, "127.0.0.1", port, "warning")
    config.lifespan = "off"
    server = protocol.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)

    def ask(conn, path: str) -> bytes:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\nok" not in reply and (chunk := conn.recv(4096)):
            reply += chunk
        return reply

    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as idle,
        socket.create_connection(("127.0.0.1", port), timeout=10) as busy,
        socket.create_connection(("127.0.0.1", port), timeout=10) as quiet,
    ):
        for conn in (idle, busy, quiet):
            assert b"connection: close" not in ask(conn, "/").lower()  # kept alive before the signal
        busy.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        server.should_exit = True  # what SIGTERM sets
        time.sleep(0.3)
        late = ask(idle, "/")  # a client's next request, on the connection it kept
        assert late.startswith(b"HTTP/1.1 200") and b"connection: close" in late.lower()
        assert idle.recv(16) == b""  # then closed, cleanly
        release.set()
        reply = b""
        while chunk := busy.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" in reply.lower()
        start = time.monotonic()
        assert quiet.recv(16) == b""  # the idle one, closed after the drain
        assert time.monotonic() - start < protocol.DRAIN_IDLE_S + 2
    thread.join(timeout=30)
    assert not thread.is_alive()
