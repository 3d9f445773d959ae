"""Weight precisions and the one matmul every linear layer goes through.

Linear weights are stored [out, in], as Hugging Face stores them, so every projection is `x @ Wᵀ`
(contracting the last dim of both): the operand layout cuBLASLt's fp8 path wants without a transpose.

A quantized weight is data, not a different layer: `QuantArray(values, scale)` holds the low-precision
values and one f32 scale per output channel (per row). `linear` and `embed` dispatch on the weight's type.
"""

from dataclasses import dataclass
from enum import StrEnum
from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels.moe import grouped_matmul

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0


class Precision(StrEnum):
    FP32 = "fp32"  # weights and activations in f32: the parity reference precision
    BF16 = "bf16"
    FP8 = "fp8"  # e4m3 weights with per-channel scales, activations quantized per token (W8A8)
    INT8 = "int8"  # int8 weights with per-channel scales, bf16 activations (for GPUs without fp8)

    @property
    def activation_dtype(self):
        return jnp.float32 if self is Precision.FP32 else jnp.bfloat16


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantArray:
    values: jax.Array  # [out, in] float8_e4m3fn or int8 ([layers, out, in] for stacked layers)
    scale: jax.Array  # [out] ([layers, out]) float32: row r of the real weight is values[r] * scale[r]

    @property
    def shape(self):
        return self.values.shape

    def __getitem__(self, layer) -> "QuantArray":
        """One layer of a stacked weight ([layers, out, in] → [out, in]), as for a plain array."""
        return QuantArray(self.values[layer], self.scale[layer])


Weight = jax.Array | QuantArray


def quantize(w: jax.Array, precision: Precision) -> Weight:
    """Cast or quantize one [..., out, in] weight (or [vocab, hidden] embedding) to its stored form: one scale
    per output row."""
    if precision in (Precision.FP32, Precision.BF16):
        return w.astype(precision.activation_dtype)
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    if precision is Precision.FP8:
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        values = (w / scale[..., None]).astype(jnp.float8_e4m3fn)
    else:
        scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        values = jnp.clip(jnp.round(w / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantArray(values, scale)


def _quantize_rows_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token (per-row) dynamic fp8 scaling: each row's scale depends only on that row, which keeps
    a token's result independent of whatever else is in the batch."""
    with jax.named_scope("quantize"):
        x = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        return (x / scale).astype(jnp.float8_e4m3fn), scale


def matmul_precision(dtype):
    """f32 means f32: GPUs would otherwise run f32 matmuls as TF32 (10-bit mantissa), which is not the
    reference precision our fp32 parity promises."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def linear(x: jax.Array, w: Weight, out_dtype=None) -> jax.Array:
    """x [..., in] @ w[out, in]ᵀ → [..., out], in x's dtype unless out_dtype is given."""
    out_dtype = out_dtype or x.dtype
    with jax.named_scope("linear"):  # names the GEMM and its scaling in device profiles
        contract = (((x.ndim - 1,), (1,)), ((), ()))
        if not isinstance(w, QuantArray):
            y = jax.lax.dot_general(
                x, w, contract, precision=matmul_precision(x.dtype), preferred_element_type=jnp.float32
            )
            return y.astype(out_dtype)
        if w.values.dtype == jnp.float8_e4m3fn:
            xq, x_scale = _quantize_rows_fp8(x)
            # The GEMM writes the output's dtype where that is 16-bit (f32 for f32 outputs: the logits):
            # half the bytes of an f32 result for the scaling that follows to read. On an H100 the seed job
            # ran 7.5% faster than with f32 written (benchmarks/results, fp8 GEMM output, 2026-12-06).
            y = jax.lax.dot_general(
                xq, w.values, contract, preferred_element_type=jnp.promote_types(out_dtype, jnp.bfloat16)
            )
            return (y.astype(jnp.float32) * x_scale * w.scale).astype(out_dtype)
        y = jax.lax.dot_general(x, w.values.astype(x.dtype), contract, preferred_element_type=jnp.float32)
        return (y * w.scale).astype(out_dtype)


def stacked_outputs(*ws: Weight) -> Weight:
    """Weights [out_i, in] that one input goes through, as one [Σ out_i, in]: one GEMM instead of several,
    its output split after. Stack them outside a loop over row tiles: XLA merges such GEMMs itself, but
    inside the loop, where it copied Gemma 3 12B's q, k and v weights once per tile of 1,024 rows (4% of a
    pass's kernel time on an H100, benchmarks/results, 2026-12-06)."""
    if len(ws) == 1:
        return ws[0]
    if isinstance(ws[0], QuantArray):
        return QuantArray(jnp.concatenate([w.values for w in ws]), jnp.concatenate([w.scale for w in ws]))
    return jnp.concatenate(ws)


def grouped_linear(x: jax.Array, tile_expert: jax.Array, w: Weight, out_dtype=None, *, interpret=False):
    """`linear` for a buffer of tiles, each through its own expert: x [R, in] in tiles of R / tiles rows,
    tile i @ w[tile_expert[i]]ᵀ with w [experts, out, in] → [R, out]. One Pallas kernel (GPUs; `interpret`
    runs it on the CPU), with `linear`'s quantization: fp8 activations scaled per row, int8 weights met in
    x's dtype."""
    out_dtype = out_dtype or x.dtype
    gemm = partial(grouped_matmul, out_dtype=out_dtype, interpret=interpret)
    if not isinstance(w, QuantArray):
        return gemm(x, tile_expert, w)
    if w.values.dtype == jnp.float8_e4m3fn:
        xq, x_scale = _quantize_rows_fp8(x)
        return gemm(xq, tile_expert, w.values, x_scale[:, 0], w.scale)
    return gemm(x, tile_expert, w.values, None, w.scale)


def embed(ids: jax.Array, table: Weight, dtype) -> jax.Array:
    """Rows of an embedding table [vocab, hidden] for token ids [...] → [..., hidden]."""
    if not isinstance(table, QuantArray):
        return table[ids].astype(dtype)
    return (table.values[ids].astype(jnp.float32) * table.scale[ids][..., None]).astype(dtype)
