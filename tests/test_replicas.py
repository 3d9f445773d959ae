"""Every device of a host (`serve --devices`, `score --devices`): the front sends each request to the least
loaded ready replica and on past one that is busy or gone; /health and /metrics speak for all replicas; a
replica on another device scores the same bits; a replica killed mid-job is started again and loses nothing.

The fast tests put the front over the session's server (twice, as two replicas) and over stand-ins that are
busy or not listening. The slow ones start real replica processes on the CPU with two forced host devices."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from litestar import Litestar, post

from spinf_jax import bulk, cli
from spinf_jax.replicas import Devices, Replica, Replicas, free_port, how_many, serve_args
from spinf_jax.scoring import Scorer
from spinf_jax.server.errors import EXCEPTION_HANDLERS, ApiError
from spinf_jax.server.front import create_front
from spinf_jax.server.protocol import in_thread
from spinf_jax.server.settings import Settings
from tests.serving import processes, serving

BODY = {
    "inputs": [
        {"id": "a", "messages": [{"role": "user", "content": "I was charged twice for September."}]},
        {"id": "b", "messages": [{"role": "user", "content": "My parcel never arrived."}]},
    ],
    "scoring": {
        "queries": [{"id": "topic", "template": "\n\nTopic:{?}", "options": [" billing", " shipping"]}]
    },
}
TWO_DEVICES = "--xla_force_host_platform_device_count=2"


def _front(*urls: str, settings: Settings | None = None, states=None):
    states = states or ["ready"] * len(urls)
    members = [
        Replica(i, f"cpu:{i}", url, state=s) for i, (url, s) in enumerate(zip(urls, states, strict=True))
    ]
    replicas = Replicas(members)
    return replicas, create_front(settings or Settings("spinf/gemma-3-270m"), replicas, "cpu")


def _results(response: httpx.Response) -> list:
    assert response.status_code == 200, response.text
    return response.json()["results"]


def test_serve_args_drop_the_fronts_own_flags():
    argv = ["m", "--devices", "2", "--port=9000", "--host", "0.0.0.0", "--buckets", "256", "--api-key", "k"]
    assert serve_args(argv) == ["m", "--buckets", "256", "--api-key", "k"]
    assert serve_args(["--devices=all", "--precision", "fp8"]) == ["--precision", "fp8"]


def test_devices_pin_a_replica_and_count():
    gpus, cpus = Devices("gpu", ("2", "5")), Devices("cpu", ("0", "1", "2"))
    assert gpus.pinned({"A": "1"}, 1) == {"A": "1", "CUDA_VISIBLE_DEVICES": "5"} and gpus.name(1) == "gpu:5"
    assert cpus.pinned({}, 2) == {"SPINF_JAX_DEVICE": "2"}
    assert how_many("all", cpus) == 3 and how_many("2", cpus) == 2
    for asked, why in [("4", "this host has 3 cpu"), ("0", "0 asked"), ("two", "not 'all' or a whole")]:
        with pytest.raises(ValueError, match=why):
            how_many(asked, cpus)


def test_the_least_loaded_ready_replica_is_chosen():
    members = [Replica(i, f"cpu:{i}", f"http://x{i}") for i in range(3)]
    replicas = Replicas(members)
    assert replicas.pick() is None and replicas.starting
    for member in members:
        member.state = "ready"
    first = replicas.pick()
    with replicas.using(first):
        second = replicas.pick()
        assert second is not first and first.in_flight == 1
        with replicas.using(second):
            third = replicas.pick()
            assert third not in (first, second)
    assert first.in_flight == second.in_flight == 0
    assert replicas.pick(skip=[first, second, third]) is None
    # Equally loaded, they take turns.
    assert [replicas.pick().index for _ in range(4)] == [(third.index + i) % 3 for i in range(1, 5)]


def test_the_others_start_once_the_first_has_compiled_every_bucket(monkeypatch):
    """With stagger the first replica fills the compile cache alone: the others start only when its /health
    lists no bucket still compiling in the background, not as soon as it is ready."""
    first, second = Replica(0, "cpu:0", "http://first"), Replica(1, "cpu:1", "http://second")
    first.process = SimpleNamespace(poll=lambda: None)  # running
    replicas, started = Replicas([first, second]), []
    monkeypatch.setattr(replicas, "_start", started.append)
    compiling = {"ready": True, "compiling": [512]}
    answers = iter([compiling, compiling, {"ready": True}])

    class Health:
        def get(self, url):
            return httpx.Response(200, json=next(answers))

    for expected in ([], [], [second]):
        replicas._look_at(first, Health())
        replicas._start_waiting()
        assert first.state == "ready" and started == expected
    assert not first.compiling


def test_the_front_scores_what_a_replica_scores_and_speaks_for_all(default_url):
    direct = _results(httpx.post(f"{default_url}/v1/score", json=BODY, timeout=120))
    _, app = _front(default_url, default_url)
    with serving(app) as url:
        for _ in range(2):  # each replica once
            assert _results(httpx.post(f"{url}/v1/score", json=BODY, timeout=120)) == direct
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["model"] == "spinf/gemma-3-270m" and "device" not in health
        assert [(r["index"], r["state"], r["in_flight"]) for r in health["replicas"]] == [
            (0, "ready", 0),
            (1, "ready", 0),
        ]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'spinf_replica_ready{device="cpu:1",replica="1"} 1.0' in metrics
        assert 'path="/v1/score",replica="0",status="200"' in metrics
        assert httpx.get(f"{url}/schema/openapi.json").json()["paths"]["/v1/score"]
        missing = httpx.get(f"{url}/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        bad = httpx.post(f"{url}/v1/score", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


@post("/v1/score")
async def _always_busy() -> None:
    raise ApiError("concurrency_limit", "too many requests are waiting; retry later", retry_after=7)


def test_a_busy_or_gone_replica_passes_the_request_on(default_url):
    busy = Litestar([_always_busy], exception_handlers=EXCEPTION_HANDLERS)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with in_thread(busy) as busy_url:
        replicas, app = _front(gone, busy_url, default_url)
        with serving(app) as url:
            assert len(_results(httpx.post(f"{url}/v1/score", json=BODY, timeout=120))) == 2
            assert [r.state for r in replicas.members] == ["failed", "ready", "ready"]  # no supervisor here
            replicas.members[2].state = "down"
            refused = httpx.post(f"{url}/v1/score", json=BODY)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "7"
            replicas.members[1].state = "failed"
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "warming_up"
            waiting = httpx.post(f"{url}/v1/score", json=BODY)
            assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "warming_up"
            replicas.members[2].state = "failed"
            failed = httpx.post(f"{url}/v1/score", json=BODY).json()["error"]
            assert failed["code"] == "model_failed" and "replica 0" in failed["message"]
            assert httpx.get(f"{url}/health").json()["status"] == "error"


def test_the_fronts_metrics_ask_for_the_key_when_told(default_url):
    settings = Settings("spinf/gemma-3-270m", api_keys=("k1",), metrics_auth=True)
    _, app = _front(default_url, settings=settings)
    with serving(app) as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"authorization": "Bearer k1"}).status_code == 200


def test_batches_in_flight_are_written_in_input_order(gemma_engine, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"id": str(i), "text": f"Message number {i}."}) + "\n" for i in range(5))
    )
    scorer = Scorer(gemma_engine)
    in_process = bulk.in_process(scorer)

    def slow_first(body):  # later batches finish first
        time.sleep(0.3 if body["inputs"][0]["id"] == "0" else 0.0)
        return in_process(body)

    template = {"scoring": BODY["scoring"]}
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    bulk.run(source, one, template, in_process, batch=2)
    summary = bulk.run(source, many, template, slow_first, batch=2, in_flight=4)
    assert summary.scored == 5 and many.read_text() == one.read_text()


@pytest.mark.slow  # a subprocess (about 3 s)
def test_a_replica_stops_once_its_front_is_gone(tmp_path):
    """A front killed outright (SIGKILL, the OOM killer) cannot stop its replicas: they stop themselves."""
    pidfile = tmp_path / "pid"
    replica = ("import os, time; from spinf_jax.replicas import outlive_no_front; "
               f"outlive_no_front(os.environ, 0.05); open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
               "time.sleep(60)")  # fmt: skip
    front = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" -c "{replica}" & sleep 60'],
        env={**os.environ, "SPINF_JAX_REPLICA": "0"},
    )
    _wait(lambda: pidfile.exists() and pidfile.read_text())
    pid = int(pidfile.read_text())
    front.kill()
    front.wait()

    def gone() -> bool:  # exited (a zombie until whoever adopted it reaps it)
        stat = Path(f"/proc/{pid}/stat")
        return not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")

    _wait(gone, timeout=20)


def test_the_flags_are_checked(tmp_path, capsys):
    assert cli.main(["serve", "--devices", "0", "--check"]) == 2
    assert "--devices: must be at least 1, not 0" in capsys.readouterr().err
    assert cli.main(["serve", "--devices", "all", "--check"]) == 0
    assert "a replica on each of all device(s)" in capsys.readouterr().out
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "x"}\n')
    common = ["score", str(source), "--out", str(tmp_path / "o.jsonl"), "--pack", "spinf/reviews"]
    assert cli.main([*common, "--url", "http://x", "--devices", "2"]) == 2


# The slow tier: replica processes on two forced host devices of the CPU, on SmolLM2 (the smallest built-in
# model with a tokenizer) in fp32, compared with the session's engine of it.
# Small passes: on the CPU, each replica's warm-up pass of a large bucket takes seconds.
MODEL = [
    "spinf/smollm2-135m-instruct",
    "--precision",
    "fp32",
    "--buckets",
    "256",
    "--log-level",
    "warning",
]


def _two_devices() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {TWO_DEVICES}".strip()}


def _children(pid: int) -> list[int]:
    return [child for child, (parent, _) in processes().items() if parent == pid]


def _wait(check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)
    return result


def _replicas(url: str) -> list[tuple[str, str, int]] | None:
    """(device, state, restarts) of each replica, as the front's /health says; None while it is not up."""
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
    except httpx.TransportError:
        return None
    return [(r["device"], r["state"], r["restarts"]) for r in health.get("replicas", [])]


@pytest.mark.slow  # the front and two replica processes, each loading a model
def test_serve_on_every_device_restarts_a_lost_replica(smollm_engine):
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "spinf_jax.cli",
        "serve",
        *MODEL,
        "--devices",
        "all",
        "--port",
        str(port),
    ]
    front = subprocess.Popen(command, env=_two_devices(), stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _replicas(url) == [("cpu:0", "ready", 0), ("cpu:1", "ready", 0)])
        expected = json.loads(json.dumps(Scorer(smollm_engine).score(BODY)["results"]))
        for _ in range(2):  # each replica once: the bits of the session's engine
            assert _results(httpx.post(f"{url}/v1/score", json=BODY, timeout=120)) == expected
        replicas = sorted(_children(front.pid))
        assert len(replicas) == 2
        os.kill(replicas[1], signal.SIGKILL)
        for _ in range(3):  # answered by the other meanwhile
            assert _results(httpx.post(f"{url}/v1/score", json=BODY, timeout=120)) == expected
        _wait(lambda: _replicas(url) == [("cpu:0", "ready", 0), ("cpu:1", "ready", 1)])
        assert _results(httpx.post(f"{url}/v1/score", json=BODY, timeout=120)) == expected
    finally:
        running = _children(front.pid)
        front.send_signal(signal.SIGTERM)  # the front stops its replicas first
        _, err = front.communicate(timeout=120)
    assert front.returncode == 0, err[-3000:]  # a graceful stop, not death by the signal it caught
    assert (
        "replica_exited" in err
        and len(running) == 2
        and not any(Path(f"/proc/{p}").exists() for p in running)
    )


@pytest.mark.slow  # two replica processes, each loading a model
def test_score_on_every_device_gives_the_bits_of_one(smollm_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", _two_devices()["XLA_FLAGS"])
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"id": str(i), "text": f"Order {i} is late."}) + "\n" for i in range(10))
    )
    queries = tmp_path / "q.json"
    queries.write_text(json.dumps(BODY["scoring"]))
    out, one = tmp_path / "out.jsonl", tmp_path / "one.jsonl"
    argv = ["score", str(source), "--out", str(out), "--queries", str(queries), "--batch", "3",
            "--devices", "2", "--model", *MODEL[:3], "--buckets", "256"]  # fmt: skip
    assert cli.main(argv) == 0
    bulk.run(source, one, {"scoring": BODY["scoring"]}, bulk.in_process(Scorer(smollm_engine)), batch=3)
    assert out.read_text() == one.read_text()


def test_the_kubernetes_manifest_serves_on_one_gpu_and_probes_health():
    import yaml

    text = (Path(__file__).resolve().parent.parent / "docs" / "scale-out.md").read_text()
    manifest = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    deployment, service = yaml.safe_load_all(manifest)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert cli.main(["serve", *container["args"], "--check"]) == 0  # the entrypoint adds `serve`
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["containerPort"] == 8000


@pytest.mark.slow  # stand-in replica processes, and seconds of waiting for the deadlines
def test_a_stuck_replica_is_found_its_requests_go_elsewhere_and_it_is_restarted(monkeypatch):
    """A replica stopped with SIGSTOP (stand-in processes, tests/fake_replica.py): within the health deadline
    it is marked down in /health and /metrics, the request it held is answered by the other replica, and
    once stuck past STUCK_RESTART_S it is killed and started again."""
    from spinf_jax import replicas as replicas_module

    monkeypatch.setattr(replicas_module, "HEALTH_DEADLINE_S", 1.0)
    monkeypatch.setattr(replicas_module, "STUCK_RESTART_S", 3.0)
    members = [Replica(i, f"cpu:{i}", f"http://127.0.0.1:{free_port()}") for i in range(2)]
    pool = Replicas(members)
    pool._command = [sys.executable, str(Path(__file__).with_name("fake_replica.py"))]
    with in_thread(create_front(Settings("spinf/gemma-3-270m"), pool, "cpu")) as url:
        _wait(lambda: all(r.state == "ready" for r in members), timeout=60)
        answers = []
        asking = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{url}/v1/score", json={"delay": 3}, timeout=60))
        )
        started = time.monotonic()
        asking.start()
        _wait(lambda: any(r.in_flight for r in members), timeout=10)
        held = next(r for r in members if r.in_flight)
        other = next(r for r in members if r is not held)
        first_pid = held.process.pid
        os.kill(first_pid, signal.SIGSTOP)
        try:
            asking.join(timeout=30)
            assert answers and answers[0].json() == {"port": int(other.url.rsplit(":", 1)[1])}
            assert time.monotonic() - started < 3 + 1 + 5  # its own 3 s, the deadline, and some slack
            states = {r["index"]: r["state"] for r in httpx.get(f"{url}/health").json()["replicas"]}
            assert states[held.index] == "down" or held.restarts == 1
            _wait(lambda: held.restarts == 1 and held.state == "ready", timeout=30)
            assert held.process.pid != first_pid
        finally:  # the stopped process, where the supervisor has not killed it
            with contextlib.suppress(ProcessLookupError):
                os.kill(first_pid, signal.SIGKILL)
