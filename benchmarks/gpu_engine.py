"""The engine on a GPU at a real model shape with random weights: kernel check, fp8 lowering, bucket
invariance, and throughput on the seed job. One script, one run; prints a table, ends with one JSON line.

Random weights at the real shape are fine for speed and for invariance (neither depends on the values);
the tokenizer is Gemma 3's (its ids folded into a smaller vocabulary: common.shape_tokenizer). Run on the
GPU machine from the repo root (--shape: Gemma 3 12B by default, or Qwen3.5 4B / 9B, Gemma 4 26B-A4B, ...):

    python3 benchmarks/gpu_engine.py --tokenizer gemma3-tokenizer.json --shape qwen3.5-4b --out $OUT
"""

import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    SHAPES,
    SyntheticCheckpoint,
    companions_agree,
    engine_args,
    gemm_peaks,
    linear_params,
    seed_job,
    seed_request,
    shape_tokenizer,
    timed,
)

from pallas_kernels.tree_attention import blockwise, kernel, reference
from spinf_jax.engine import Engine
from spinf_jax.layout import QuestionKey, build_tree
from spinf_jax.loader import Model, load_weights
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets, pack
from spinf_jax.quant import Precision, linear, quantize


def check_kernel(results: dict) -> None:
    """Kernel vs pure-JAX twin vs dense reference on a pack of trees at head_dim 256 and 128."""
    rng = np.random.default_rng(0)
    block = 128
    # Trees of a 400-token trunk and 10 questions of 19 tokens with two one-token options, as the packer
    # lays them out in a 4,096-token pass.
    questions = [QuestionKey((100 + i,) * 19, ((1,), (2,))) for i in range(10)]
    trees = [build_tree([2], rng.integers(5, 500, 399).tolist(), questions) for _ in range(6)]
    [p] = pack(trees, Buckets((4096,), block))
    t = p.size
    args = tuple(map(jnp.asarray, (p.positions, p.span_end, p.trunk_end, p.branch_start, p.tree_start)))
    out = []
    for d, heads, kv, window in ((256, 16, 8, None), (256, 16, 8, 1024), (128, 32, 8, None)):
        q = jnp.asarray(rng.standard_normal((t, heads, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((t, kv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((t, kv, d)), jnp.bfloat16)
        scale = d**-0.5
        got = kernel(q, k, v, *args, scale=scale, window=window, block=block)
        twin = jax.jit(blockwise, static_argnames=("scale", "window", "block"))(
            q, k, v, *args, scale=scale, window=window, block=block
        )
        ref = jax.jit(reference, static_argnames=("scale", "window"))(
            q, k, v, *args[:2], scale=scale, window=window
        )
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        seconds = timed(partial(kernel, scale=scale, window=window, block=block), q, k, v, *args)
        out.append(
            {
                "head_dim": d,
                "heads": heads,
                "kv_heads": kv,
                "window": window,
                "tokens": t,
                "max_abs_vs_reference": float(np.abs(f32(got) - f32(ref)).max()),
                "max_abs_vs_pure_jax_twin": float(np.abs(f32(got) - f32(twin)).max()),
                "kernel_ms": seconds * 1e3,
            }
        )
    results["kernel"] = out


def check_fp8(results: dict, decoder) -> None:
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    w = quantize(jax.random.normal(jax.random.key(0), (8192, 8192)), Precision.FP8)
    results["fp8_uses_cublaslt_f8"] = (
        "__cublas$lt$matmul$f8" in jax.jit(linear).lower(x, w).compile().as_text()
    )
    results |= gemm_peaks(decoder)
    results["fp8_linear_8192_tflops"] = 2 * 8192**3 / timed(jax.jit(linear), x, w) / 1e12


def main() -> None:
    args = engine_args(__doc__)
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "weights": "made-up values (a repeated random pattern), real shape, through the loader",
    }

    check_kernel(results)
    precision, config = Precision(args.precision), SHAPES[args.shape]
    decoder = abstract_decoder(config, precision)
    check_fp8(results, decoder)  # the peaks need only its shapes

    start = time.perf_counter()
    load_weights(decoder, SyntheticCheckpoint(decoder, config))
    memory = jax.devices()[0].memory_stats() or {}
    tok = shape_tokenizer(args.tokenizer, config)
    model = Model(f"{args.shape}-shape-random", decoder, tok, digest="random-0")
    results["model"] = {
        "config": f"{args.shape} text",
        "precision": precision.value,
        "linear_params": linear_params(decoder),
        "load_seconds": time.perf_counter() - start,
        "weights_device_gib": memory.get("bytes_in_use", 0) / 2**30,
        "load_peak_device_gib": memory.get("peak_bytes_in_use", 0) / 2**30,
    }
    buckets = Buckets(tuple(int(b) for b in args.buckets.split(",")))
    engine = Engine(model, buckets)
    start = time.perf_counter()
    engine.warmup()
    results["compile_seconds"] = time.perf_counter() - start
    results["row_tile"] = model.row_tile
    # What a pass needs beyond the weights: XLA's buffer assignment for each bucket's program.
    results["program_temp_gib"] = {
        size: engine.lowered(size).compile().memory_analysis().temp_size_in_bytes / 2**30
        for size in buckets.sizes
    }
    print("model", results["model"], "compile_seconds", results["compile_seconds"], flush=True)
    print("program_temp_gib", results["program_temp_gib"], flush=True)

    job = seed_job()
    request = seed_request(job)
    start = time.perf_counter()
    first = engine.score(request)
    results["first_call_seconds"] = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        again = engine.score(request)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    usage = again["usage"]["prompt_tokens_details"]
    tokens = usage["content_tokens"] + usage["query_tokens"]
    questions = len(job["contents"]) * len(job["questions"])
    results["job"] = {
        "contents": len(job["contents"]),
        "questions": questions,
        "tokens": tokens,
        "seconds": seconds,
        "questions_per_second": questions / seconds,
        "tokens_per_second": tokens / seconds,
        "mfu_vs_measured_fp8_peak": 2
        * results["model"]["linear_params"]
        * tokens
        / seconds
        / (results["fp8_gemm_tflops"] * 1e12),
        "same_results_every_call": again["results"] == first["results"],
    }
    # Invariance, against the job's answer (articles packed in order, two passes of the largest bucket, the
    # first article at offset 0): every article with the job reversed (each at another offset, with other
    # neighbours, some in the other pass); the first and last alone (the smallest bucket); the last alone in
    # the largest bucket (an engine whose only bucket it is).
    by_id = {r["input_id"]: r for r in first["results"]}
    reversed_job = engine.score({**request, "inputs": request["inputs"][::-1]})["results"]

    def alone(engine: Engine, i: int) -> dict:
        return engine.score({**request, "inputs": [request["inputs"][i]]})["results"][0]

    last = len(request["inputs"]) - 1
    results["invariance"] = {
        "companions_equal_packed": companions_agree(engine, request, first),
        "reversed_equals_packed": all(r == by_id[r["input_id"]] for r in reversed_job),
        "first_alone_equals_packed": alone(engine, 0) == first["results"][0],
        "last_alone_equals_packed": alone(engine, last) == first["results"][last],
        "other_bucket_equals_packed": alone(Engine(model, Buckets((buckets.sizes[-1],))), last)
        == first["results"][last],
    }
    stats = jax.devices()[0].memory_stats() or {}
    results["peak_device_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30

    rows = [(k, v) for k, v in results.items() if not isinstance(v, dict | list)]
    rows += [(f"model.{k}", v) for k, v in results["model"].items()]
    rows += [(f"program_temp_gib[{k}]", v) for k, v in results["program_temp_gib"].items()]
    rows += [(f"job.{k}", v) for k, v in results["job"].items()] + [
        (f"invariance.{k}", v) for k, v in results["invariance"].items()
    ]
    rows += [
        (
            f"kernel d={r['head_dim']} w={r['window']}",
            f"{r['kernel_ms']:.2f} ms, max|Δ| ref {r['max_abs_vs_reference']:.3g}",
        )
        for r in results["kernel"]
    ]
    for k, v in rows:
        print(f"{k:<40} {v}")
    line = json.dumps(results)
    Path(args.out, f"gpu_engine-{args.shape}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(line)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
