"""Mixtures of experts (pallas_kernels.moe): the grouped computation against the dense reference, a token's
result independent of every other token, and the grouped GEMM kernel (in Pallas' interpreter) against its
reference and against the loop over tiles in the tiny MoE models."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import dense, grouped, grouped_matmul, grouped_matmul_reference, per_tile
from spinf_jax.loader import load_model
from spinf_jax.models.layers import TreeBatch
from spinf_jax.models.moe import Experts, route
from spinf_jax.quant import Precision, grouped_linear, linear, quantize

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"

T, HIDDEN, INNER, EXPERTS, K = 48, 32, 24, 8, 2


def _experts(precision: Precision):
    keys = jax.random.split(jax.random.key(0), 3)
    gate, up = (jax.random.normal(k, (EXPERTS, INNER, HIDDEN)) * HIDDEN**-0.5 for k in keys[:2])
    down = jax.random.normal(keys[2], (EXPERTS, HIDDEN, INNER)) * INNER**-0.5
    gate, up, down = (quantize(w, precision) for w in (gate, up, down))

    def expert(rows, e):
        pick = lambda w: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), w)  # noqa: E731
        return linear(jax.nn.silu(linear(rows, pick(gate))) * linear(rows, pick(up)), pick(down), jnp.float32)

    return expert


def _tokens(seed: int, n: int = T, skew: bool = False):
    x = jax.random.normal(jax.random.key(seed), (n, HIDDEN))
    logits = jax.random.normal(jax.random.key(seed + 1), (n, EXPERTS))
    if skew:  # most tokens to expert 3: one expert's rows fill several tiles
        logits = logits.at[:, 3].add(4.0)
    return x, *route(jax.nn.softmax(logits), K, normalize=True)


@pytest.mark.parametrize(
    "precision, skew", [(Precision.FP32, False), (Precision.FP32, True), (Precision.FP8, True)]
)
def test_grouped_is_the_dense_reference(precision, skew):
    expert = _experts(precision)
    x, index, weight = _tokens(1, skew=skew)
    want = dense(x, index, weight, expert, EXPERTS)
    got = jax.jit(lambda *a: grouped(*a, per_tile(expert), EXPERTS, tile=8))(x, index, weight)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_tokens_bits_do_not_depend_on_the_other_tokens():
    """The same token alone, among others, after others, or with the whole batch routed elsewhere: the same
    bits (its row lands at another place of another tile each time)."""
    expert = _experts(Precision.FP8)
    run = jax.jit(lambda *a: grouped(*a, per_tile(expert), EXPERTS, tile=8))
    x, index, weight = _tokens(2)
    full = np.asarray(run(x, index, weight))
    others = _tokens(3, skew=True)
    for rows in (slice(0, 1), slice(5, 17), slice(30, T)):
        np.testing.assert_array_equal(np.asarray(run(x[rows], index[rows], weight[rows])), full[rows])
        mixed = [jnp.concatenate([o, a[rows]]) for o, a in zip(others, (x, index, weight), strict=True)]
        np.testing.assert_array_equal(np.asarray(run(*mixed))[T:], full[rows])


def _buffer(dtype, tiles=5, tile=16, k=128):
    x = jax.random.normal(jax.random.key(4), (tiles * tile, k)).astype(dtype)
    return x, jnp.array([0, 0, 3, 1, 3][:tiles], jnp.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_grouped_matmul_kernel_is_its_reference(dtype):
    """Each tile through its own expert, with and without the per-row and per-column scales; a tile's rows
    keep their bits whatever the other tiles hold or are routed to. Tiles of 16 rows, blocks of 16 of the
    48 columns, K = 128 in two steps of 64 (f32, bf16) or one of 128 (fp8)."""
    x, tile_expert = _buffer(jnp.dtype(dtype))
    w = (jax.random.normal(jax.random.key(5), (4, 48, 128)) * 0.1).astype(x.dtype)
    row_scale = jax.random.uniform(jax.random.key(6), (x.shape[0],)) + 0.5
    col_scale = jax.random.uniform(jax.random.key(7), (4, 48)) + 0.5
    tol = {"float32": 1e-6, "bfloat16": 1e-2, "float8_e4m3fn": 1e-5}[dtype]
    for scales in ((), (row_scale, col_scale)):
        got = grouped_matmul(x, tile_expert, w, *scales, interpret=True)
        want = grouped_matmul_reference(x, tile_expert, w, *scales)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    tile = x.shape[0] // 5
    others = jnp.roll(x, tile * 2, axis=0), jnp.array([2, 1, 0, 3, 3], jnp.int32)
    moved = grouped_matmul(others[0], others[1], w, interpret=True)
    alone = grouped_matmul(x, tile_expert, w, interpret=True)
    # x's tile 2 (expert 3) is tile 4 of the rolled buffer (expert 3 there too).
    np.testing.assert_array_equal(moved[4 * tile : 5 * tile], alone[2 * tile : 3 * tile])


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP8, Precision.INT8])
def test_grouped_linear_is_linear_per_tile(precision):
    """grouped_linear quantizes as linear does: each tile equals linear through its expert's weight."""
    x, tile_expert = _buffer(jnp.bfloat16)
    w = quantize(jax.random.normal(jax.random.key(5), (4, 48, 128)) * 0.1, precision)
    got = np.asarray(grouped_linear(x, tile_expert, w, jnp.float32, interpret=True))
    tile = x.shape[0] // 5
    for i, e in enumerate(np.asarray(tile_expert)):
        rows = slice(i * tile, (i + 1) * tile)
        want = linear(x[rows], jax.tree.map(lambda a, e=e: a[e], w), jnp.float32)
        np.testing.assert_allclose(got[rows], want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4-moe"])
def test_tiny_moe_models_read_the_same_through_the_kernel(family, monkeypatch):
    """The GPU path of a whole model (every expert GEMM one grouped kernel) against the loop over tiles:
    the same hidden states up to f32 summation order, with separate (Qwen) and fused (Gemma 4) weights."""
    batch = TreeBatch.sequence(np.random.default_rng(0).integers(5, 500, 40).tolist())
    loop = np.asarray(load_model(str(TINY / family), "fp32").hidden(batch))
    monkeypatch.setattr(Experts, "interpret", True)
    kernel = np.asarray(load_model(str(TINY / family), "fp32").hidden(batch))
    np.testing.assert_allclose(kernel, loop, rtol=1e-4, atol=1e-4)
