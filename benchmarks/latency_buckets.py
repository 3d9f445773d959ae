"""What a short decision request costs by the engine's row tile and smallest bucket: the data to choose a
latency configuration by (issue 69's "small buckets chosen by measured cost").

For each row tile in --tiles, an engine at --shape (made-up weights, common.random_engine) with buckets 2 ×
tile (the smallest a tile allows: Buckets.check_row_tile), --fits where that is larger (512: a Kev request,
~350 tokens with its branches, fits) and --big (the same large bucket in every engine: what the smaller tile
costs bulk passes). Engine.warmup compiles each bucket's program; a pass of each is then timed alone (the
median of 5). Then --repeats System One requests of Kev's shape (decisions_http.state: a new ~100-token
support message each, the 6 questions of decisions_http.QUESTIONS), one at a time through the library
(`engine.service.systemone`): wall time of each, from the request dict to the reply dict, its pass(es)
included; median and 90th percentile, the buckets its passes ran in, and the median of those passes from
launch to results on the host (reads included: Engine.on_pass), beside the pass alone. The first request of
each engine is left out (its floors are read then, as a server's first request does).

    cd benchmarks && JAX_PLATFORMS=cuda python3 latency_buckets.py --tokenizer /tmp/tok/tokenizer.json \
        --shape qwen3.5-4b --tiles 256,512,1024,2048 --out $OUT/latency

Row tiles change bits (they are in the fingerprint), so each engine's answers are its own; the table says
which configuration answers fastest and what it costs a large pass. Writes latency_buckets.json and .md.
--profile (GPU) traces 5 more requests per tile: their kernels by class and the device's idle stretches
(benchmarks/pass_profile.py's tables), in the JSON and printed.
"""

import json
import statistics
import tempfile
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path

import jax
from common import SHAPES, engine_args, random_engine
from decisions_http import QUESTIONS, machine, state
from pass_profile import device_kernels, summarize
from pass_profile import table as kernel_table

PROFILED = 5  # requests traced with --profile


def measure(args, tile: int) -> dict:
    sizes = sorted({2 * tile, max(2 * tile, args.fits), args.big})
    buckets = ",".join(map(str, sizes))
    engine = random_engine(Namespace(**{**vars(args), "row_tile": tile, "buckets": buckets}))
    start = time.perf_counter()
    engine.warmup()
    compile_seconds = time.perf_counter() - start
    # A pass alone (Engine._time_pass: the program without its read chunks), the median of 5 each.
    pass_seconds = {str(s): statistics.median(engine._time_pass(s) for _ in range(5)) for s in sizes}
    body = {"model": "jev-latest", "questions": QUESTIONS}
    engine.service.systemone(body | {"state": state(args.seed, 0)})  # the questions' floors
    seconds, passes = [], []
    engine.on_pass = lambda size, took: passes.append((size, took))
    for i in range(1, args.repeats + 1):
        start = time.perf_counter()
        reply = engine.service.systemone(body | {"state": state(args.seed, i)})
        seconds.append(time.perf_counter() - start)
    assert set(reply["answers"]) == set(QUESTIONS), reply
    ordered = sorted(seconds)
    profile = None
    if args.profile:  # where a request's time goes on the device: kernels by class, and the device's idle
        trace_dir = Path(tempfile.mkdtemp())
        with jax.profiler.trace(str(trace_dir)):
            start = time.perf_counter()
            for i in range(PROFILED):
                engine.service.systemone(body | {"state": state(args.seed, args.repeats + 1 + i)})
            wall = time.perf_counter() - start
        profile = summarize(device_kernels(trace_dir), wall)
        print(kernel_table(profile, f"row tile {tile}, {PROFILED} Kev requests"), flush=True)
    return {
        "row_tile": tile,
        "buckets": sizes,
        "pass_seconds": pass_seconds,
        "request_passes": dict(sorted(Counter(str(size) for size, _ in passes).items())),
        # from the pass's launch to its results on the host, reads included (Engine.on_pass)
        "request_pass_p50_ms": 1000 * statistics.median(took for _, took in passes),
        "compile_seconds": compile_seconds,
        "request_p50_ms": 1000 * statistics.median(seconds),
        "request_p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
        "requests": len(seconds),
        "fingerprint": engine.fingerprint,
        "profile": profile,
    }


def table(rows: list[dict], big: int) -> str:
    lines = [
        f"| row tile | smallest bucket | its pass | {big}-row pass | Kev request p50 | p90 "
        "| its passes, p50 | passes (bucket: n) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        small = str(r["buckets"][0])
        lines.append(
            f"| {r['row_tile']} | {small} | {1000 * r['pass_seconds'][small]:.2f} ms | "
            f"{1000 * r['pass_seconds'][str(big)]:.2f} ms | {r['request_p50_ms']:.2f} ms | "
            f"{r['request_p90_ms']:.2f} ms | {r['request_pass_p50_ms']:.2f} ms | {r['request_passes']} |"
        )
    return "\n".join(lines)


def main() -> None:
    def extra(parser):
        parser.add_argument("--tiles", default="512,1024,2048", help="row tiles, comma-separated")
        parser.add_argument("--big", type=int, default=4096, help="the large bucket every engine has")
        parser.add_argument("--fits", type=int, default=512, help="a bucket that holds a Kev request")
        parser.add_argument("--seed", type=int, default=0, help="the states' seed")
        parser.set_defaults(repeats=20)
        parser.add_argument("--profile", action="store_true", help=f"trace {PROFILED} more requests (GPU)")

    args = engine_args(__doc__, extra)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tile in (int(t) for t in args.tiles.split(",")):
        rows.append(measure(args, tile))
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows, args.big)
    print(text)
    document = {
        "benchmark": "latency_buckets",
        "machine": machine(),
        "shape": args.shape,
        "layers": SHAPES[args.shape].get("num_hidden_layers"),
        "precision": args.precision,
        "weights": "made-up (common.random_engine)",
        "questions": QUESTIONS,
        "results": rows,
    }
    (out / "latency_buckets.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / "latency_buckets.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
