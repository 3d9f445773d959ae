"""Every GPU of one host against one GPU, side by side in one run (issue 30): the server with `--devices`, and
the Ray Data path with an actor per GPU, at a real model shape with made-up weights.

    python3 benchmarks/multi_gpu.py --tokenizer TOKENIZER_FOLDER --out $OUT       # a host of 2 or more GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python3 benchmarks/multi_gpu.py \\
        --tokenizer spinf/gemma-3-270m --config benchmarks/gemma3-small.json --precision fp32 \\
        --buckets 256,1024 --seconds 10 --articles 48 --out /tmp/multi   # any machine: that the script runs

For 1 device, then all of them (`--devices`, default all):
- server: `spinf-jax serve --devices D --random-weights CONFIG` in a child process, ready once every replica
  is; the seed job as one request per article (8 clients per device) and the moderation pack (32 messages a
  request, 32 clients), each driven --seconds by closed-loop clients (http_throughput.Driver); every
  article's answer compared with the 1-device run's, bit for bit; each replica's peak device memory.
- ray: spinf_jax.ray.score_file on a local Ray cluster with D actors over --articles articles (the seed
  job's, repeated): rows a second, and the output compared with the 1-actor run's, byte for byte.
Writes multi_gpu.json after each part, and a table of the ratios last.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
from common import seed_job, served_shape_arguments, served_shape_config, write_articles
from http_throughput import Driver, article_bodies, pack_bodies, questions_in
from server_process import start_server, stop_server

from spinf_jax import replicas


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    served_shape_arguments(parser)
    parser.add_argument("--devices", default="all", help="the run beside the 1-device one: all, or N")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each server part is driven")
    parser.add_argument("--articles", type=int, default=240, help="the Ray part's rows: the seed job x10")
    parser.add_argument("--parts", default="server,ray")
    parser.add_argument("--out", default=".")
    return parser.parse_args()


def all_ready(url: str, process, timeout: float) -> dict:
    """/health once every replica is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            health = httpx.get(f"{url}/health", timeout=10).json()
            if health.get("replicas") and all(r["state"] == "ready" for r in health["replicas"]):
                return health
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the replicas were not all ready after {timeout:.0f} s")


def server(args, config: Path, devices: int, job: dict, out: Path) -> tuple[dict, list]:
    serve = [args.tokenizer, "--random-weights", str(config), "--precision", args.precision,
             "--buckets", args.buckets, "--compile-cache", str(out / "xla"), "--max-queue", "256",
             "--log-level", "warning", "--devices", str(devices)]  # fmt: skip
    start = time.perf_counter()
    process, url = start_server(serve, out / f"server-{devices}.log")
    try:
        health = all_ready(url, process, timeout=1800)
        row = {"devices": devices, "ready_seconds": time.perf_counter() - start}
        answers = [
            httpx.post(f"{url}/v1/score", json=b, timeout=900).json()["results"] for b in article_bodies(job)
        ]
        driver = Driver(url, process.pid)
        row["articles"] = driver.run(article_bodies(job), 8 * devices, args.seconds, questions_in)
        pack = driver.run(pack_bodies(), 32, args.seconds, lambda body: len(body["results"]))
        row["pack"] = pack | {"messages_per_hour": pack["requests"] * 32 / pack["seconds"] * 3600}
        health = httpx.get(f"{url}/health", timeout=10).json()
        row["peak_memory_gib"] = [
            (r.get("memory") or {}).get("peak_bytes", 0) / 2**30 for r in health["replicas"]
        ]  # absent on the CPU
        return row, answers
    finally:
        stop_server(process)


def ray_part(args, config: Path, devices: int, gpus: int, job: dict, out: Path) -> tuple[dict, str]:
    import ray

    from spinf_jax.ray import score_file, start_local

    source = write_articles(job, args.articles, out / "ray-input.jsonl")
    result = out / f"ray-{devices}.jsonl"
    result.unlink(missing_ok=True)
    scores = {"model": args.tokenizer, "precision": args.precision, "scoring": job["questions"],
              "random_weights": str(config),
              "buckets": [int(b) for b in args.buckets.split(",")]}  # fmt: skip
    start_local(devices)
    try:
        summary = score_file(source, result, scores, devices, 1 if gpus else 0, batch=64)
    finally:
        ray.shutdown()
    questions = summary.scored * len(job["questions"])
    row = {"devices": devices, "rows": summary.scored, "bad": len(summary.bad), "seconds": summary.seconds,
           "questions_per_second": questions / summary.seconds}  # fmt: skip
    return row, result.read_text()


def main() -> None:
    args = arguments()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = served_shape_config(args.config, out)
    found = replicas.probe(os.environ)
    many = replicas.how_many(args.devices, found)
    weights = f"made-up (loader.random_model, seed 0) at the shape of {config.name}"
    results = {"platform": found.platform, "devices": list(found.ids), "precision": args.precision,
               "weights": weights, "runs": {}}  # fmt: skip
    job = seed_job()

    def save():
        (out / "multi_gpu.json").write_text(json.dumps(results, indent=1) + "\n")

    parts = args.parts.split(",")
    if "server" in parts:
        one, first = server(args, config, 1, job, out)
        results["runs"]["server, 1 device"] = one
        save()
        print("server 1", json.dumps(one), flush=True)
        all_, answers = server(args, config, many, job, out)
        all_["same_bits_as_one_device"] = answers == first
        results["runs"][f"server, {many} devices"] = all_
        results["server_speedup"] = {
            "seed job": all_["articles"]["questions_per_second"] / one["articles"]["questions_per_second"],
            "moderation pack": all_["pack"]["messages_per_hour"] / one["pack"]["messages_per_hour"],
        }
        save()
        print(f"server {many}", json.dumps(all_), flush=True)
    if "ray" in parts:
        gpus = len(found.ids) if found.platform == "gpu" else 0
        one, first = ray_part(args, config, 1, gpus, job, out)
        all_, text = ray_part(args, config, many, gpus, job, out)
        all_["same_bytes_as_one_actor"] = text == first
        results["runs"]["ray, 1 actor"], results["runs"][f"ray, {many} actors"] = one, all_
        results["ray_speedup"] = all_["questions_per_second"] / one["questions_per_second"]
        save()
        print("ray", json.dumps([one, all_]), flush=True)
    print(f"{'':<16} {'1 device':>12} {f'{many} devices':>12} {'ratio':>7}  same bits")
    if "server" in parts:
        one, all_ = results["runs"]["server, 1 device"], results["runs"][f"server, {many} devices"]
        for name, get in [("seed job q/s", lambda r: r["articles"]["questions_per_second"]),
                          ("pack msg/hour", lambda r: r["pack"]["messages_per_hour"])]:  # fmt: skip
            print(f"{name:<16} {get(one):>12,.1f} {get(all_):>12,.1f} {get(all_) / get(one):>7.2f}  "
                  f"{all_['same_bits_as_one_device']}")  # fmt: skip
    if "ray" in parts:
        one, all_ = results["runs"]["ray, 1 actor"], results["runs"][f"ray, {many} actors"]
        print(f"{'ray q/s':<16} {one['questions_per_second']:>12,.1f} {all_['questions_per_second']:>12,.1f} "
              f"{results['ray_speedup']:>7.2f}  {all_['same_bytes_as_one_actor']}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
