"""`spinf-jax serve` over HTTP at a real model shape: what users get from the server under concurrent clients,
beside the library rate, transformers' baselines and the fp8 GEMM peak, all measured in the same run.

    python3 benchmarks/http_throughput.py --tokenizer TOKENIZER_FOLDER --out $OUT [--parts ...] [--seconds 60]

The server is `spinf-jax serve --random-weights CONFIG` in a child process: made-up weights at Gemma 3 12B's
text shape (loader.random_model, a fixed seed) with Gemma 3's tokenizer (a folder holding its tokenizer.json,
as `Tokenizer.save` writes it). The library engine measured in this process is the same model, so the
server's scores must be the same bits (checked on the seed job). Every part is driven for --seconds by
closed-loop clients (each posts its next request when its last is answered); a part's rate counts the
requests answered from its start to its last answer.

- library: `Engine.score` on the seed job (24 articles × 56 two-option questions) as one call, repeated.
- inprocess: `spinf-jax score`'s in-process path (bulk.run, batches of 64) over --bulk-articles articles
  with the library's engine: one batch at a time (bulk.in_process, the old path), then two in flight
  through a runner (bulk.pipelined, the command's default); both must write the same bytes.
- job: the seed job as one request. articles: one request per article, at each of --clients.
- article: one article asked 74 questions (the seed job's 56, and 18 of them asked again as "Question: ...").
- pack: the moderation pack, 32 clients, 32 messages a request (the pack's synthetic data); and a message
  alone gets the same bits as in a batch.
- bulk: `spinf-jax score --url` over the seed job's articles, repeated (its own pace: one batch in flight).
- baselines: transformers bf16 (SDPA, its own random init, same shape) on the seed job: A, one request per
  question (--a-articles articles); B, each article read once and its questions as one batch over copies
  of its prefix cache (benchmarks/gpu_baselines.py).

Reported per part: questions/s (messages/hour for the pack), useful tokens/s (content and question tokens:
floors are cached after the first request), model-FLOPs utilisation (2 × linear parameters × useful tokens)
over the fp8 GEMM peak (common.gemm_peaks: the best steady rate over 8192³ and the model's own GEMM shapes),
p50/p99 latency, the server process's CPU seconds per request (/proc: every thread, including the engine
thread's host-side waits inside a pass on GPUs; benchmarks/host_costs.py measures the request work itself),
the passes it took by bucket with the share of their rows that were useful tokens, and the share of the wall
time the device had a batch to run (/metrics). Random weights at the real shape: speed does not depend on the
values. `--profile-part TEXT` traces the server through the middle half of the part whose name holds TEXT
(POST /v1/admin/profile, `serve --profile-dir`) and writes served_profile.md: pass_profile's tables of the
served kernels and of the device's idle stretches. The buckets are the server's default unless --buckets says
otherwise; the library engine has every bucket compiled and timed (Engine.warmup), and the parts start once
the server has too, so both cut batches by the same kind of costs.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import httpx
import jax
import numpy as np
from common import (
    gemm_peaks,
    linear_params,
    seed_job,
    seed_request,
    served_shape_arguments,
    served_shape_config,
    write_articles,
)
from pass_profile import copies_by_neighbour, copies_table, device_kernels, span_seconds, summarize
from pass_profile import table as kernel_table
from prometheus_client.parser import text_string_to_metric_families
from server_process import start_server, stop_server, wait_compiled, wait_ready

from spinf_jax import bulk as bulk_scoring
from spinf_jax.engine import Engine, use_compilation_cache
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets
from spinf_jax.packs.loader import OFFICIAL
from spinf_jax.scoring import Scorer

PARTS = ("library", "inprocess", "job", "articles", "article", "pack", "bulk", "baselines")
PACK = "spinf/moderation"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    served_shape_arguments(parser)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each part is driven")
    parser.add_argument("--clients", default="1,8,32", help="client counts for one request per article")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument(
        "--bulk-articles", type=int, default=1024, help="articles the bulk command scores (64 a request)"
    )
    parser.add_argument("--a-articles", type=int, default=2, help="articles for baseline A (it is slow)")
    parser.add_argument("--compile-cache", help="compiled programs, kept across runs (default: OUT/xla)")
    parser.add_argument(
        "--no-peaks", action="store_true", help="skip the GEMM peaks (no MFU): for A/B runs of a part"
    )
    parser.add_argument(
        "--serve-args", default="", help="more `spinf-jax serve` flags, e.g. --serve-args=--no-hold-back"
    )
    parser.add_argument(
        "--profile-part",
        metavar="TEXT",
        help="trace the server (POST /v1/admin/profile) through the middle half of the first part whose "
        "name holds TEXT, e.g. '8 clients': served_profile.md has pass_profile's tables of it",
    )
    parser.add_argument("--out", default=".")
    return parser.parse_args()


class Driver:
    """Closed-loop clients posting prepared bodies to one route, and what came back."""

    def __init__(self, url: str, server_pid: int):
        self.url, self.pid = url, server_pid

    def cpu_seconds(self) -> float:
        """The server process's user + system CPU seconds so far (every thread)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, bodies: list[dict], clients: int, seconds: float, questions_of) -> dict:
        """Each client takes every `clients`-th body in turn, round and round, until `seconds` have passed."""
        encoded = [json.dumps(b).encode() for b in bodies]
        stop = time.monotonic() + seconds
        lock = threading.Lock()
        done: list[tuple[float, int, int]] = []  # latency, questions, useful tokens
        failures: list[str] = []

        def client(first: int) -> None:
            with httpx.Client(base_url=self.url, timeout=900) as http:
                i = first
                while time.monotonic() < stop and not failures:
                    begin = time.perf_counter()
                    reply = http.post(
                        "/v1/score",
                        content=encoded[i % len(encoded)],
                        headers={"content-type": "application/json"},
                    )
                    latency = time.perf_counter() - begin
                    if reply.status_code != 200:
                        failures.append(f"{reply.status_code} {reply.text[:300]}")
                        return
                    body = reply.json()
                    usage = body["usage"]["prompt_tokens_details"]
                    with lock:
                        done.append(
                            (latency, questions_of(body), usage["content_tokens"] + usage["query_tokens"])
                        )
                    i += clients

        cpu = self.cpu_seconds()
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if failures:
            raise RuntimeError(f"a request failed: {failures[0]}")
        latencies = np.array([d[0] for d in done])
        return {
            "clients": clients,
            "requests": len(done),
            "seconds": wall,
            "questions": sum(d[1] for d in done),
            "useful_tokens": sum(d[2] for d in done),
            "questions_per_second": sum(d[1] for d in done) / wall,
            "tokens_per_second": sum(d[2] for d in done) / wall,
            "p50_ms": float(np.percentile(latencies, 50) * 1e3),
            "p99_ms": float(np.percentile(latencies, 99) * 1e3),
            "server_cpu_ms_per_request": (self.cpu_seconds() - cpu) / len(done) * 1e3,
        }


def server_counters(url: str) -> tuple[dict[int, float], float]:
    """From the server's /metrics: its passes so far by bucket size (spinf_pass_seconds_count), and the
    seconds its device has had a batch to run (spinf_device_busy_seconds_total)."""
    passes, busy = {}, 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name == "spinf_pass_seconds_count":
                passes[int(sample.labels["bucket"])] = sample.value
            elif sample.name == "spinf_device_busy_seconds_total":
                busy = sample.value
    return passes, busy


def profile_server(url: str, seconds: float) -> dict:
    """The server's trace of the middle half of a part `seconds` long: POST /v1/admin/profile's answer (its
    folder, and how long the profile held passes back)."""
    time.sleep(seconds / 4)
    response = httpx.post(f"{url}/v1/admin/profile", json={"seconds": seconds / 2}, timeout=seconds + 600)
    response.raise_for_status()
    return response.json()


def served_profile(answer: dict, part: str, out: Path) -> dict:
    """pass_profile's tables of a served trace: kernels by class, the longest, and the device's idle
    stretches between them (the host launching, planning, reading results). Written to served_profile.md;
    the raw trace (tens of MB) is removed."""
    trace_dir = Path(answer["trace_dir"])
    kernels = device_kernels(trace_dir)
    if not kernels:
        raise RuntimeError(f"no GPU kernels in the served trace {trace_dir}: this profiles a GPU server")
    summary = summarize(kernels, span_seconds(kernels)) | {"copies": copies_by_neighbour(kernels)}
    held = f"The profile held passes back {answer['held_seconds']} s (POST /v1/admin/profile's held_seconds)."
    text = "\n\n".join(
        [kernel_table(summary, f"served, {part}: the trace's span"), copies_table(summary["copies"]), held]
    )
    (out / "served_profile.md").write_text(text + "\n")
    shutil.rmtree(trace_dir)
    print(text, flush=True)
    return summary | {"part": part, "held_seconds": answer["held_seconds"]}


def between(before: tuple, after: tuple, row: dict, pass_seconds: dict[int, float]) -> dict:
    """What the server did during a part: its passes by bucket, their rows, the share of those rows that were
    the requests' content and question tokens (the rest is padding, floors and alignment to attention
    blocks), the share of the part's wall time its device had a batch to run, and the share those passes
    would take run alone, one after another (`pass_seconds`, the server's own by bucket): what is left is
    the device waiting for the host between passes, or passes running slower while the host serves."""
    ran = {size: int(n - before[0].get(size, 0)) for size, n in sorted(after[0].items())}
    ran = {size: n for size, n in ran.items() if n}
    rows = sum(size * n for size, n in ran.items())
    return {
        "passes": ran,
        "rows_run": rows,
        "rows_useful": row["useful_tokens"] / rows if rows else float("nan"),
        "device_busy": (after[1] - before[1]) / row["seconds"],
        "passes_alone": sum(n * pass_seconds[size] for size, n in ran.items()) / row["seconds"],
    }


def questions_in(body: dict) -> int:
    return sum(len(r["queries"]) for r in body["results"])


def library(engine: Engine, request: dict, seconds: float) -> tuple[dict, dict]:
    """The seed job as one `Engine.score` call, repeated for `seconds` after a first call (floors and
    compiles)."""
    first = engine.score(request)
    sizes: list[int] = []  # every timed call's passes
    engine.on_pass = lambda size, seconds: sizes.append(size)
    times, again = [], first
    while sum(times) < seconds:
        start = time.perf_counter()
        again = engine.score(request)
        times.append(time.perf_counter() - start)
    usage = again["usage"]["prompt_tokens_details"]
    tokens, questions = usage["content_tokens"] + usage["query_tokens"], questions_in(first)
    median = statistics.median(times) if times else float("nan")
    row = {
        "calls": len(times),
        "seconds_per_call": median,
        "questions": questions,
        "useful_tokens": tokens,
        "questions_per_second": questions / median,
        "tokens_per_second": tokens / median,
        "same_bits_every_call": again["results"] == first["results"],
    }
    engine.on_pass = None
    if times:  # a call's passes
        row["passes"] = {size: sizes.count(size) / len(times) for size in sorted(set(sizes))}
        row["rows_run"] = sum(sizes) / len(times)
        row["rows_useful"] = tokens / row["rows_run"]
    return row, first


def article_bodies(job: dict) -> list[dict]:
    """One request per article, all 56 questions."""
    return [
        {
            "inputs": [{"id": c["id"], "messages": [{"role": "user", "content": c["text"]}]}],
            "scoring": {"queries": job["questions"]},
        }
        for c in job["contents"]
    ]


def seventy_four(job: dict) -> list[dict]:
    """The seed job's 56 questions and 18 of them asked again in other words: 74 questions of one article."""
    again = [
        q | {"id": f"{q['id']}-again", "template": q["template"].replace("\n\n", "\n\nQuestion: ", 1)}
        for q in job["questions"][:18]
    ]
    return [body | {"scoring": {"queries": job["questions"] + again}} for body in article_bodies(job)]


def pack_bodies(per_request: int = 32) -> list[dict]:
    data = OFFICIAL / "spinf" / "data"
    texts = [json.loads(line)["text"] for f in sorted(data.glob("moderation-*.jsonl")) for line in f.open()]
    return [
        {
            "inputs": [{"messages": [{"role": "user", "content": t}]} for t in texts[i : i + per_request]],
            "packs": [{"id": PACK}],
        }
        for i in range(0, len(texts) - per_request + 1, per_request)
    ]


def bulk(url: str, job: dict, articles: int, out: Path) -> dict:
    """`spinf-jax score --url` over `articles` articles (the seed job's, repeated), timed as a user runs
    it."""
    contents = write_articles(job, articles, out / "bulk-input.jsonl")
    queries = out / "bulk-queries.json"
    queries.write_text(json.dumps(job["questions"]))
    results = out / "bulk-results.jsonl"
    results.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "spinf_jax.cli",
        "score",
        str(contents),
        "--out",
        str(results),
        "--queries",
        str(queries),
        "--url",
        url,
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    questions = articles * len(job["questions"])
    return {
        "articles": articles,
        "seconds": seconds,
        "questions_per_second": questions / seconds,
        "command": " ".join(command[1:]),
    }


def in_process(engine: Engine, job: dict, articles: int, out: Path) -> dict[int, dict]:
    """The bulk command's in-process path over `articles` articles, by batches in flight (1: one batch
    planned, scored and finished at a time, the old path; 2: through a runner, the command's default)."""
    contents = write_articles(job, articles, out / "bulk-input.jsonl")
    template = {"scoring": {"queries": job["questions"]}}
    scorer = Scorer(engine)
    rows, written = {}, {}
    for in_flight in (1, 2):
        results = out / f"bulk-in-process-{in_flight}.jsonl"
        results.unlink(missing_ok=True)
        backend = (
            bulk_scoring.pipelined(scorer) if in_flight > 1 else nullcontext(bulk_scoring.in_process(scorer))
        )
        with backend as score:
            summary = bulk_scoring.run(contents, results, template, score, 64, None, in_flight)
        written[in_flight] = results.read_bytes()
        rows[in_flight] = {
            "in_flight": in_flight,
            "articles": summary.scored,
            "seconds": summary.seconds,
            "questions_per_second": summary.scored * len(job["questions"]) / summary.seconds,
            "tokens_per_second": summary.prompt_tokens / summary.seconds,  # floors included, once
            "same_bytes_as_one_in_flight": written[in_flight] == written[1],
        }
    return rows


def baselines(tokenizer: Path, config: dict, job: dict, a_articles: int, peaks: dict) -> dict:
    """transformers A and B on the seed job (benchmarks/gpu_baselines.py), bf16 SDPA, the same shape."""
    import torch
    from gpu_baselines import baseline_a, baseline_b, hf_model, job_ids

    from spinf_jax.tokenizer import Tokenizer

    articles, questions, options = job_ids(Tokenizer.from_folder(tokenizer), job)
    hf = hf_model(config, torch.bfloat16, "sdpa")
    params = sum(p.numel() for n, p in hf.named_parameters() if "layers." in n and n.endswith("proj.weight"))
    tokens = sum(len(a) for a in articles) + len(articles) * sum(len(q) for q in questions)
    baseline_b(hf, articles[:2], questions, options)  # warm-up
    seconds_b, _ = baseline_b(hf, articles, questions, options)
    seconds_a, _ = baseline_a(hf, articles[:a_articles], questions, options)
    tokens_a = sum(len(a) * len(questions) + sum(len(q) for q in questions) for a in articles[:a_articles])
    del hf
    torch.cuda.empty_cache()

    def row(questions_asked: int, useful: int, seconds: float) -> dict:
        return {
            "questions": questions_asked,
            "seconds": seconds,
            "questions_per_second": questions_asked / seconds,
            "tokens_per_second": useful / seconds,
            "mfu_vs_fp8_peak": 2 * params * useful / seconds / (peaks["fp8_gemm_tflops"] * 1e12),
        }

    return {
        "B": row(len(articles) * len(questions), tokens, seconds_b),
        "A": row(a_articles * len(questions), tokens_a, seconds_a),
    }


def save(results: dict, out: Path) -> None:
    """After every part: a run stopped by the device's time limit keeps what it measured."""
    (out / "http_throughput.json").write_text(json.dumps(results, indent=1) + "\n")


def mfu(row: dict, params: int, peaks: dict) -> float:
    return 2 * params * row["tokens_per_second"] / (peaks["fp8_gemm_tflops"] * 1e12)


def table(results: dict) -> str:
    columns = [
        "part",
        "clients",
        "questions/s",
        "tokens/s",
        "MFU (fp8 peak)",
        "p50 ms",
        "p99 ms",
        "server CPU ms/request",
        "rows useful",
        "device busy",
        "passes alone",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name, row in results["rows"].items():
        latency = [f"{row[k]:.0f}" if k in row else "" for k in ("p50_ms", "p99_ms")]
        cpu = f"{row['server_cpu_ms_per_request']:.1f}" if "server_cpu_ms_per_request" in row else ""
        cells = [
            name,
            row.get("clients", ""),
            f"{row['questions_per_second']:,.0f}",
            f"{row['tokens_per_second']:,.0f}" if "tokens_per_second" in row else "",
            f"{row['mfu']:.1%}" if "mfu" in row else "",
            *latency,
            cpu,
            f"{row['rows_useful']:.1%}" if "rows_useful" in row else "",
            f"{row['device_busy']:.1%}" if "device_busy" in row else "",
            f"{row['passes_alone']:.1%}" if "passes_alone" in row else "",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    parts = set(args.parts.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = served_shape_config(args.config, out)
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "precision": args.precision,
        "buckets": args.buckets,
        "serve_args": args.serve_args,
        "seconds_per_part": args.seconds,
        "weights": f"made-up (loader.random_model, seed 0) at the shape of {config.name}",
        "rows": {},
    }
    job = seed_job()
    request = seed_request(job)
    buckets = Buckets(tuple(int(b) for b in args.buckets.split(",")))
    cache = Path(args.compile_cache or out / "xla")
    use_compilation_cache(cache)  # the server reads what this process compiled: its start is a warm one
    model = random_model(config, args.tokenizer, args.precision)
    # The CPU has no fp8 GEMM peak worth the minutes of measuring it (a dry run of the script there).
    skip = args.no_peaks or jax.default_backend() == "cpu"
    nan = {"fp8_gemm_tflops": float("nan"), "bf16_gemm_tflops": float("nan")}
    results |= nan if skip else gemm_peaks(model.decoder, model.row_tile)
    print("peaks", {k: v for k, v in results.items() if "tflops" in k or k == "gemm_rates"}, flush=True)
    params = linear_params(model.decoder)
    results["linear_params"] = params
    engine = Engine(model, buckets)
    engine.warmup()  # every bucket compiled and timed, what the packer cuts by, as the server has them
    results["library_pass_seconds"] = dict(zip(engine.buckets.sizes, engine.buckets.pass_costs, strict=True))
    print("library pass seconds", results["library_pass_seconds"], flush=True)
    library_row, library_answer = library(engine, request, args.seconds if "library" in parts else 0)
    if "library" in parts:
        results["rows"]["library: seed job, one call"] = library_row | {
            "mfu": mfu(library_row, params, results)
        }
        # The library process's peak: weights, every bucket's passes, and the GEMM peaks' 8192² operands.
        results["library_peak_device_gib"] = (jax.devices()[0].memory_stats() or {}).get(
            "peak_bytes_in_use", 0
        ) / 2**30
        save(results, out)
        print("library", library_row, "peak device GiB", results["library_peak_device_gib"], flush=True)
    if "inprocess" in parts:
        for in_flight, row in in_process(engine, job, args.bulk_articles, out).items():
            name = f"bulk command in process, {in_flight} batch(es) in flight"
            results["rows"][name] = row | {"mfu": mfu(row, params, results)}
            save(results, out)
            print(name, row, flush=True)
    del engine, model

    serve = [
        args.tokenizer,
        "--random-weights",
        str(config),
        "--precision",
        args.precision,
        "--buckets",
        args.buckets,
        "--compile-cache",
        str(cache),
        "--max-queue",
        "256",
        "--log-level",
        "warning",
        *(["--profile-dir", str(out / "profile")] if args.profile_part else []),
        *args.serve_args.split(),
    ]
    start = time.perf_counter()
    process, url = start_server(serve, out / "server.log")
    try:
        wait_ready(url, process, timeout=900)
        results["server_ready_seconds"] = time.perf_counter() - start
        health = wait_compiled(url, timeout=900)  # every bucket, as the library engine has
        results["server_compiled_seconds"] = time.perf_counter() - start
        results["server_pass_seconds"] = dict(zip(health["buckets"], health["pass_seconds"], strict=True))
        driver = Driver(url, process.pid)
        over_http = httpx.post(f"{url}/v1/score", json=request, timeout=900).json()
        results["http_same_bits_as_library"] = over_http["results"] == library_answer["results"]
        print(
            "ready in",
            round(results["server_ready_seconds"]),
            "s; same bits over HTTP:",
            results["http_same_bits_as_library"],
            flush=True,
        )

        def measure(name: str, bodies: list[dict], clients: int, questions_of=questions_in) -> None:
            before = server_counters(url)
            wanted = args.profile_part and args.profile_part in name and not results.get("served_profile")
            with ThreadPoolExecutor(1) as pool:
                profiled = pool.submit(profile_server, url, args.seconds) if wanted else None
                row = driver.run(bodies, clients, args.seconds, questions_of)
                if profiled:
                    results["served_profile"] = served_profile(profiled.result(), name, out)
            row |= between(before, server_counters(url), row, results["server_pass_seconds"])
            row["mfu"] = mfu(row, params, results)
            results["rows"][name] = row
            save(results, out)
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

        if "job" in parts:
            measure("job: one request", [request], 1)
        if "articles" in parts:
            for clients in (int(c) for c in args.clients.split(",")):
                measure(f"job: one request per article, {clients} clients", article_bodies(job), clients)
        if "article" in parts:
            measure("one article, 74 questions", seventy_four(job), 8)
        if "pack" in parts:
            bodies = pack_bodies()
            # The pack's floors are computed once, here; and a message alone gets the bits it gets in a batch.
            batched = httpx.post(f"{url}/v1/score", json=bodies[0], timeout=900).json()["results"][0]["packs"]
            alone = {**bodies[0], "inputs": bodies[0]["inputs"][:1]}
            results["pack_alone_equals_batched"] = (
                httpx.post(f"{url}/v1/score", json=alone, timeout=900).json()["results"][0]["packs"]
                == batched
            )
            name = "moderation pack, 32 messages a request (a message counts as a question)"
            measure(name, bodies, 32, questions_of=lambda body: len(body["results"]))
            row = results["rows"][name]
            row["messages_per_hour"] = row["requests"] * 32 / row["seconds"] * 3600
        if "bulk" in parts:
            articles = args.bulk_articles
            row = bulk(url, job, articles, out)
            results["rows"]["bulk command (--url)"] = row
            save(results, out)
            print("bulk", row, flush=True)
    finally:
        stop_server(process)
    if "baselines" in parts:
        shape = json.loads(config.read_text())
        for name, row in baselines(Path(args.tokenizer), shape, job, args.a_articles, results).items():
            results["rows"][f"baseline {name} (transformers)"] = row | {"mfu": row["mfu_vs_fp8_peak"]}
    save(results, out)
    print(table(results))


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
