"""The server's Prometheus metrics (docs/metrics.md lists them). Each app keeps its own registry, so several
apps in one process (the tests) count apart; the process and Python collectors are registered on it too."""

from collections.abc import Callable, Iterator, Sequence

import httpx
import msgspec
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from spinf_jax.api import ScoreResponse
from spinf_jax.engine import scoring_device
from spinf_jax.replicas import Replicas

# A request takes from about a millisecond (/health) to a minute (a full queue ahead of a large job).
REQUEST_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
PASS_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# nginx's "client closed request": the client hung up before the answer, so no status reached it. Litestar
# answers a body cut short with a 500, which would otherwise count as the server's fault.
DISCONNECTED = "499"
# Requests that matched no route (404, and 405 on a known path): one label value whatever the path, so a
# scanner cannot grow a series per path it tries.
UNMATCHED = "<unmatched>"


class DeviceMemory:
    """A collector of JAX's allocator statistics for the engine's device, read at scrape time. A backend that
    keeps none (the CPU answers None) exports nothing: zeros would read as a device with nothing in use."""

    STATS = {
        "bytes_in_use": ("spinf_device_memory_in_use_bytes", "Device memory held by live buffers."),
        "peak_bytes_in_use": ("spinf_device_memory_peak_bytes", "High-water mark of device memory in use."),
        "bytes_limit": ("spinf_device_memory_limit_bytes", "Device memory the allocator may use."),
    }

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = scoring_device().memory_stats() or {}
        for key, (name, documentation) in self.STATS.items():
            if key in stats:
                yield GaugeMetricFamily(name, documentation, value=stats[key])


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(DeviceMemory())
        self.requests = Counter(
            "spinf_requests",
            f"HTTP requests by route template and status ({DISCONNECTED}: the client hung up first).",
            ["path", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "spinf_request_seconds",
            "Time from a request's arrival to the end of its answer, by route template and status.",
            ["path", "status"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.questions = Counter(
            "spinf_questions_scored",
            "Questions (query x combination x content) scored.",
            registry=self.registry,
        )
        self.tokens = Counter(
            "spinf_tokens_scored",
            "Tokens processed, by kind (content, query, floor: the response's usage).",
            ["kind"],
            registry=self.registry,
        )
        self.pass_seconds = Histogram(
            "spinf_pass_seconds",
            "Device passes by bucket size (tokens) and duration.",
            ["bucket"],
            buckets=PASS_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.device_busy = Counter(
            "spinf_device_busy_seconds",
            "Seconds the device had a batch of passes to run, from each batch's launch to its results: over "
            "the wall time, how busy the host and the clients keep it.",
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "spinf_queue_depth", "Requests waiting for the engine.", registry=self.registry
        )

    def read_queue_depth(self, depth: Callable[[], int]) -> None:
        """Read the depth at each scrape from the runner's own count, rather than mirror every change."""
        self.queue_depth.set_function(depth)

    def request(self, path: str, status: str, seconds: float) -> None:
        self.requests.labels(path, status).inc()
        self.request_seconds.labels(path, status).observe(seconds)

    def scored(self, response: ScoreResponse) -> None:
        for result in response.results:
            self.questions.inc(sum(len(q.combinations) for q in result.queries))
        for kind, n in msgspec.structs.asdict(response.usage.prompt_tokens_details).items():
            self.tokens.labels(kind.removesuffix("_tokens")).inc(n)

    def on_batch(self, seconds: float) -> None:
        self.device_busy.inc(seconds)

    def on_pass(self, size: int, seconds: float) -> None:
        self.pass_seconds.labels(str(size)).observe(seconds)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format the scraper asks for (Prometheus text by default, or OpenMetrics), and
        its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class ReplicaMetrics:
    """`serve --devices`' front: every replica's metrics, scraped when the front is, each sample labelled with
    its `replica`; and the front's own view of each replica (ready, in flight, restarts). A replica that does
    not answer is left out of that scrape, and its spinf_replica_ready says why."""

    SCRAPE_TIMEOUT_S = 5.0

    def __init__(self, replicas: Replicas, keys: Sequence[str]):
        self.replicas = replicas
        self.headers = {"authorization": f"Bearer {keys[0]}"} if keys else {}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica in self.replicas.members:
            if replica.state != "ready":
                continue
            try:
                text = httpx.get(
                    f"{replica.url}/metrics", headers=self.headers, timeout=self.SCRAPE_TIMEOUT_S
                ).text
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    labels = {**sample.labels, "replica": str(replica.index)}
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from merged.values()
        labels = ["replica", "device"]
        ready = GaugeMetricFamily("spinf_replica_ready", "1 while the replica takes requests.", labels=labels)
        in_flight = GaugeMetricFamily(
            "spinf_replica_in_flight", "Requests sent to the replica and not yet answered.", labels=labels
        )
        restarts = CounterMetricFamily(
            "spinf_replica_restarts",
            "Times the replica's process exited and was started again.",
            labels=labels,
        )
        for replica in self.replicas.members:
            which = [str(replica.index), replica.device]
            ready.add_metric(which, float(replica.state == "ready"))
            in_flight.add_metric(which, replica.in_flight)
            restarts.add_metric(which, replica.restarts)
        yield from (ready, in_flight, restarts)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
