"""/metrics (docs/metrics.md): what moves when requests are answered, under which labels, and what a client
that hangs up counts as. Scraped through Litestar's TestClient and read with prometheus_client's parser."""

from types import SimpleNamespace

import anyio
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from spinf_jax.server import metrics as metrics_module
from spinf_jax.server.app import Server, Settings, create_app
from spinf_jax.server.metrics import REQUEST_SECONDS_BUCKETS, Metrics
from tests.serving import loaded

MODEL = "spinf/gemma-3-270m"
BODY = {
    "messages": [
        {"role": "user", "content": "Customer support message:\nI was charged twice for September."}
    ],
    "scoring": {
        "queries": [
            {
                "id": "refund",
                "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
                "options": [" yes", " no"],
            }
        ]
    },
}


class Scrape(dict):
    """Every sample of one scrape, keyed by (sample name, labels)."""

    def __init__(self, text: str):
        super().__init__(
            ((s.name, frozenset(s.labels.items())), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )

    def value(self, name: str, **labels) -> float:
        return self.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str) -> float:
        """The sum over every label set."""
        return sum(value for (sample, _), value in self.items() if sample == name)

    def names(self) -> set[str]:
        return {name for name, _ in self}

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(labels)[label] for sample, labels in self if sample == name}


def scrape(client) -> Scrape:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"  # charset once
    return Scrape(response.text)


@pytest.fixture(scope="module")
def client(gemma_engine):
    with TestClient(create_app(Settings(MODEL), gemma_engine)) as client:
        assert loaded(client)["status"] == "ok"
        yield client


@pytest.fixture
def bare_client():
    """An app without its model: outside a `with` block the client does not run the startup that loads it."""
    return TestClient(create_app(Settings(MODEL)))


def test_a_scored_request_moves_requests_questions_tokens_and_passes(client):
    before = scrape(client)
    response = client.post("/v1/score", json=BODY)
    assert response.status_code == 200, response.text
    after = scrape(client)

    def moved(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    route = {"path": "/v1/score", "status": "200"}
    assert moved("spinf_requests_total", **route) == 1
    assert after.value("spinf_request_seconds_count", **route) == after.value("spinf_requests_total", **route)
    assert moved("spinf_questions_scored_total") == 1
    usage = response.json()["usage"]["prompt_tokens_details"]
    for kind in ("content", "query", "floor"):
        assert moved("spinf_tokens_scored_total", kind=kind) == usage[f"{kind}_tokens"], kind
    assert after.total("spinf_pass_seconds_count") > before.total("spinf_pass_seconds_count")
    assert after.label_values("spinf_pass_seconds_count", "bucket") <= {"256", "512", "1024"}
    busy = moved("spinf_device_busy_seconds_total")  # its batch, from launch to results: within its request
    assert (
        0
        < busy
        <= after.value("spinf_request_seconds_sum", **route)
        - before.value("spinf_request_seconds_sum", **route)
    )
    assert after.value("spinf_queue_depth") == 0
    assert after.value("process_resident_memory_bytes") > 0 and "python_info" in after.names()


def test_latency_histogram_has_the_documented_buckets(client):
    client.get("/health")
    samples = scrape(client)
    bounds = sorted(
        float(dict(labels)["le"])
        for name, labels in samples
        if name == "spinf_request_seconds_bucket"
        and dict(labels)["path"] == "/health"
        and dict(labels)["status"] == "200"
    )
    assert bounds == [*REQUEST_SECONDS_BUCKETS, float("inf")]
    counts = [
        samples.value("spinf_request_seconds_bucket", path="/health", status="200", le=le)
        for le in [*map(str, REQUEST_SECONDS_BUCKETS), "+Inf"]
    ]
    assert counts == sorted(counts) and counts[-1] == samples.value(
        "spinf_request_seconds_count", path="/health", status="200"
    )


def test_errors_count_under_the_route_template_never_the_raw_path(bare_client):
    assert bare_client.post("/v1/score", content=b"{nope").status_code == 400
    assert bare_client.get("/v1/nothing/12345").status_code == 404
    assert bare_client.get("/v1/score").status_code == 405
    samples = scrape(bare_client)
    assert samples.value("spinf_requests_total", path="/v1/score", status="400") == 1
    assert samples.value("spinf_requests_total", path="<unmatched>", status="404") == 1
    assert samples.value("spinf_requests_total", path="<unmatched>", status="405") == 1
    assert "/v1/nothing/12345" not in samples.label_values("spinf_requests_total", "path")


def test_a_client_that_hangs_up_mid_body_is_not_a_500(bare_client):
    """What uvicorn hands the app when the connection closes halfway through a body: a first chunk, then
    http.disconnect. Litestar answers it with a 500 that nobody receives; the count says 499."""
    messages = iter(
        [
            {"type": "http.request", "body": b'{"messages": [{"role": "user", "con', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/score", "raw_path": b"/v1/score", "root_path": "", "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"content-length", b"200")],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }  # fmt: skip
    anyio.run(bare_client.app, scope, receive, send)
    assert sent[0]["status"] == 500  # Litestar's answer, which the disconnected client never gets
    samples = scrape(bare_client)
    assert samples.value("spinf_requests_total", path="/v1/score", status="499") == 1
    assert samples.value("spinf_requests_total", path="/v1/score", status="500") == 0


def test_openmetrics_when_the_scraper_asks_for_it(bare_client):
    response = bare_client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.headers["content-type"].count("charset") == 1
    assert response.text.endswith("# EOF\n")


def test_queue_depth_is_read_from_the_runner_at_scrape_time():
    server = Server(Settings(MODEL))
    assert Scrape(server.metrics.exposition("")[0].decode()).value("spinf_queue_depth") == 0
    server.runner = SimpleNamespace(depth=3)
    assert Scrape(server.metrics.exposition("")[0].decode()).value("spinf_queue_depth") == 3


@pytest.mark.parametrize(
    "stats",
    [None, {"bytes_in_use": 1024, "peak_bytes_in_use": 4096, "bytes_limit": 1 << 30, "num_allocs": 7}],
)
def test_device_memory_only_where_the_backend_keeps_statistics(monkeypatch, stats):
    device = SimpleNamespace(memory_stats=lambda: stats)
    monkeypatch.setattr(metrics_module, "scoring_device", lambda: device)
    samples = Scrape(Metrics().exposition("")[0].decode())
    exported = {name for name in samples.names() if name.startswith("spinf_device_memory")}
    if stats is None:
        assert exported == set()  # nothing rather than zeros
    else:
        assert samples.value("spinf_device_memory_in_use_bytes") == 1024
        assert samples.value("spinf_device_memory_peak_bytes") == 4096
        assert samples.value("spinf_device_memory_limit_bytes") == 1 << 30
        assert len(exported) == 3
