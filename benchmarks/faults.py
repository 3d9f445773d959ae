"""Faults a server must take without hurting others, over HTTP. Not run in CI.

- `refused`: N concurrent copies of a body the server must refuse for its token budget (1,001 contents asked a
  1,000-combination grid, 34 KB): how long each refusal takes, and the server's RSS before and after (from
  /proc, so the server runs on this machine). Before the refusal was found from the request's shape, each
  copy built ~420 MB of trees first, which the process kept.
- `fairness`: one large request (--large questions of the seed job's first question over one article) and,
  while it runs, a small request every --every seconds (at least twice a small one's time alone, so that
  they alone keep the server under half busy): the small ones' latency (p50, p99, max) beside their latency
  alone, and the large one's time. Before large requests took turns by slices, every small request
  sent while one ran waited for all of its passes.
- `stuck`: `serve --devices 2` (two replicas on the CPU's two host devices), --clients clients sending a small
  request each in turn, and one replica stopped with SIGSTOP: how long until the front marks it down, how
  long until it kills and restarts it, whether any request failed, and the requests' latency before, while
  stopped and after (the longest is what a client waited).
- `dead-remote`: `serve --check --packs` from a git remote that accepts connections and never answers: the
  seconds until the command gives up, its exit status and last line, and the git processes left behind.

Each case runs against `spinf-jax serve` started from this checkout, and with --before DIR also from that
checkout (a `git worktree` of an older commit, say) in the same run, one server after the other:

    uv run --extra server --extra models python benchmarks/faults.py --before /tmp/old --out FILE

Prints a line per case and server and ends with one JSON line; --out writes the JSON too.
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
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
CASES = ("refused", "fairness", "stuck", "dead-remote")


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


def _processes() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, command line) of every live process, from /proc."""
    found = {}
    for folder in Path("/proc").iterdir():
        try:
            stat = (folder / "stat").read_text()
            command = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):  # not a process, or it ended meanwhile
            continue
        if folder.name.isdigit():
            found[int(folder.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), command)
    return found


def _quantiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"count": 0}
    q = statistics.quantiles(seconds, n=100, method="inclusive") if len(seconds) >= 2 else seconds * 99
    return {"count": len(seconds), "p50_s": statistics.median(seconds), "p99_s": q[98], "max_s": max(seconds)}


def stuck(source: Path, serve_args: list[str], clients: int) -> dict:
    """One of two replicas stopped (SIGSTOP) under steady traffic, until the front restarts it."""
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    two = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    env = {**os.environ, "PYTHONPATH": str(source), "XLA_FLAGS": two}
    process, url = start_server([*serve_args, "--devices", "2"], log, env=env)
    job = seed_job()
    body = {
        "messages": [{"content": job["contents"][0]["text"]}],
        "scoring": {"queries": [job["questions"][0]]},
    }
    answers: list[tuple[float, float, int | str]] = []  # (sent at, seconds, status or error)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    status = http.post(f"{url}/v1/score", json=body).status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                answers.append((sent, time.monotonic() - sent, status))

    def replicas() -> list[dict]:
        return httpx.get(f"{url}/health", timeout=10).json().get("replicas", [])

    stopped_pid = None
    try:
        wait_ready(url, process, timeout=1800)
        deadline = time.monotonic() + 1800
        while not all(r["state"] == "ready" for r in replicas()) and time.monotonic() < deadline:
            time.sleep(1)
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(20)  # traffic on both replicas first
        stopped_pid = max(pid for pid, (parent, _) in _processes().items() if parent == process.pid)
        stopped_at = time.monotonic()
        os.kill(stopped_pid, signal.SIGSTOP)
        marked_down = restarted = None
        while restarted is None and time.monotonic() - stopped_at < 600:
            states = replicas()
            if marked_down is None and any(r["state"] == "down" for r in states):
                marked_down = time.monotonic() - stopped_at
            if any(r["restarts"] for r in states) and all(r["state"] == "ready" for r in states):
                restarted = time.monotonic() - stopped_at
            time.sleep(0.5)
        time.sleep(20)  # traffic on both again
        stop.set()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGKILL)
        stop_server(process)
    failed = [a for a in answers if a[2] != 200]
    before = [a[1] for a in answers if a[0] + a[1] < stopped_at]
    during = [a[1] for a in answers if a[0] < stopped_at + (restarted or 0) and a[0] + a[1] >= stopped_at]
    after = [a[1] for a in answers if a[0] >= stopped_at + (restarted or math.inf)]
    return {"clients": clients, "requests": len(answers), "failed": len(failed),
            "failures": sorted({str(a[2]) for a in failed}), "marked_down_after_s": marked_down,
            "restarted_and_ready_after_s": restarted, "latency_before": _quantiles(before),
            "latency_while_stopped": _quantiles(during), "latency_after": _quantiles(after)}  # fmt: skip


def dead_remote(source: Path) -> dict:
    """`serve --check --packs` from a remote that accepts connections and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    remote = f"http://127.0.0.1:{silent.getsockname()[1]}/packs.git"
    env = {**os.environ, "PYTHONPATH": str(source), "SPINF_CACHE": tempfile.mkdtemp()}
    command = [sys.executable, "-m", "spinf_jax.cli", "serve", "--check", "--packs", remote]
    try:
        start = time.monotonic()
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL
        )
        seconds = time.monotonic() - start
        time.sleep(0.5)
        left = [line for line in (c for _, c in _processes().values()) if remote.split("/packs")[0] in line]
    finally:
        silent.close()
    return {"remote": "accepts, never answers", "exit_status": done.returncode, "seconds": seconds,
            "last_line": (done.stderr.strip().splitlines() or [""])[-1], "processes_left": left}  # fmt: skip


def run_server(source: Path, serve_args: list[str], cases: list[str], args) -> dict:
    """The cases asked of one checkout: those on one shared server first, then those with processes of their
    own."""
    out: dict = {"source": str(source)}
    shared = [case for case in cases if case in ("refused", "fairness")]
    if shared:
        process, url = start_server(serve_args, Path(tempfile.mkstemp(suffix=".log")[1]),
                                    env={**os.environ, "PYTHONPATH": str(source)})  # fmt: skip
        try:
            out["system_fingerprint"] = wait_ready(url, process, timeout=1800).get("system_fingerprint")
            wait_compiled(url, timeout=1800)
            for case in shared:
                out[case] = (
                    refused(url, process.pid, args.copies)
                    if case == "refused"
                    else fairness(url, args.large, args.every)
                )
                print(f"{source} {case}: {json.dumps(out[case])}", flush=True)
        finally:
            stop_server(process)
    if "stuck" in cases:
        out["stuck"] = stuck(source, serve_args, args.clients)
        print(f"{source} stuck: {json.dumps(out['stuck'])}", flush=True)
    if "dead-remote" in cases:
        out["dead-remote"] = dead_remote(source)
        print(f"{source} dead-remote: {json.dumps(out['dead-remote'])}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), choices=CASES, help="which faults (default: all)"
    )
    parser.add_argument("--before", help="another checkout to serve from as well, first (the baseline)")
    parser.add_argument("--copies", type=int, default=8, help="refused: concurrent over-budget bodies")
    parser.add_argument("--large", type=int, default=600, help="fairness: the large request's questions")
    parser.add_argument("--every", type=float, default=1.0, help="fairness: seconds between small requests")
    parser.add_argument("--clients", type=int, default=4, help="stuck: clients sending all the time")
    parser.add_argument("--serve-args", default="--precision fp32")
    parser.add_argument("--out")
    args = parser.parse_args()
    serve_args = shlex.split(args.serve_args)
    sources = ([Path(args.before).resolve()] if args.before else []) + [HERE.parent]
    runs = [run_server(source, serve_args, args.cases, args) for source in sources]
    write_cpu_document("faults", args.out, runs=runs)


if __name__ == "__main__":
    main()
