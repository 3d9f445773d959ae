"""The fp8 gated product (pallas_kernels.gated_fp8) on the GPU: the kernel against XLA's fusions of it.

    JAX_PLATFORMS=cuda python3 benchmarks/gpu_gated_fp8.py --out $OUT

For a 2,048-row tile (a pass's row tile on GPUs) at the gated feed-forward widths of Gemma 3 12B (15,360) and
27B (21,504), with made-up products and scales: first whether the kernel gives the reference's answer (the
dequantized rows, relative to each row's largest value, and the row scales) and the same bits for a row
whatever rows share its launch; then the time of one call, the median of --repeats batches of --calls calls
launched back to back, for the reference (XLA) and for the kernel at each rows-per-program and warp count.
Writes gpu_gated_fp8.json and gpu_gated_fp8.md.
"""

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gated_fp8
from spinf_jax.models.layers import gelu_tanh

ROWS = 2048
WIDTHS = {"gemma3-12b": 15360, "gemma3-27b": 21504}
VARIANTS = [(1, 4), (1, 8), (2, 8), (4, 8), (4, 16)]  # (rows per program, warps)


def inputs(rows: int, width: int, seed: int = 0):
    """Raw gate and up GEMM outputs (bf16) and their scales, at magnitudes like a real layer's."""
    k = jax.random.split(jax.random.key(seed), 5)
    g = (jax.random.normal(k[0], (rows, width)) * 40).astype(jnp.bfloat16)
    u = (jax.random.normal(k[1], (rows, width)) * 40).astype(jnp.bfloat16)
    x_scale = jax.random.uniform(k[2], (rows, 1), minval=0.002, maxval=0.02)
    g_scale = jax.random.uniform(k[3], (width,), minval=1e-4, maxval=1e-3)
    u_scale = jax.random.uniform(k[4], (width,), minval=1e-4, maxval=1e-3)
    return g, u, x_scale, g_scale, u_scale


def dequantized(h, scale) -> np.ndarray:
    return np.asarray(h.astype(jnp.float32) * scale)


def check(width: int) -> dict:
    args = inputs(ROWS, width)
    want_h, want_s = jax.jit(partial(gated_fp8.reference, activation=gelu_tanh))(*args)
    out = {}
    for rows, warps in VARIANTS:
        h, s = gated_fp8.kernel(*args, activation=gelu_tanh, rows=rows, warps=warps)
        row_max = np.asarray(want_s[:, 0]) * gated_fp8.FP8_MAX
        err = np.abs(dequantized(h, s) - dequantized(want_h, want_s)).max(axis=1) / row_max
        # A row's bits whatever shares the launch: rows 0-63 alone against within the whole tile.
        first = [a[:64] if a.shape[0] == ROWS else a for a in args]
        alone = gated_fp8.kernel(*first, activation=gelu_tanh, rows=rows, warps=warps)
        same = [np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y[:64]).view(np.uint8))
                for x, y in zip(alone, (h, s), strict=True)]  # fmt: skip
        out[f"{rows}x{warps}"] = {
            "max_error_of_row_max": float(err.max()),
            "scale_max_relative_difference": float(np.abs(np.asarray(s / want_s) - 1).max()),
            "same_bits_alone": all(same),
        }
    return out


def seconds_per_call(fn, args, calls: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = {"device": str(jax.devices()[0].device_kind), "rows": ROWS, "widths": {}}
    for name, width in WIDTHS.items():
        args = inputs(ROWS, width)
        moved = 2 * ROWS * width * 2 + ROWS * width  # both products read once, the fp8 rows written
        timing = {"xla": seconds_per_call(jax.jit(partial(gated_fp8.reference, activation=gelu_tanh)), args,
                                          a.calls, a.repeats)}  # fmt: skip
        for rows, warps in VARIANTS:
            fn = partial(gated_fp8.kernel, activation=gelu_tanh, rows=rows, warps=warps)
            timing[f"kernel {rows}x{warps}"] = seconds_per_call(fn, args, a.calls, a.repeats)
        results["widths"][name] = {"width": width, "check": check(width), "seconds": timing,
                                   "bytes_once": moved}  # fmt: skip
        print(name, json.dumps(results["widths"][name]), flush=True)
    (a.out / "gpu_gated_fp8.json").write_text(json.dumps(results, indent=1))
    columns = next(iter(results["widths"].values()))["seconds"]
    title = f"fp8 gated product, {ROWS} rows, {results['device']}: us per call (GB/s moved once)"
    lines = [title, "",
             "| width | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]  # fmt: skip
    for name, r in results["widths"].items():
        cells = [f"{1e6 * s:.1f} ({r['bytes_once'] / s / 1e9:.0f})" for s in r["seconds"].values()]
        lines.append(f"| {name} {r['width']} | " + " | ".join(cells) + " |")
    lines += ["", "check (kernel against the reference on the GPU):", "", "```", json.dumps(
        {n: r["check"] for n, r in results["widths"].items()}, indent=1), "```"]  # fmt: skip
    (a.out / "gpu_gated_fp8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
