"""Mixture-of-experts feed-forward: every token through its top-k experts, batch-invariantly.

A token's output must be the same bits whatever else is in the pass, so no step may let other tokens change
how its numbers are added up:
- routing is row-local (the router's logits, softmax, top-k: spinf_jax.models.moe);
- `grouped` sorts the (token, expert) pairs by expert into a buffer of fixed size where every expert's rows
  start on a tile boundary, so every tile holds one expert's rows; each tile then goes through its expert
  with [tile, hidden] GEMMs of one shape and one order of summation, so a row's result depends on its own
  input and its expert's weights, never on which rows share its tile or how many tiles the pass has;
- the top-k outputs are summed in the order of the token's top-k, in f32, row by row.
Quantized experts (fp8) quantize each row's activations with its own scale (spinf_jax.quant).

How the tiles go through their experts is the caller's `feed_forward`: `per_tile` runs a loop, a tile at a
time, through XLA's GEMMs (the CPU path and the reference); `grouped_matmul` is a Pallas kernel that runs
every tile of a GEMM in one launch (the GPU path: on the H200 the loop's ~2,200 iterations a layer at a
16,384-token pass kept the 26B-A4B shape at 3.4% of the fp8 peak).

`dense` is the reference: every token through every expert, then the chosen ones' outputs weighted by the
routing. It does E/k times the work; the tests compare `grouped` with it.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.late_map import late_map

# expert(rows [N, hidden], e) → [N, hidden] f32: expert e's feed-forward of some rows (e an int or a traced
# scalar); feed_forward(buffer [tiles · tile, hidden], tile_expert [tiles]) → [tiles · tile, hidden] f32:
# every tile of the buffer through its expert. The model's experts module says how its weights are laid out
# (spinf_jax.models.moe).


def dense(x, index, weight, expert, experts: int) -> jax.Array:
    """x [T, hidden]; the experts each token chose [T, k] and their weights [T, k] f32 → [T, hidden] f32."""
    outs = jnp.stack([expert(x, e) for e in range(experts)], axis=1)  # [T, E, hidden]
    return combine(jnp.take_along_axis(outs, index[..., None], axis=1), weight)


def grouped(x, index, weight, feed_forward, experts: int, *, tile: int) -> jax.Array:
    """`dense`'s result, each (token, expert) pair computed once, in tiles of `tile` rows of one expert."""
    t, k = index.shape
    pairs = t * k
    # Every expert's rows padded to whole tiles: at most pairs + experts · (tile - 1) rows.
    tiles = -(-(pairs + experts * (tile - 1)) // tile)
    chosen = index.reshape(-1)  # [pairs], token-major
    counts = jnp.bincount(chosen, length=experts)
    padded = -(-counts // tile) * tile
    starts = jnp.cumsum(padded) - padded  # each expert's first row in the buffer
    order = jnp.argsort(chosen, stable=True)  # pairs by expert, then by token and rank
    first_sorted = jnp.cumsum(counts) - counts  # where each expert's pairs begin in `order`
    rank = jnp.zeros(pairs, jnp.int32).at[order].set(jnp.arange(pairs) - first_sorted[chosen[order]])
    row = starts[chosen] + rank  # [pairs]: each pair's row in the buffer
    buffer = jnp.zeros((tiles * tile, x.shape[1]), x.dtype).at[row].set(jnp.repeat(x, k, axis=0))
    # Each tile's expert: the last expert starting at or before it (tiles past the end compute padding).
    tile_expert = jnp.searchsorted(starts, jnp.arange(tiles) * tile, side="right") - 1
    out = feed_forward(buffer, tile_expert.astype(jnp.int32))
    return combine(out[row].reshape(t, k, -1), weight)


def per_tile(expert):
    """A feed_forward that loops over the tiles, each through `expert` (XLA's GEMMs, a tile at a time)."""

    def feed_forward(buffer, tile_expert):
        tiles = tile_expert.shape[0]
        rows = buffer.reshape(tiles, buffer.shape[0] // tiles, -1)
        out = late_map(lambda xs: expert(*xs), (rows, tile_expert))
        return out.reshape(buffer.shape[0], -1)

    return feed_forward


def combine(outs, weight) -> jax.Array:
    """outs [T, k, hidden] f32, weight [T, k] → Σ_j weight_j · out_j, added in the order j = 0, 1, ..."""
    total = outs[:, 0] * weight[:, :1]
    for j in range(1, outs.shape[1]):
        total = total + outs[:, j] * weight[:, j : j + 1]
    return total


def grouped_matmul_reference(x, tile_expert, w, row_scale=None, col_scale=None, out_dtype=jnp.float32):
    """x [R, K] in tiles of R / tiles rows, tile i through w[tile_expert[i]] [N, K]: x_i @ w_eᵀ (f32), × each
    row's scale [R] and × the expert's column scales [E, N] where given → [R, N] out_dtype. Pure JAX."""
    tiles = tile_expert.shape[0]
    rows = x.reshape(tiles, x.shape[0] // tiles, -1)
    weights = w[tile_expert].astype(x.dtype)  # [tiles, N, K]: every tile's own copy (small shapes only)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.einsum("tmk,tnk->tmn", rows, weights, precision=precision, preferred_element_type=jnp.float32)
    y = y.reshape(x.shape[0], -1)
    if row_scale is not None:
        y = y * row_scale[:, None]
    if col_scale is not None:
        y = y * jnp.repeat(col_scale[tile_expert], rows.shape[1], axis=0)
    return y.astype(out_dtype)


def _largest_block(size: int, cap: int) -> int:
    """The largest power of two ≤ cap, and ≥ 16 (Triton's smallest dot), that divides size."""
    block = cap
    while size % block:
        block //= 2
        if block < 16:
            raise ValueError(f"a grouped GEMM needs dimensions divisible by 16, got {size}")
    return block


def _grouped_matmul_kernel(expert_ref, x_ref, w_ref, *refs, block_k: int, scaled: tuple[bool, bool]):
    """One (tile, column block): the tile's rows [tile, K] times its expert's [block_n, K] weights, over K in
    block_k steps in order, then the scales. A row's sums never depend on which tile it is in."""
    row_scale_ref = refs[0] if scaled[0] else None
    col_scale_ref = refs[scaled[0]] if scaled[1] else None
    o_ref = refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)
    tile, block_n = o_ref.shape
    e = expert_ref[i]
    cols = pl.ds(j * block_n, block_n)
    exact = x_ref.dtype == jnp.float32  # f32 means f32, not TF32

    def step(kb, acc):
        ks = pl.ds(kb * block_k, block_k)
        w = w_ref[e, cols, ks]  # [block_n, block_k]
        if w.dtype != x_ref.dtype:  # int8 weights meet bf16 activations as bf16
            w = w.astype(x_ref.dtype)
        return acc + plgpu.dot(x_ref[:, ks], w, trans_b=True, allow_tf32=False if exact else None)

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((tile, block_n), jnp.float32))
    if row_scale_ref is not None:
        acc = acc * row_scale_ref[pl.ds(i * tile, tile)][:, None]
    if col_scale_ref is not None:
        acc = acc * col_scale_ref[e, cols][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


@partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def grouped_matmul(
    x: jax.Array,  # [R, K]: tiles of R / tiles rows
    tile_expert: jax.Array,  # [tiles] int32
    w: jax.Array,  # [E, N, K]
    row_scale: jax.Array | None = None,  # [R] f32
    col_scale: jax.Array | None = None,  # [E, N] f32
    *,
    out_dtype=jnp.float32,
    interpret: bool = False,
) -> jax.Array:  # [R, N]
    """`grouped_matmul_reference` as a Pallas kernel (Triton backend): one launch for every tile, a program
    per (tile, block of output columns) reading its expert's weights where they are (no copies)."""
    r, k = x.shape
    experts, n, _ = w.shape
    tiles = tile_expert.shape[0]
    tile = r // tiles
    block_n = _largest_block(n, 128)
    block_k = _largest_block(k, 128 if x.dtype.itemsize == 1 else 64)
    scaled = (row_scale is not None, col_scale is not None)
    scales = [s for s in (row_scale, col_scale) if s is not None]
    return pl.pallas_call(
        partial(_grouped_matmul_kernel, block_k=block_k, scaled=scaled),
        out_shape=jax.ShapeDtypeStruct((r, n), out_dtype),
        grid=(tiles, n // block_n),
        in_specs=[
            pl.BlockSpec((tiles,), lambda i, j: (0,)),
            pl.BlockSpec((tile, k), lambda i, j: (i, 0)),
            pl.BlockSpec((experts, n, k), lambda i, j: (0, 0, 0)),
            *([pl.BlockSpec((r,), lambda i, j: (0,))] if scaled[0] else []),
            *([pl.BlockSpec((experts, n), lambda i, j: (0, 0))] if scaled[1] else []),
        ],
        out_specs=pl.BlockSpec((tile, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="grouped_matmul",
    )(tile_expert, x, w, *scales)
