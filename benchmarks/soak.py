"""Soak test of the scoring server: N concurrent clients for M minutes with a mix of valid, invalid and
abandoned requests. Not run in CI.

Valid requests are drawn from the seed job (1 or 2 articles, 2 to 4 questions each); before the load each
distinct one is sent alone, and every answer under load must carry the same `results` to the bit (ids,
timestamps and usage are not compared). Invalid requests (malformed JSON, wrong types, an unknown query id,
an option over the token limit) must get their 4xx code. Abandoned requests are sent on a raw socket that is
closed before the answer, or halfway through the body. Reports requests/s, latency percentiles, 429s, 5xx,
mismatches, the server's RSS over time (from /proc, so the server must run on this machine) and the
server's own request counts from /metrics over the soak.

It starts `spinf-jax serve` (the default model; --serve-args adds options) on a free port, or soaks a
running server given --url (give --pid for its RSS). Prints a table and ends with one JSON line; --out
writes the JSON too.

    uv run --extra server --extra models python benchmarks/soak.py --clients 16 --minutes 30 --out FILE
"""

import argparse
import json
import random
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import date
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from common import seed_job
from server_process import start_server, stop_server, wait_ready

HEADERS = {"content-type": "application/json"}


@dataclass
class Outcome:
    kind: str  # valid | invalid | abandoned
    what: str  # which request (valid: its index among the distinct ones)
    status: str  # the HTTP status, "transport_error", or "sent" for an abandoned request
    seconds: float
    verdict: str  # same | mismatch | refused (429) | expected_code | wrong_code | failed | sent


def valid_bodies(job: dict, count: int, rng: random.Random) -> list[bytes]:
    bodies = []
    for _ in range(count):
        contents = rng.sample(job["contents"], rng.choice((1, 2)))
        inputs = [{"id": c["id"], "messages": [{"role": "user", "content": c["text"]}]} for c in contents]
        queries = rng.sample(job["questions"], rng.randint(2, 4))
        bodies.append(json.dumps({"inputs": inputs, "scoring": {"queries": queries}}).encode())
    return bodies


def invalid_bodies(valid: bytes) -> dict[str, tuple[bytes, str]]:
    """Each invalid request, by name: its body and the error code it must get."""
    body = json.loads(valid)
    unknown = {**body, "inputs": [{**body["inputs"][0], "query_ids": ["no-such-query"]}]}
    long_option = json.loads(valid)
    long_option["scoring"]["queries"][0]["options"] = [" yes", " no", " " + "maybe " * 20]
    return {
        "malformed_json": (valid[: len(valid) // 2], "invalid_json"),
        "wrong_types": (
            json.dumps({"messages": "hello", "scoring": {"queries": 5}}).encode(),
            "invalid_request",
        ),
        "unknown_query_id": (json.dumps(unknown).encode(), "unknown_query"),
        "option_too_long": (json.dumps(long_option).encode(), "option_too_long"),
    }


def abandon(url: str, body: bytes, halfway: bool, wait: float) -> None:
    """Send a request on a raw socket, the whole body or its first half, and close the connection `wait`
    seconds later, before the answer (the server is still reading the body, or scoring it)."""
    where = urlsplit(url)
    head = (
        f"POST /v1/score HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((where.hostname, where.port or 80), timeout=30) as s:
        s.sendall(head + (body[: len(body) // 2] if halfway else body))
        time.sleep(wait)


def run_client(url: str, until: float, seed: int, mix: dict, valid, references, invalid, out: list) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as http:
        while time.monotonic() < until:
            pick = rng.random()
            if pick < mix["abandoned"]:
                out.append(send_abandoned(url, rng, valid))
            elif pick < mix["abandoned"] + mix["invalid"]:
                what = rng.choice(list(invalid))
                body, code = invalid[what]
                out.append(send(http, "invalid", what, body, partial(judge_invalid, code=code)))
            else:
                index = rng.randrange(len(valid))
                judge = partial(judge_valid, reference=references[index])
                out.append(send(http, "valid", str(index), valid[index], judge))


def send_abandoned(url: str, rng: random.Random, valid: list[bytes]) -> Outcome:
    start = time.perf_counter()
    what = rng.choice(("closed_before_answer", "body_cut_halfway"))
    try:
        abandon(url, rng.choice(valid), what == "body_cut_halfway", rng.uniform(0.1, 2.0))
        status, verdict = "sent", "sent"
    except OSError:
        status, verdict = "transport_error", "failed"
    return Outcome("abandoned", what, status, time.perf_counter() - start, verdict)


def send(http: httpx.Client, kind: str, what: str, body: bytes, judge) -> Outcome:
    start = time.perf_counter()
    try:
        response = http.post("/v1/score", content=body, headers=HEADERS)
    except httpx.TransportError:
        return Outcome(kind, what, "transport_error", time.perf_counter() - start, "failed")
    seconds = time.perf_counter() - start
    return Outcome(kind, what, str(response.status_code), seconds, judge(response))


def judge_valid(response: httpx.Response, reference: list) -> str:
    if response.status_code == 429:
        return "refused"
    if response.status_code != 200:
        return "failed"
    return "same" if response.json()["results"] == reference else "mismatch"


def judge_invalid(response: httpx.Response, code: str) -> str:
    if not 400 <= response.status_code < 500:
        return "failed"
    return "expected_code" if response.json()["error"]["code"] == code else "wrong_code"


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return None if kib is None else round(kib / 1024, 1)


def sample_rss(pid: int, every: float, stop: threading.Event, start: float, samples: list) -> None:
    while True:
        samples.append([round(time.monotonic() - start, 1), rss_mib(pid)])
        if stop.wait(every):
            return


def server_counts(url: str) -> Counter:
    """spinf_requests_total by its labels, as the server counts them."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return Counter(
        {
            line.split(" ")[0].removeprefix("spinf_requests_total"): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("spinf_requests_total{")
        }
    )


def percentiles(seconds: list[float]) -> dict:
    if len(seconds) < 2:
        return {"max_s": max(seconds, default=None)}
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {"p50_s": cuts[49], "p90_s": cuts[89], "p99_s": cuts[98], "max_s": max(seconds)}


def summarize(outcomes: list[Outcome], elapsed: float) -> dict:
    by_kind = {}
    for kind in ("valid", "invalid", "abandoned"):
        mine = [o for o in outcomes if o.kind == kind]
        answered = [o.seconds for o in mine if o.status not in ("sent", "transport_error")]
        by_kind[kind] = {
            "requests": len(mine),
            "statuses": dict(Counter(o.status for o in mine)),
            "verdicts": dict(Counter(o.verdict for o in mine)),
            "latency": percentiles(answered),
        }
    return {
        "seconds": elapsed,
        "requests": len(outcomes),
        "requests_per_second": len(outcomes) / elapsed,
        "valid_answers_per_second": by_kind["valid"]["verdicts"].get("same", 0) / elapsed,
        "status_429": sum(o.status == "429" for o in outcomes),
        "status_5xx": sum(o.status.startswith("5") for o in outcomes),
        "transport_errors": sum(o.status == "transport_error" for o in outcomes),
        "mismatches": sum(o.verdict == "mismatch" for o in outcomes),
        "wrong_codes": sum(o.verdict == "wrong_code" for o in outcomes),
        "by_kind": by_kind,
    }


def print_table(result: dict) -> None:
    s = result["summary"]
    print(f"{s['requests']} requests in {s['seconds']:.0f} s: {s['requests_per_second']:.2f}/s")
    print(f"{'kind':<10} {'n':>6} {'p50 s':>8} {'p90 s':>8} {'p99 s':>8} {'max s':>8}  verdicts")
    for kind, k in s["by_kind"].items():
        cells = [k["latency"].get(p) for p in ("p50_s", "p90_s", "p99_s", "max_s")]
        cells = " ".join(f"{c:>8.3f}" if c is not None else f"{'-':>8}" for c in cells)
        print(f"{kind:<10} {k['requests']:>6} {cells}  {k['verdicts']}")
    print(
        f"429: {s['status_429']}  5xx: {s['status_5xx']}  transport errors: {s['transport_errors']}  "
        f"mismatches: {s['mismatches']}  wrong codes: {s['wrong_codes']}"
    )
    rss = [mib for _, mib in result["rss_mib"] if mib is not None]
    if rss:
        print(f"server RSS MiB: start {rss[0]}, max {max(rss)}, end {rss[-1]} ({len(rss)} samples)")
    print("server's spinf_requests_total over the soak:", result["server_counts"])


def references_alone(url: str, bodies: list[bytes]) -> list:
    """Each request's `results` when it is the only one at the server."""
    references = []
    for body in bodies:
        response = httpx.post(f"{url}/v1/score", content=body, headers=HEADERS, timeout=600)
        response.raise_for_status()
        references.append(response.json()["results"])
    return references


def soak(url: str, pid: int | None, args) -> dict:
    valid = valid_bodies(seed_job(), args.distinct, random.Random(args.seed))
    references = references_alone(url, valid)
    invalid = invalid_bodies(valid[0])
    mix = {"invalid": args.invalid, "abandoned": args.abandoned}

    before = server_counts(url)
    start = time.monotonic()
    stop, rss = threading.Event(), []
    if pid is not None:
        threading.Thread(target=sample_rss, args=(pid, args.rss_every, stop, start, rss), daemon=True).start()
    until = start + args.minutes * 60
    outcomes = [[] for _ in range(args.clients)]
    clients = [
        threading.Thread(
            target=run_client,
            args=(url, until, args.seed + 1 + i, mix, valid, references, invalid, mine),
            daemon=True,  # an interrupted soak does not wait for them
        )
        for i, mine in enumerate(outcomes)
    ]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    elapsed = time.monotonic() - start
    stop.set()
    everything = [o for mine in outcomes for o in mine]
    return {
        "mix": mix,
        "distinct_valid_requests": len(valid),
        "summary": summarize(everything, elapsed),
        "server_counts": dict(sorted((server_counts(url) - before).items())),
        "rss_mib": rss,
        "mismatched": sorted({o.what for o in everything if o.verdict == "mismatch"}),
        "failed": [asdict(o) for o in everything if o.verdict == "failed"][:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start `spinf-jax serve` on a free port)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    parser.add_argument(
        "--serve-args", default="", help="options for `spinf-jax serve`, e.g. '--precision fp8'"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--distinct", type=int, default=24, help="distinct valid requests")
    parser.add_argument("--invalid", type=float, default=0.15, help="share of invalid requests")
    parser.add_argument("--abandoned", type=float, default=0.10, help="share of abandoned requests")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--ready-timeout", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()

    # A soak stopped by `timeout` or `kill` still stops the server it started (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    process, url, pid = None, args.url, args.pid
    if url is None:
        log = (
            Path(args.out).with_suffix(".server.log") if args.out else Path(tempfile.mkdtemp()) / "server.log"
        )
        process, url = start_server(shlex.split(args.serve_args), log)
        pid = process.pid
        print(f"serving on {url} (pid {pid}, log {log})", flush=True)
    try:
        waiting = time.monotonic()
        health = wait_ready(url, process, args.ready_timeout)
        ready_after = time.monotonic() - waiting
        measured = soak(url, pid, args)
    finally:
        if process is not None:
            stop_server(process)

    result = {
        "date": date.today().isoformat(),
        "url": url,
        "clients": args.clients,
        "minutes": args.minutes,
        "health": health,
        "ready_after_seconds": ready_after,
        **measured,
    }
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
