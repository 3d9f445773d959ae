"""What batch-invariant experts cost: pallas_kernels.moe.grouped, its tiles through the grouped GEMM kernel
(`kernel`, the engine's GPU path) or a loop over tiles (`loop`, the CPU path), against the dense reference
(every token through every expert, at 4,096 tokens: it holds [experts, tokens, hidden] f32) and against
jax.lax.ragged_dot (tokens sorted by expert, no padding), at the expert shapes of Gemma 4 26B-A4B,
Qwen3.5-35B-A3B and Qwen3-30B-A3B, random weights and routing. One script, one run: for each shape, precision
and token count it checks each method against the loop (or, without `loop` in --methods, the dense
reference), checks whether a token's bits survive being computed among other tokens, then times it; writes
gpu_moe.json and prints a table. Each line is printed as it is measured.

    python3 benchmarks/gpu_moe.py --out $OUT            # on the GPU machine
    python3 benchmarks/gpu_moe.py --tokens 4096 --methods kernel,ragged_dot,dense --out $OUT  # skips the loop
    python3 benchmarks/gpu_moe.py --tokens 4096 --precisions bf16 --methods ragged_dot,kernel --out $OUT
    python3 benchmarks/gpu_moe.py --smoke --out /tmp    # small shapes, any machine: that the script runs
"""

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import timed

from pallas_kernels.moe import combine, grouped, per_tile
from spinf_jax.models.moe import TILE, route
from spinf_jax.quant import Precision, grouped_linear, linear, quantize

# name: (experts, top k, hidden, expert inner size, activation)
SHAPES = {
    "gemma-4-26b-a4b": (128, 8, 2816, 704, partial(jax.nn.gelu, approximate=True)),
    "qwen3.5-35b-a3b": (256, 8, 2048, 512, jax.nn.silu),
    "qwen3-30b-a3b": (128, 8, 2048, 768, jax.nn.silu),
}
SMOKE = {"smoke": (8, 2, 64, 32, jax.nn.silu)}


def weights(experts: int, hidden: int, inner: int, precision: Precision):
    keys = jax.random.split(jax.random.key(0), 2)
    gate_up = jax.random.normal(keys[0], (experts, 2 * inner, hidden), jnp.float32) * hidden**-0.5
    down = jax.random.normal(keys[1], (experts, hidden, inner), jnp.float32) * inner**-0.5
    return quantize(gate_up, precision), quantize(down, precision)


def expert_fn(gate_up, down, inner, activation):
    def expert(rows, e):
        pick = partial(jax.tree.map, lambda w: jax.lax.dynamic_index_in_dim(w, e, keepdims=False))
        gate, up = jnp.split(linear(rows, pick(gate_up)), [inner], axis=-1)
        return linear(activation(gate) * up, pick(down), jnp.float32)

    return expert


def kernel_fn(gate_up, down, inner, activation):
    gemm = partial(grouped_linear, interpret=jax.default_backend() != "gpu")  # --smoke on a CPU

    def feed_forward(buffer, tile_expert):
        gate, up = jnp.split(gemm(buffer, tile_expert, gate_up), [inner], axis=-1)
        return gemm(activation(gate) * up, tile_expert, down, jnp.float32)

    return feed_forward


def dense(x, index, weight, expert, experts: int):
    """pallas_kernels.moe.dense with the experts in a loop, not unrolled (128 experts compile slowly)."""
    outs = jax.lax.map(lambda e: expert(x, e), jnp.arange(experts))  # [E, T, hidden]
    return combine(jnp.take_along_axis(jnp.swapaxes(outs, 0, 1), index[..., None], axis=1), weight)


def ragged(x, index, weight, gate_up, down, inner, activation):
    """The same experts with jax.lax.ragged_dot over the pairs sorted by expert (plain weights only)."""
    t, k = index.shape
    chosen = index.reshape(-1)
    order = jnp.argsort(chosen, stable=True)
    sizes = jnp.bincount(chosen, length=gate_up.shape[0]).astype(jnp.int32)
    rows = jnp.repeat(x, k, axis=0)[order]
    h = jax.lax.ragged_dot(rows, jnp.swapaxes(gate_up, 1, 2), sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h.astype(x.dtype), [inner], axis=-1)
    out = jax.lax.ragged_dot(
        (activation(gate) * up).astype(x.dtype),
        jnp.swapaxes(down, 1, 2),
        sizes,
        preferred_element_type=jnp.float32,
    )
    back = jnp.zeros_like(out).at[order].set(out)
    return combine(back.reshape(t, k, -1), weight)


def run(name, shape, precision: Precision, tokens: int, chosen: list[str]) -> dict:
    experts, k, hidden, inner, activation = shape
    gate_up, down = weights(experts, hidden, inner, precision)
    expert = expert_fn(gate_up, down, inner, activation)
    dtype = precision.activation_dtype
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.float32).astype(dtype)
    index, weight = route(
        jax.nn.softmax(jax.random.normal(keys[1], (tokens, experts)) * 2.0), k, normalize=True
    )
    feed_forward = kernel_fn(gate_up, down, inner, activation)
    methods = {
        "loop": jax.jit(lambda x, i, w: grouped(x, i, w, per_tile(expert), experts, tile=TILE)),
        "kernel": jax.jit(lambda x, i, w: grouped(x, i, w, feed_forward, experts, tile=TILE)),
    }
    if tokens <= 4096:
        methods["dense"] = jax.jit(lambda x, i, w: dense(x, i, w, expert, experts))
    if precision is not Precision.FP8:  # ragged_dot takes plain weights
        methods["ragged_dot"] = jax.jit(lambda x, i, w: ragged(x, i, w, gate_up, down, inner, activation))
    # The reference: the loop, else the dense computation (a run that times only the kernel and ragged_dot
    # at 4,096 tokens skips the loop's long compile).
    reference = "loop" if "loop" in chosen or "dense" not in methods else "dense"
    want = np.asarray(methods[reference](x, index, weight))
    methods = {m: methods[m] for m in chosen if m in methods}
    out = {"shape": name, "precision": precision.value, "tokens": tokens, "experts": experts, "top_k": k,
           "reference": reference}  # fmt: skip
    active_flops = 2 * tokens * k * 3 * hidden * inner
    for method, fn in methods.items():
        # The first call's time (compile and run) is printed as it happens, so a run stopped at its time
        # limit still says where it was.
        start = time.perf_counter()
        got = np.asarray(fn(x, index, weight))
        print(
            name,
            precision.value,
            tokens,
            method,
            f"first call {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        seconds = timed(
            fn, x, index, weight
        )  # before the invariance check's own compile (ragged_dot: ~100 s)
        out[method] = {
            "ms": seconds * 1e3,
            "active_tflops": active_flops / seconds / 1e12,
            "max_abs_vs_reference": float(np.abs(got - want).max()),
        }
        print(name, precision.value, tokens, method, out[method], flush=True)
        # A quarter of the tokens, alone and then after the other three quarters reversed: the same bits?
        part = slice(0, tokens // 4)
        alone = np.asarray(fn(x[part], index[part], weight[part]))
        rest = slice(tokens // 4, tokens)
        mixed = [jnp.concatenate([a[rest][::-1], a[part]]) for a in (x, index, weight)]
        among = np.asarray(fn(*mixed))[tokens - tokens // 4 :]
        out[method]["invariant"] = bool((alone == got[part]).all() and (among == got[part]).all())
        print(name, precision.value, tokens, method, "invariant:", out[method]["invariant"], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="16384,4096")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--methods", default="kernel,ragged_dot,dense,loop", help="timed, in this order")
    parser.add_argument(
        "--precisions", default="fp8,bf16", help="in this order (ragged_dot takes bf16 weights only)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens: any machine")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    shapes = SMOKE if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    tokens = [256] if args.smoke else [int(t) for t in args.tokens.split(",")]
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tile": TILE, "runs": []}
    for name, shape in shapes.items():
        for precision in map(Precision, args.precisions.split(",")):
            for t in tokens:
                results["runs"].append(run(name, shape, precision, t, args.methods.split(",")))
                Path(args.out, "gpu_moe.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"{'shape':<18} {'prec':<5} {'tokens':>6} {'method':<11} {'ms':>9} {'TFLOP/s':>8} {'Δ vs ref':>9} "
        "invariant"
    )
    for r in results["runs"]:
        for method in ("loop", "kernel", "dense", "ragged_dot"):
            if method in r:
                m = r[method]
                print(
                    f"{r['shape']:<18} {r['precision']:<5} {r['tokens']:>6} {method:<11} {m['ms']:>9.2f} "
                    f"{m['active_tflops']:>8.1f} {m['max_abs_vs_reference']:>9.2g} {m['invariant']}"
                )


if __name__ == "__main__":
    main()
