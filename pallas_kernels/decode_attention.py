"""Attention for decode steps: new rows that continue extraction slots of an earlier tree pass.

A decode step feeds one token per beam hypothesis. Rows come in groups, one group per slot and one row per
hypothesis ([G groups × W rows]). A row attends to three parts, one online softmax over them in this order:

1. the trunk of its slot's tree (BOS + content), from the pass's keys, in `block`-key blocks counted from
   the tree's first row: the blocks the pass itself reads the trunk in;
2. its slot's template (the branch up to the slot), from the pass's keys, in BRANCH_BLOCK-key blocks counted
   from the branch's first row;
3. its own path of decoded tokens, itself included, from the decode history, in BRANCH_BLOCK-step blocks
   counted from the first decoded token.

Every part is read in blocks at fixed offsets from its own start, and a block that holds none of a row's keys
leaves its state bit for bit as it was (tree_attention's rule). Groups run `group_tile` at a time through one
loop body. So a row's bits depend on its content, its question and its own path alone, never on the other
slots of the step or on how many there are.

The history is step-major ([G, S, W, ...]): step s writes the W rows' keys at column s. A hypothesis's
ancestors sit in other columns (beam search reorders hypotheses), so `path[g, w, s]` names the row whose key
row w reads at step s; reading through it costs a gather instead of reordering the whole history each step.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.late_map import late_map
from pallas_kernels.tree_attention import BRANCH_BLOCK, _online_softmax_step, matmul_precision


def blockwise(
    q: jax.Array,  # [R, H, D], R = G * W
    k: jax.Array,  # [R, K, D]: this step's keys (the caller writes them into the history at `step`)
    v: jax.Array,  # [R, K, D]
    cache_k: jax.Array,  # [T, K, D]: the pass's keys
    cache_v: jax.Array,  # [T, K, D]
    hist_k: jax.Array,  # [G, S, W, K, D]: keys of earlier steps (columns ≥ step are not read)
    hist_v: jax.Array,  # [G, S, W, K, D]
    positions: jax.Array,  # [R]
    tree_start: jax.Array,  # [G]: rows of the pass
    trunk_end: jax.Array,  # [G]
    branch_start: jax.Array,  # [G]
    slot_end: jax.Array,  # [G]: the slot row + 1
    path: jax.Array,  # [G, W, S]
    step: jax.Array,  # []: this step's column
    *,
    scale: float,
    window: int | None,
    block: int,
    group_tile: int,
) -> jax.Array:  # [R, H, D]
    r, h, d = q.shape
    g, s_max, w, kv = hist_k.shape[:4]
    groups = h // kv
    tiles = g // group_tile
    exact = matmul_precision(q.dtype)
    last_row = cache_k.shape[0] - 1
    steps = jnp.arange(BRANCH_BLOCK, dtype=jnp.int32)

    def scores(q_tile, keys):  # [t, W, K, G, D], [t, C, K, D] → [t, K, G, W, C] f32
        s = jnp.einsum("twkgd,tckd->tkgwc", q_tile, keys, precision=exact, preferred_element_type=jnp.float32)
        return s * scale

    def weighted(p, values):  # [t, K, G, W, C], [t, C, K, D] → [t, K, G, W, D] f32
        return jnp.einsum("tkgwc,tckd->tkgwd", p, values, precision=exact, preferred_element_type=jnp.float32)

    def tile(args):
        q_tile, k_now, v_now, pos, start, t_end, b_start, s_end, path, hk, hv = args
        q_tile = q_tile.reshape(group_tile, w, kv, groups, d)
        trunk_len = t_end - start

        def visible(ok, key_pos):  # ok [t, C], key_pos [t, C] → [t, 1, 1, W, C]
            ok = jnp.broadcast_to(ok[:, None, :], (group_tile, w, ok.shape[-1]))
            if window is not None:
                ok &= pos[:, :, None] - key_pos[:, None, :] < window
            return ok[:, None, None]

        def pass_step(first, end, size, key_pos):
            def step_fn(b, state):
                idx = first[:, None] + b * size + jnp.arange(size, dtype=jnp.int32)[None, :]  # [t, C]
                rows = jnp.minimum(idx, last_row)
                s = jnp.where(
                    visible(idx < end[:, None], key_pos(idx)), scores(q_tile, cache_k[rows]), -jnp.inf
                )
                return _online_softmax_step(state, s, cache_v[rows], weighted)

            return step_fn

        def path_step(b, state):
            cols = b * BRANCH_BLOCK + steps  # [C]
            at = jnp.minimum(cols, s_max - 1)
            which = path[:, :, at]  # [t, W, C]
            tiles_idx = jnp.arange(group_tile)[:, None, None]
            now = (cols == step)[None, None, :, None, None]  # this step's own key is not in the history yet
            keys = jnp.where(now, k_now[:, :, None], hk[tiles_idx, at[None, None, :], which])
            values = jnp.where(now, v_now[:, :, None], hv[tiles_idx, at[None, None, :], which])
            s = jnp.einsum(
                "twkgd,twckd->tkgwc", q_tile, keys, precision=exact, preferred_element_type=jnp.float32
            )
            ok = jnp.broadcast_to(cols[None, None, :] <= step, (group_tile, w, BRANCH_BLOCK))
            if window is not None:
                ok &= (step - cols)[None, None, :] < window
            s = jnp.where(ok[:, None, None], s * scale, -jnp.inf)
            dot = lambda p, vals: jnp.einsum(  # noqa: E731
                "tkgwc,twckd->tkgwd", p, vals, precision=exact, preferred_element_type=jnp.float32
            )
            return _online_softmax_step(state, s, values, dot)

        state = (
            jnp.full((group_tile, kv, groups, w), -jnp.inf, jnp.float32),
            jnp.zeros((group_tile, kv, groups, w), jnp.float32),
            jnp.zeros((group_tile, kv, groups, w, d), jnp.float32),
        )
        trunk_blocks = jnp.max(-(-trunk_len // block))
        trunk = pass_step(start, t_end, block, lambda idx: idx - start[:, None])
        state = jax.lax.fori_loop(0, trunk_blocks, trunk, state)
        template_blocks = jnp.max(-(-(s_end - b_start) // BRANCH_BLOCK))
        template = pass_step(
            b_start, s_end, BRANCH_BLOCK, lambda idx: trunk_len[:, None] + idx - b_start[:, None]
        )
        state = jax.lax.fori_loop(0, template_blocks, template, state)
        _, denom, acc = jax.lax.fori_loop(0, step // BRANCH_BLOCK + 1, path_step, state)
        out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # [t, K, G, W, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(group_tile * w, h, d)

    def by_tile(x):
        return x.reshape(tiles, group_tile, *x.shape[1:])

    out = late_map(
        tile,
        (
            q.reshape(tiles, group_tile * w, h, d),
            k.reshape(tiles, group_tile, w, kv, d),
            v.reshape(tiles, group_tile, w, kv, d),
            positions.reshape(tiles, group_tile, w),
            *map(by_tile, (tree_start, trunk_end, branch_start, slot_end, path, hist_k, hist_v)),
        ),
    )
    return out.reshape(r, h, d).astype(q.dtype)
