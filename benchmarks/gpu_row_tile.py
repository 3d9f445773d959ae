"""What the GPU row tile buys and costs: bucket invariance per row tile on the tiny fixtures, and seed-job
throughput per row tile at the Gemma 3 12B width (first `--layers` layers, random fp8 weights), side by side
in one run. Row tiles: None (each pass's rows at once) and the fixed tiles the engine can use.

    python3 benchmarks/gpu_row_tile.py --tokenizer gemma3-tokenizer.json --out $OUT
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import tokenizers
from common import GEMMA3_12B, linear_params, seed_job, seed_request

from spinf_jax.engine import Engine
from spinf_jax.layout import QuestionKey, build_tree
from spinf_jax.loader import Model, load_model, random_weights
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision
from spinf_jax.tokenizer import Tokenizer

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
TILES = (None, 512, 1024, 2048)


def invariance(tile: int | None) -> dict:
    """One tree's log-probs alone, packed after six others, and in a larger bucket: all bit-identical?"""
    questions = [QuestionKey((11, 12, 13), ((40,), (41,))), QuestionKey((14,) * 20, ((50, 51, 52), (53,)))]
    rng = np.random.default_rng(0)
    target = build_tree([2], rng.integers(5, 500, 300).tolist(), questions)
    others = [build_tree([2], rng.integers(5, 500, 100 + 57 * i).tolist(), questions) for i in range(6)]
    out = {}
    # The two that differed without tiles on the H200 (2026-11-29); tests/test_gpu.py checks all four.
    for family, precision in (("gemma3", "fp32"), ("qwen3", "bf16")):
        model = load_model(str(TINY / family), precision).with_row_tile(tile)
        small = 4096 if tile == 2048 else 2048
        engine = Engine(model, Buckets((small, 8192)))
        alone = engine.score_trees([target])[0].logprobs
        packed = engine.score_trees([*others, target])[-1].logprobs
        bigger = Engine(model, Buckets((8192,))).score_trees([target])[0].logprobs
        out[f"{family}_{precision}"] = bool(np.array_equal(alone, packed) and np.array_equal(alone, bigger))
    return out


def throughput(
    model: Model, tile: int | None, request: dict, questions: int, repeats: int, bucket: int
) -> dict:
    model = model.with_row_tile(tile)
    engine = Engine(model, Buckets((bucket,)))
    start = time.perf_counter()
    engine.warmup()
    compile_seconds = time.perf_counter() - start
    engine.score(request)  # floors
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.score(request)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    usage = engine.score(request)["usage"]["prompt_tokens_details"]
    tokens = usage["content_tokens"] + usage["query_tokens"]
    return {
        "compile_seconds": compile_seconds,
        "seconds": seconds,
        "questions_per_second": questions / seconds,
        "tokens_per_second": tokens / seconds,
        "linear_tflops": 2 * linear_params(model.decoder) * tokens / seconds / 1e12,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket", type=int, default=16384)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "invariance": {}}
    for tile in TILES:
        results["invariance"][str(tile)] = invariance(tile)
        print("invariance", tile, results["invariance"][str(tile)], flush=True)

    decoder = abstract_decoder({**GEMMA3_12B, "num_hidden_layers": args.layers}, Precision.FP8)
    random_weights(decoder, jax.random.key(0))
    tok = Tokenizer(tokenizers.Tokenizer.from_file(args.tokenizer), bos_id=2, add_bos=True)
    model = Model("gemma-3-12b-width-random", decoder, tok, digest="random-0")
    job = seed_job()
    request = seed_request(job)
    questions = len(job["contents"]) * len(job["questions"])
    results["model"] = {"config": f"gemma-3-12b text, first {args.layers} layers", "precision": "fp8"}
    results["throughput"] = {}
    for tile in TILES:
        results["throughput"][str(tile)] = throughput(
            model, tile, request, questions, args.repeats, args.bucket
        )
        r = results["throughput"][str(tile)]
        print(
            f"tile {tile}: {r['questions_per_second']:.1f} q/s, compile {r['compile_seconds']:.0f} s",
            flush=True,
        )
    base = results["throughput"]["None"]
    for r in results["throughput"].values():
        r["relative_to_untiled"] = base["seconds"] / r["seconds"]

    print(f"{'row tile':<10} {'invariant (tiny)':<18} {'q/s':>8} {'vs untiled':>11} {'compile s':>10}")
    for tile in TILES:
        inv, r = results["invariance"][str(tile)], results["throughput"][str(tile)]
        print(
            f"{tile!s:<10} {all(inv.values())!s:<18} {r['questions_per_second']:>8.1f} "
            f"{r['relative_to_untiled']:>11.3f} {r['compile_seconds']:>10.0f}"
        )
    Path(args.out, "gpu_row_tile.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
