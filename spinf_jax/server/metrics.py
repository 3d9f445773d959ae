"""The server's Prometheus metrics (docs/metrics.md lists them). Each app keeps its own registry, so several
apps in one process (the tests) count apart; the process and Python collectors are registered on it too."""

from collections.abc import Callable, Iterator

import jax
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
from prometheus_client.metrics_core import GaugeMetricFamily

from spinf_jax.api import ScoreResponse

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
        stats = jax.devices()[0].memory_stats() or {}
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

    def on_pass(self, size: int, seconds: float) -> None:
        self.pass_seconds.labels(str(size)).observe(seconds)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format the scraper asks for (Prometheus text by default, or OpenMetrics), and
        its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
