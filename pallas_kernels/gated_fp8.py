"""A gated feed-forward's middle in fp8: activation(gate) · up, quantized row by row for the down projection.

With fp8 weights (spinf_jax.quant) the gate and up GEMMs write raw products [R, F] in 16 bits; each needs its
row's and its columns' scales, then the activation, the product, the row's amax and the division into fp8.
XLA makes two kernels of that: one reads both [R, F] products and writes the product h [R, F] besides the
amax; the next reads h back to divide and convert. At Gemma 3 12B's shape they were 9.3% of a served pass's
kernel time on an H100 (98 + 40 us per 2,048-row tile and layer; benchmarks/results, 2026-12-06). Here one
program holds a row's h in registers, a chunk at a time: both products are read once and only the fp8 row and
its scale are written.

`reference` is the same computation in plain JAX, op for op what `spinf_jax.quant.linear` computes for the
gate, the up and the down projection's input: the CPU runs it, and the tests compare the kernel with it. Each
row's result depends on that row alone, so both are batch-invariant.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blocks import largest_block

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
# A row goes through in chunks of at most this many columns: a chunk is one power-of-two block of a
# program's registers (Triton's loads and stores must be), and a row's chunks stay in registers until its
# amax is known.
CHUNK = 1024


def scale_rows(amax: jax.Array) -> jax.Array:
    """The fp8 scale of rows whose largest magnitude is amax (1 for an all-zero row)."""
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def reference(g, u, x_scale, g_scale, u_scale, *, activation):
    """g, u [R, F]: the raw gate and up GEMM outputs (16-bit) of the rows' fp8 inputs; x_scale [R, 1] their
    rows' scales; g_scale, u_scale [F] the weights' column scales → (h in fp8 [R, F], h's row scales [R, 1]
    f32) with h = activation(gate) · up in g's dtype, as `linear` computes and quantizes it."""
    dtype = g.dtype
    gate = (g.astype(jnp.float32) * x_scale * g_scale).astype(dtype)
    up = (u.astype(jnp.float32) * x_scale * u_scale).astype(dtype)
    h = (activation(gate) * up).astype(jnp.float32)
    scale = scale_rows(jnp.max(jnp.abs(h), axis=-1, keepdims=True))
    return (h / scale).astype(jnp.float8_e4m3fn), scale


def _kernel(x_scale_ref, g_ref, u_ref, g_scale_ref, u_scale_ref, h_ref, h_scale_ref, *, chunk, activation):
    """One block of rows [rows, F]: every chunk's h (rounded to the products' dtype, as the reference rounds
    it), the rows' amax over all of them, then each chunk divided into fp8."""
    dtype = g_ref.dtype
    x_scale = x_scale_ref[...][:, None]  # [rows, 1]
    hs, amax = [], jnp.zeros(x_scale.shape, jnp.float32)
    for c in range(g_ref.shape[1] // chunk):  # unrolled: the chunks stay in registers
        cols = pl.ds(c * chunk, chunk)
        gate = (g_ref[:, cols].astype(jnp.float32) * x_scale * g_scale_ref[cols][None, :]).astype(dtype)
        up = (u_ref[:, cols].astype(jnp.float32) * x_scale * u_scale_ref[cols][None, :]).astype(dtype)
        # The activation in f32, rounded back: Triton has no 16-bit tanh or exp.
        h = (activation(gate.astype(jnp.float32)).astype(dtype) * up).astype(dtype)
        amax = jnp.maximum(amax, jnp.max(jnp.abs(h.astype(jnp.float32)), axis=1, keepdims=True))
        hs.append(h)
    scale = scale_rows(amax)
    for c, h in enumerate(hs):
        h_ref[:, pl.ds(c * chunk, chunk)] = (h.astype(jnp.float32) / scale).astype(h_ref.dtype)
    h_scale_ref[...] = scale[:, 0]


@partial(jax.jit, static_argnames=("activation", "rows", "warps", "interpret"))
def kernel(g, u, x_scale, g_scale, u_scale, *, activation, rows=1, warps=4, interpret=False):
    """`reference` as one Pallas kernel (Triton backend): a program per `rows` rows, `warps` warps each."""
    r, f = g.shape
    chunk = largest_block(f, CHUNK)
    h, scale = pl.pallas_call(
        partial(_kernel, chunk=chunk, activation=activation),
        out_shape=(
            jax.ShapeDtypeStruct((r, f), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((r,), jnp.float32),
        ),
        grid=(r // rows,),
        in_specs=[
            pl.BlockSpec((rows,), lambda i: (i,)),
            pl.BlockSpec((rows, f), lambda i: (i, 0)),
            pl.BlockSpec((rows, f), lambda i: (i, 0)),
            pl.BlockSpec((f,), lambda i: (0,)),
            pl.BlockSpec((f,), lambda i: (0,)),
        ],
        out_specs=(pl.BlockSpec((rows, f), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,))),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="gated_fp8",
    )(x_scale[:, 0], g, u, g_scale, u_scale)
    return h, scale[:, None]
