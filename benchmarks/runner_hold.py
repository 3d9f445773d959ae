"""The server's runner with and without holding requests back (`serve --no-hold-back`), driven by closed-loop
clients against a simulated device: the real Runner, the server's own plans of the seed job's articles (one
request per article, Gemma 3's tokenizer, floors cached, 64-row blocks) and the real packer, with each batch
taking the seconds a GPU measured for its passes' buckets. Not a GPU measurement: it shows which batches the
runner forms under a client pattern, and what they would cost at those pass times.

    python3 benchmarks/runner_hold.py --tokenizer TOKENIZER_FOLDER --pass-seconds RESULTS.json [--out DIR]

RESULTS.json: an http_throughput result with `library_pass_seconds` (what each bucket's pass took). Each
client sends one article, waits for its answer and sends the next. Each answer takes `--finish-ms` on one of
the runner's finisher threads (the server's CPU per request in that run, 44.6 ms: plan and response), so a
batch's answers go out one after another, as the server's do.
"""

import argparse
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from bucket_rows import SMALL
from common import seed_job, seed_request
from http_throughput import article_bodies

from spinf_jax.engine import Engine
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets, cut
from spinf_jax.runner import Runner
from spinf_jax.scoring import Scorer


class SimulatedDevice:
    """Engine.launch / collect / cut over the real packer; a batch is done once its passes' measured
    seconds have gone by. `launch_hold`: the share of a batch's seconds its launch holds the calling thread
    once the device begins the batch (a GPU launch returns only when the device has taken part of it: half
    a 4,096-row pass on the H200 with 1,024-row tiles, benchmarks/results, 2026-12-04); 0, at once."""

    def __init__(self, seconds: dict[int, float], launch_hold: float = 0.0):
        self.launch_hold = launch_hold
        sizes = sorted(seconds)
        self.buckets = Buckets(tuple(sizes), block=64).measured([seconds[s] for s in sizes])
        self.passes: Counter = Counter()
        self.rows = self.tokens = 0
        self.free_at = 0.0  # time.monotonic() when the device has run every pass launched so far

    def cut(self, trees):
        return cut(trees, self.buckets)

    def launch(self, trees, cuts=None, behind=None):
        """The batch's passes run one after another once the device is free (a batch queued `behind`
        another starts when that one ends)."""
        passes = (cuts or self.cut(trees)).passes(len(trees))
        self.passes.update(p.size for p in passes)
        self.rows += sum(p.size for p in passes)
        self.tokens += sum(len(t) for t in trees)
        costs = [self.buckets.cost(p.size) for p in passes]
        start = max(time.monotonic(), self.free_at)
        self.free_at = start + sum(costs)
        last, done = threading.Event(), threading.Event()
        threading.Timer(start + sum(costs[:-1]) - time.monotonic(), last.set).start()
        threading.Timer(self.free_at - time.monotonic(), done.set).start()
        time.sleep(max(0.0, start + self.launch_hold * sum(costs) - time.monotonic()))
        return SimpleNamespace(trees=trees, wait=lambda leaving=0: (last if leaving else done).wait())

    def collect(self, launched):
        launched.wait()
        return [None] * len(launched.trees)


def drive(
    plans: list,
    seconds: dict[int, float],
    clients: int,
    duration: float,
    finish: float,
    hold: bool,
    launch_hold: float,
):
    device = SimulatedDevice(seconds, launch_hold)
    runner = Runner(device, max_queue=256, max_delay=0.005, hold_back=hold)
    answered, latencies, stop = [], [], time.monotonic() + duration

    def client(k: int) -> None:
        n = k
        while time.monotonic() < stop:
            start = time.monotonic()
            runner.submit(plans[n % len(plans)], lambda plan, scored: time.sleep(finish)).result()
            latencies.append(time.monotonic() - start)
            answered.append(n % len(plans))
            n += clients

    begin = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.monotonic() - begin
    runner.close()
    latencies.sort()
    return {
        "requests_per_second": len(answered) / wall,
        "rows_useful": device.tokens / device.rows,
        "passes": dict(sorted(device.passes.items())),
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--pass-seconds", required=True, help="an http_throughput result JSON")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each mode is driven")
    parser.add_argument("--finish-ms", type=float, default=44.6)
    parser.add_argument("--launch-hold", type=float, default=0.0, help="SimulatedDevice's launch_hold")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = json.loads(Path(args.pass_seconds).read_text())
    seconds = {int(size): s for size, s in measured["library_pass_seconds"].items()}
    (out / "small.json").write_text(json.dumps(SMALL))
    model = random_model(out / "small.json", args.tokenizer, "fp32")
    scorer = Scorer(Engine(model, Buckets((4096, 8192), block=64)))
    job = seed_job()
    scorer.score(
        seed_request(job)
    )  # the questions' floors, cached: later plans hold the articles' trees only
    plans = [scorer.plan(body) for body in article_bodies(job)]
    results = {"pass_seconds_from": Path(args.pass_seconds).name, "device": measured["device"],
               "clients": args.clients, "finish_ms": args.finish_ms, "launch_hold": args.launch_hold,
               "modes": {}}  # fmt: skip
    for name, hold in (("hold back", True), ("--no-hold-back", False)):
        results["modes"][name] = row = drive(
            plans, seconds, args.clients, args.seconds, args.finish_ms / 1e3, hold, args.launch_hold
        )
        print(name, row, flush=True)
    (out / "runner_hold.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
