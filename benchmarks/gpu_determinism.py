"""Which programs of the Gemma 4 26B-A4B shape give other bits when run twice on the same inputs? On the
H200 (2026-12-05) the seed job at that shape was not the same twice (gpu_engine.py: same_results_every_call
False), where the dense shapes were. Each part runs twice and compares:
- the grouped experts (pallas_kernels.moe.grouped) at 8,192 tokens, 128 experts of 704, top 8, fp8 and bf16,
  their tiles through a loop of XLA GEMMs and through the grouped GEMM kernel, and a third of the tokens alone
  against the same rows of the whole;
- a dense fp8/bf16 linear of the same width;
- the tree-attention kernel at head_dim 512 (the global layers, 2 kv heads) and 256 with the 1,024 window;
- the 6-layer stack (5 sliding, 1 global) with random fp8 weights, with and without the MoE block.

    python3 benchmarks/gpu_determinism.py --out $OUT     (--small: tiny shapes, any machine)
"""

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import GEMMA4_26B_A4B

from pallas_kernels import moe
from pallas_kernels.tree_attention import kernel
from spinf_jax.loader import Model, random_weights
from spinf_jax.models import abstract_decoder
from spinf_jax.models.layers import TreeBatch, gelu_tanh
from spinf_jax.models.moe import route
from spinf_jax.quant import Precision, grouped_linear, linear, quantize

SMALL = {"hidden_size": 64, "intermediate_size": 48, "num_experts": 8, "top_k_experts": 2,
         "moe_intermediate_size": 32, "head_dim": 32, "global_head_dim": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip


def twice(fn, *args) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(fn(*args), np.float32), np.asarray(fn(*args), np.float32)


def rows_differing(a: np.ndarray, b: np.ndarray) -> int:
    return int((a != b).reshape(len(a), -1).any(-1).sum())


def _expert(rows, i, *, gate_up, down, inner: int):
    """Expert i's GeGLU of rows [N, hidden], as spinf_jax.models.moe.Experts computes it (fused weights)."""

    def pick(weight):
        return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), weight)

    gate, up = jnp.split(linear(rows, pick(gate_up)), [inner], axis=-1)
    return linear(gelu_tanh(gate) * up, pick(down), jnp.float32)


def _tiles(rows, tile_expert, *, gate_up, down, inner: int):
    """_expert's arithmetic for every tile at once, each GEMM one grouped kernel (the engine's GPU path)."""
    gemm = partial(grouped_linear, interpret=jax.default_backend() != "gpu")  # --small on a CPU
    gate, up = jnp.split(gemm(rows, tile_expert, gate_up), [inner], axis=-1)
    return gemm(gelu_tanh(gate) * up, tile_expert, down, jnp.float32)


def experts(cfg: dict, tokens: int) -> dict:
    h, e, k, f = cfg["hidden_size"], cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"]
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, h), jnp.bfloat16)
    index, weight = route(jax.nn.softmax(jax.random.normal(keys[1], (tokens, e)), -1), k, True)
    out = {}
    for precision in ("fp8", "bf16"):
        gate_up = quantize(jax.random.normal(keys[2], (e, 2 * f, h)) * 0.02, Precision(precision))
        down = quantize(jax.random.normal(keys[3], (e, h, f)) * 0.02, Precision(precision))

        expert = partial(_expert, gate_up=gate_up, down=down, inner=f)
        kernel = partial(_tiles, gate_up=gate_up, down=down, inner=f)
        for name, feed_forward in (("loop", moe.per_tile(expert)), ("kernel", kernel)):
            grouped = jax.jit(lambda x, i, w, ff=feed_forward: moe.grouped(x, i, w, ff, e, tile=64))
            a, b = twice(grouped, x, index, weight)
            third = tokens // 3
            part = np.asarray(grouped(x[:third], index[:third], weight[:third]), np.float32)
            out[f"experts_{precision}_{name}"] = {
                "rows_differing_twice": rows_differing(a, b),
                "third_alone_rows_differing": rows_differing(part, a[:third]),
            }
        dense = quantize(
            jax.random.normal(keys[4], (cfg["intermediate_size"], h)) * 0.02, Precision(precision)
        )
        c, d = twice(jax.jit(lambda x, dense=dense: linear(x, dense)), x)
        out[f"dense_linear_{precision}_rows_differing_twice"] = rows_differing(c, d)
    return out


def attention(tokens: int) -> dict:
    keys = jax.random.split(jax.random.key(1), 3)
    out = {}
    for d, heads, kv, window in [(512, 16, 2, None), (256, 16, 8, 1024)]:
        q = jax.random.normal(keys[0], (tokens, heads, d), jnp.bfloat16)
        k, v = (jax.random.normal(key, (tokens, kv, d), jnp.bfloat16) for key in keys[1:])
        rows = jnp.arange(tokens, dtype=jnp.int32)
        ends = jnp.full((tokens,), tokens, jnp.int32)
        arrays = (rows, ends, ends, rows + 1, jnp.zeros(tokens // 64, jnp.int32))
        fn = jax.jit(lambda *a, window=window: kernel(*a, scale=1.0, window=window, block=64))
        out[f"attention_d{d}_window{window}"] = rows_differing(*twice(fn, q, k, v, *arrays))
    return out


def stack(cfg: dict) -> dict:
    out = {}
    ids = np.random.default_rng(0).integers(3, 500, 2000).tolist()
    batch = TreeBatch.sequence(ids, block=64)
    for with_experts in (True, False):
        decoder = abstract_decoder(cfg | {"num_hidden_layers": 6, "enable_moe_block": with_experts}, "fp8")
        random_weights(decoder, jax.random.key(1))
        model = Model("determinism", decoder, None)
        out[f"stack_6_layers_moe_{with_experts}"] = rows_differing(*twice(model.hidden, batch))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    cfg = GEMMA4_26B_A4B | (SMALL if args.small else {})
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    parts = [partial(experts, cfg, 512 if args.small else 8192), partial(stack, cfg)]
    if jax.default_backend() == "gpu":  # the kernel is the GPU's (its CPU twin is tested for this)
        parts.insert(1, partial(attention, 4096))
    for part in parts:  # each part's lines as soon as it ends: a part may not end within a device call
        start = time.perf_counter()
        found = part()
        results |= found
        for key, value in found.items():
            print(f"{key:40s} {value}")
        print(f"({part.func.__name__}: {time.perf_counter() - start:.1f} s)", flush=True)
        Path(args.out, "gpu_determinism.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
