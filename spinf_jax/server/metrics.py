"""Prometheus text exposition of the server's counters (no client library needed for this handful)."""

import threading
from collections import defaultdict

import msgspec

from spinf_jax.api import ScoreResponse

PASS_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.questions = 0
        self.tokens: dict[str, int] = defaultdict(int)
        self.passes: dict[int, list[int]] = {}  # bucket size → histogram counts (+Inf last)
        self.pass_seconds: dict[int, float] = defaultdict(float)

    def request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path, status)] += 1

    def scored(self, response: ScoreResponse) -> None:
        with self._lock:
            for result in response.results:
                self.questions += sum(len(q.combinations) for q in result.queries)
            for kind, n in msgspec.structs.asdict(response.usage.prompt_tokens_details).items():
                self.tokens[kind.removesuffix("_tokens")] += n

    def on_pass(self, size: int, seconds: float) -> None:
        with self._lock:
            counts = self.passes.setdefault(size, [0] * (len(PASS_SECONDS_BUCKETS) + 1))
            for i, bound in enumerate(PASS_SECONDS_BUCKETS):
                if seconds <= bound:
                    counts[i] += 1
            counts[-1] += 1
            self.pass_seconds[size] += seconds

    def render(self, queue_depth: int) -> str:
        with self._lock:
            lines = [
                "# HELP spinf_requests_total HTTP requests by path and status.",
                "# TYPE spinf_requests_total counter",
            ]
            for (path, status), n in sorted(self.requests.items()):
                lines.append(f'spinf_requests_total{{path="{path}",status="{status}"}} {n}')
            lines += [
                "# HELP spinf_questions_scored_total Questions (query x combination x content) scored.",
                "# TYPE spinf_questions_scored_total counter",
                f"spinf_questions_scored_total {self.questions}",
            ]
            lines += [
                "# HELP spinf_tokens_scored_total Tokens processed, by kind.",
                "# TYPE spinf_tokens_scored_total counter",
            ]
            for kind, n in sorted(self.tokens.items()):
                lines.append(f'spinf_tokens_scored_total{{kind="{kind}"}} {n}')
            lines += [
                "# HELP spinf_pass_seconds Device passes by bucket size (tokens) and duration.",
                "# TYPE spinf_pass_seconds histogram",
            ]
            for size, counts in sorted(self.passes.items()):
                for bound, n in zip(PASS_SECONDS_BUCKETS, counts, strict=False):
                    lines.append(f'spinf_pass_seconds_bucket{{bucket="{size}",le="{bound}"}} {n}')
                lines.append(f'spinf_pass_seconds_bucket{{bucket="{size}",le="+Inf"}} {counts[-1]}')
                lines.append(f'spinf_pass_seconds_sum{{bucket="{size}"}} {self.pass_seconds[size]}')
                lines.append(f'spinf_pass_seconds_count{{bucket="{size}"}} {counts[-1]}')
            lines += [
                "# HELP spinf_queue_depth Requests waiting for the engine.",
                "# TYPE spinf_queue_depth gauge",
                f"spinf_queue_depth {queue_depth}",
            ]
        return "\n".join(lines) + "\n"
