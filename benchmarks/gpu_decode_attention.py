"""Decode-attention time of one extraction step at Gemma 3 12B's attention shape: the Triton kernel and the
Mosaic GPU kernel side by side, and how far apart their outputs are.

The steps are the GPU's: searched slots (1,024 rows: 128 groups of 8 hypotheses, 48 history columns) and
generated ones (256 rows: 256 groups of 1, 144 columns), at half their history. The pass is 16,384 rows of
trees on 16-row boundaries, each a trunk of 600-1,000 rows then 8 slots' templates of 12-40 rows; the
groups are its slots in order (a slot whose tree did not fit reads nothing, as a finished slot). q, k, v, the
pass's cache and the history are random bf16 at 16 query heads, 8 kv heads, head_dim 256. A step of that
model runs the kernel 40 times with the 1,024-token window and 8 times without: the per-step time is that sum.
Run on the GPU machine from the repo root:

    python3 benchmarks/gpu_decode_attention.py --out $OUT
"""

import argparse
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import timed

from pallas_kernels import decode_attention, decode_attention_mosaic
from spinf_jax.layout import MAX_ANSWER_TOKENS, MAX_CLOSING_TOKENS, MAX_GENERATED_TOKENS, SEARCH_WIDTH

SLIDING_LAYERS, GLOBAL_LAYERS = 40, 8
PASS_ROWS, HEADS, KV, HEAD_DIM = 16384, 16, 8, 256
STEPS = {  # width: (groups, history columns), the GPU's decode steps (engine.step_sizes)
    SEARCH_WIDTH: (1024 // SEARCH_WIDTH, MAX_ANSWER_TOKENS + MAX_CLOSING_TOKENS),
    1: (256, MAX_GENERATED_TOKENS + MAX_CLOSING_TOKENS),
}


def slots(rng) -> np.ndarray:
    """[n, 4] (tree start, trunk end, template start, slot end) of the pass's slots, tree by tree."""
    out, start = [], 0
    while True:
        trunk = int(rng.integers(600, 1001))
        templates = rng.integers(12, 41, 8)
        if start + trunk + templates.sum() > PASS_ROWS:
            return np.array(out, np.int32)
        branch = start + trunk
        for length in templates:
            out.append((start, start + trunk, branch, branch + length))
            branch += length
        start = -(-branch // 16) * 16


def step_arrays(width: int, step: int, rng) -> tuple:
    """A decode step's arguments at history column `step`, and how many of its groups are live."""
    groups, columns = STEPS[width]
    places = slots(rng)[:groups]
    live = len(places)
    places = np.concatenate([places, np.zeros((groups - live, 4), np.int32)])
    start, trunk_end, branch, slot_end = (jnp.asarray(c) for c in places.T)
    first = trunk_end - start + slot_end - branch
    keys = jax.random.split(jax.random.key(width), 7)
    r = groups * width

    def normal(i, shape):
        return jax.random.normal(keys[i], shape, jnp.bfloat16)

    args = (
        normal(0, (r, HEADS, HEAD_DIM)),
        normal(1, (r, KV, HEAD_DIM)),
        normal(2, (r, KV, HEAD_DIM)),
        normal(3, (PASS_ROWS, KV, HEAD_DIM)),
        normal(4, (PASS_ROWS, KV, HEAD_DIM)),
        normal(5, (groups, columns, width, KV, HEAD_DIM)),
        normal(6, (groups, columns, width, KV, HEAD_DIM)),
        jnp.repeat(first + step, width),
        start,
        trunk_end,
        branch,
        slot_end,
        jnp.asarray(rng.integers(0, width, (groups, width, columns)), jnp.int32),
        jnp.int32(step),
    )
    return args, live


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    kernels = {
        "triton": decode_attention.kernel,
        "mosaic": decode_attention_mosaic.kernel,
        "mosaic, 2 slots": partial(decode_attention_mosaic.kernel, slots=2),
    }
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "shape": f"{HEADS} q heads, {KV} kv heads, head_dim {HEAD_DIM}, bf16, random values",
        "steps": [],
    }
    for width, (groups, columns) in STEPS.items():
        for step in (0, columns // 2):  # the first step reads no path
            arrays, live = step_arrays(width, step, np.random.default_rng(0))
            row = {"slots": "searched" if width > 1 else "generated", "groups": groups, "live_groups": live}
            row |= {"width": width, "step": step}
            outputs = {}
            for name, fn in kernels.items():
                times = {}
                for label, window in (("sliding_ms", 1024), ("global_ms", None)):
                    call = jax.jit(partial(fn, scale=HEAD_DIM**-0.5, window=window, block=64))
                    times[label] = timed(call, *arrays) * 1e3
                    outputs[name, window] = np.asarray(call(*arrays), np.float32)[: live * width]
                times["per_step_ms"] = (
                    SLIDING_LAYERS * times["sliding_ms"] + GLOBAL_LAYERS * times["global_ms"]
                )
                times["over_triton"] = (
                    times["per_step_ms"] / row["triton"]["per_step_ms"] if row.get("triton") else 1.0
                )
                times["max_abs_vs_triton"] = max(
                    float(np.abs(outputs[name, w] - outputs["triton", w]).max()) for w in (1024, None)
                )
                row[name] = times
            results["steps"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out, "gpu_decode_attention.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"{'slots':<10} {'step':>4} {'kernel':<16} {'sliding ms':>11} {'global ms':>10} {'per step ms':>12}",
        end="",
    )
    print(f" {'× triton':>9} {'max |Δ|':>8}")
    for row in results["steps"]:
        for name in kernels:
            r = row[name]
            print(
                f"{row['slots']:<10} {row['step']:>4} {name:<16} {r['sliding_ms']:>11.3f}"
                f" {r['global_ms']:>10.3f} {r['per_step_ms']:>12.2f} {r['over_triton']:>9.3f}"
                f" {r['max_abs_vs_triton']:>8.4f}"
            )


if __name__ == "__main__":
    main()
