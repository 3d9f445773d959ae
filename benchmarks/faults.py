"""Two faults a server must take without hurting others, over HTTP. Not run in CI.

- `refused`: N concurrent copies of a body the server must refuse for its token budget (1,001 contents asked a
  1,000-combination grid, 34 KB): how long each refusal takes, and the server's RSS before and after (from
  /proc, so the server runs on this machine). Before the refusal was found from the request's shape, each
  copy built ~420 MB of trees first, which the process kept.
- `fairness`: one large request (--large questions of the seed job's first question over one article) and,
  while it runs, a small request every --every seconds (at least twice a small one's time alone, so that
  they alone keep the server under half busy): the small ones' latency (p50, p99, max) beside their latency
  alone, and the large one's time. Before large requests took turns by slices, every small request
  sent while one ran waited for all of its passes.

Each case runs against `spinf-jax serve` started from this checkout, and with --before DIR also from that
checkout (a `git worktree` of an older commit, say) in the same run, one server after the other:

    uv run --extra server --extra models python benchmarks/faults.py --before /tmp/old --out FILE

Prints a line per case and server and ends with one JSON line; --out writes the JSON too.
"""

import argparse
import json
import os
import shlex
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from common import seed_job, write_cpu_document
from server_process import start_server, stop_server, wait_compiled, wait_ready
from soak import rss_mib

HERE = Path(__file__).resolve().parent


def over_budget_body() -> dict:
    grid = {"id": "g", "template": "\n\nIs it {tone}?{?}", "options": [" yes", " no"],
            "combinations": "all", "values": {"tone": [f"tone number {i}" for i in range(1000)]}}  # fmt: skip
    return {
        "inputs": [{"messages": [{"content": f"Text {i}."}]} for i in range(1001)],
        "scoring": {"queries": [grid]},
    }


def refused(url: str, pid: int, copies: int) -> dict:
    body = json.dumps(over_budget_body()).encode()
    before = rss_mib(pid)

    def send(_) -> tuple[int, float]:
        start = time.perf_counter()
        response = httpx.post(f"{url}/v1/score", content=body, headers={"content-type": "application/json"},
                              timeout=600)  # fmt: skip
        return response.status_code, time.perf_counter() - start

    with ThreadPoolExecutor(copies) as pool:
        answers = list(pool.map(send, range(copies)))
    time.sleep(2)
    return {
        "copies": copies,
        "body_bytes": len(body),
        "statuses": sorted({status for status, _ in answers}),
        "seconds_p50": statistics.median(s for _, s in answers),
        "seconds_max": max(s for _, s in answers),
        "rss_mib_before": before,
        "rss_mib_after": rss_mib(pid),
    }


def fairness(url: str, large: int, every: float, alone_samples: int = 5) -> dict:
    job = seed_job()
    article = job["contents"][0]["text"]
    question = dict(job["questions"][0])
    small_body = {"messages": [{"content": article}], "scoring": {"queries": [question]}}
    queries = [dict(question, id=f"q{i}", template=f"({i}) " + question["template"]) for i in range(large)]
    large_body = {"messages": [{"content": article}], "scoring": {"queries": queries, "empty_floor": False}}

    def timed(body: dict) -> float:
        start = time.perf_counter()
        httpx.post(f"{url}/v1/score", json=body, timeout=3600).raise_for_status()
        return time.perf_counter() - start

    alone = [timed(small_body) for _ in range(alone_samples)]
    # The small ones alone must keep the server under half busy, or their own queue is what they measure.
    every = max(every, 2 * statistics.median(alone))
    large_seconds = []
    thread = threading.Thread(target=lambda: large_seconds.append(timed(large_body)))
    thread.start()
    time.sleep(every)
    with ThreadPoolExecutor(64) as pool:
        futures = []
        while thread.is_alive():
            futures.append(pool.submit(timed, small_body))
            time.sleep(every)
        small = [f.result() for f in futures]
    thread.join()
    # Inclusive: with a few samples the exclusive method extrapolates past the largest one.
    q = statistics.quantiles(small, n=100, method="inclusive") if len(small) >= 2 else small * 99
    return {
        "large_questions": large,
        "small_every_s": every,
        "large_seconds": large_seconds[0],
        "small_sent_during": len(small),
        "small_alone_p50_s": statistics.median(alone),
        "small_p50_s": statistics.median(small) if small else None,
        "small_p99_s": q[98] if small else None,
        "small_max_s": max(small) if small else None,
        "small_seconds": small,
    }


def run_server(source: Path, serve_args: list[str], cases: list[str], args) -> dict:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(source)  # the child imports spinf_jax from that checkout
    try:
        process, url = start_server(serve_args, log)
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_before
    try:
        health = wait_ready(url, process, timeout=1800)
        wait_compiled(url, timeout=1800)
        out = {"source": str(source), "system_fingerprint": health.get("system_fingerprint")}
        for case in cases:
            out[case] = (
                refused(url, process.pid, args.copies)
                if case == "refused"
                else fairness(url, args.large, args.every)
            )
            print(f"{source} {case}: {json.dumps(out[case])}", flush=True)
        return out
    finally:
        stop_server(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=["refused", "fairness"], choices=["refused", "fairness"]
    )
    parser.add_argument("--before", help="another checkout to serve from as well, first (the baseline)")
    parser.add_argument("--copies", type=int, default=8, help="refused: concurrent over-budget bodies")
    parser.add_argument("--large", type=int, default=600, help="fairness: the large request's questions")
    parser.add_argument("--every", type=float, default=1.0, help="fairness: seconds between small requests")
    parser.add_argument("--serve-args", default="--precision fp32")
    parser.add_argument("--out")
    args = parser.parse_args()
    serve_args = shlex.split(args.serve_args)
    sources = ([Path(args.before).resolve()] if args.before else []) + [HERE.parent]
    runs = [run_server(source, serve_args, args.cases, args) for source in sources]
    write_cpu_document("faults", args.out, runs=runs)


if __name__ == "__main__":
    main()
