"""Mixture-of-experts feed-forward: every token through its top-k experts, batch-invariantly.

A token's output must be the same bits whatever else is in the pass, so no step may let other tokens change
how its numbers are added up:
- routing is row-local (the router's logits, softmax, top-k: spinf_jax.models.moe);
- `grouped` sorts the (token, expert) pairs by expert into a buffer of fixed size where every expert's rows
  start on a tile boundary, so every tile holds one expert's rows; a loop runs each tile through its expert
  ([tile, hidden] GEMMs of one shape, the same program for every tile), so a row's result depends on its
  own input and its expert's weights, never on which rows share its tile or how many tiles the pass has;
- the top-k outputs are summed in the order of the token's top-k, in f32, row by row.
Quantized experts (fp8) quantize each row's activations with its own scale (spinf_jax.quant.linear).

`dense` is the reference: every token through every expert, then the chosen ones' outputs weighted by the
routing. It does E/k times the work; the tests compare `grouped` with it.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.late_map import late_map

# expert(rows [N, hidden], e) → [N, hidden] f32: expert e's feed-forward of some rows (e an int or a traced
# scalar); the model's experts module says how its weights are laid out (spinf_jax.models.moe).


def dense(x, index, weight, expert, experts: int) -> jax.Array:
    """x [T, hidden]; the experts each token chose [T, k] and their weights [T, k] f32 → [T, hidden] f32."""
    outs = jnp.stack([expert(x, e) for e in range(experts)], axis=1)  # [T, E, hidden]
    return combine(jnp.take_along_axis(outs, index[..., None], axis=1), weight)


def grouped(x, index, weight, expert, experts: int, *, tile: int) -> jax.Array:
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
    out = late_map(lambda xs: expert(*xs), (buffer.reshape(tiles, tile, -1), tile_expert))
    return combine(out.reshape(tiles * tile, -1)[row].reshape(t, k, -1), weight)


def combine(outs, weight) -> jax.Array:
    """outs [T, k, hidden] f32, weight [T, k] → Σ_j weight_j · out_j, added in the order j = 0, 1, ..."""
    total = outs[:, 0] * weight[:, :1]
    for j in range(1, outs.shape[1]):
        total = total + outs[:, j] * weight[:, j : j + 1]
    return total
