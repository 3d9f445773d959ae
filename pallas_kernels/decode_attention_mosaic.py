"""Decode attention as a Mosaic GPU kernel (Hopper: TMA copies into shared memory, wgmma on the tensor cores).

The algorithm is decode_attention's, as in its Triton kernel: a program per (group, kv head) reads its slot's
trunk in TILE-key tiles counted from the tree's first row, its template and then its rows' paths in
BRANCH_BLOCK-key blocks counted from their own starts, with one online softmax over them, and each row's
own new key last. The program's rows are the group's (hypothesis, query head) pairs, padded with zero rows
to TILE: wgmma multiplies 64 rows at a time. A row's bits so depend on its slot alone, never on the other
slots of the step or on how many there are.

A tree's first row must be a multiple of 8 (the packer's trees start on 16-row boundaries): trunk tiles are
copied into tiled shared memory, which starts only at whole 8-row units. Template blocks start at any row and
go through tree_attention_mosaic.copy_block. A row's own key joins as a block of the program's own TILE keys
under a diagonal mask: a product with exact zeros beside it, so it needs no code of its own.
bf16 and f16 only (wgmma has no f32), head_dim 128 or 256 (tree_attention_mosaic.supports), at most TILE
rows a group.

Measured on an H100 (benchmarks/gpu_decode_attention.py, decode steps of the GPU's sizes at Gemma 3 12B's
attention shape): 1.9-2.1x the Triton kernel's time with one trunk tile in flight, 2.0-2.5x with two, at the
first step (no path) as half way through the history. The engine keeps the Triton kernel. Both read the
same keys, so the gap is in how they are read: a group's 16 rows are padded to 64 here, and a program's
142 KiB of shared memory (206 KiB with two tiles) leaves one program per SM.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tree_attention_mosaic
from pallas_kernels.decode_attention import group_rows, path_seen, ungroup_rows
from pallas_kernels.tree_attention import BRANCH_BLOCK
from pallas_kernels.tree_attention_mosaic import (
    BRANCH_SWIZZLE,
    ROW,
    TILE,
    copy_block,
    initial_state,
    online_softmax_step,
    operand,
)

# A group's fields, a row of FIELDS int32 per group (8: a copy moves at least 16 bytes).
START, TRUNK_END, BRANCH, SLOT_END, POS, STEP = range(6)
FIELDS = 8


def _kernel(
    fields_ref,  # [G, FIELDS]
    seen_ref,  # [G, columns, TILE] int32: which history columns each row's path holds (window applied)
    q_ref,  # [G, K, TILE, D]: per group and kv head, the (hypothesis, query head) rows, zero-padded
    k_now_ref,  # [G, K, TILE, D]: each row's own key and value of this step
    v_now_ref,
    cache_k_ref,  # [T, K, D]: the pass's keys
    cache_v_ref,
    hist_k_ref,  # [G, columns, K, D]: the history, step-major
    hist_v_ref,
    o_ref,  # [G, K, TILE, D]
    fields_s,  # [FIELDS]
    q_s,  # [TILE, D]; the output on the way out
    k_s,  # [slots, TILE, D]: trunk tiles' keys, then (slot 0) the rows' own keys
    v_s,
    p_s,  # [TILE, TILE]
    bk_s,  # [BRANCH_BLOCK, D]: a template or path block
    bv_s,
    bp_s,  # [TILE, BRANCH_BLOCK]
    staged_s,  # [2, BRANCH_BLOCK, D] untiled (copy_block)
    seen_s,  # [BRANCH_BLOCK, TILE] int32: a path block's columns of seen_ref
    bar_q,  # 2: fields, q
    bar_k,  # slots each
    bar_v,
    bar_b,  # 3: a block's keys, values, seen columns
    *,
    width,
    slots,
    scale,
    window,
):
    g = lax.axis_index("group")
    kv = lax.axis_index("head")
    plgpu.copy_gmem_to_smem(fields_ref.at[g], fields_s, bar_q.at[0])
    plgpu.copy_gmem_to_smem(q_ref.at[g, kv], q_s, bar_q.at[1])
    for b in range(2):
        plgpu.barrier_wait(bar_q.at[b])
    start, trunk_end = fields_s[START], fields_s[TRUNK_END]
    branch, slot_end = fields_s[BRANCH], fields_s[SLOT_END]
    pos, step = fields_s[POS], fields_s[STEP]
    live = trunk_end > start
    trunk_len = trunk_end - start
    iota = partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)

    def scores(keys):  # [TILE, keys] f32: q·k scaled
        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_s, keys.T)
            return acc_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((TILE, keys.shape[0]), jnp.float32)) * scale

    tiles = jnp.where(live, (trunk_len + TILE - 1) // TILE, 0)

    def load_tile(b, slot):
        keys = pl.ds(pl.multiple_of(start + b * TILE, 8), TILE)  # tree starts are multiples of 8
        plgpu.copy_gmem_to_smem(cache_k_ref.at[keys, kv], k_s.at[slot], bar_k.at[slot])
        plgpu.copy_gmem_to_smem(cache_v_ref.at[keys, kv], v_s.at[slot], bar_v.at[slot])

    def tile_step(b, state):
        slot = lax.rem(b, jnp.array(slots, b.dtype))
        if slots > 1:  # the next tile's copy runs under this tile's arithmetic

            @pl.when(b + 1 < tiles)
            def _():
                load_tile(b + 1, lax.rem(b + 1, jnp.array(slots, b.dtype)))

        plgpu.barrier_wait(bar_k.at[slot])
        s = scores(k_s.at[slot])
        idx = start + b * TILE + iota(s.shape, 1)
        ok = idx < trunk_end
        if window is not None:
            ok &= pos - (idx - start) < window
        plgpu.barrier_wait(bar_v.at[slot])
        state = online_softmax_step(state, jnp.where(ok, s, -jnp.inf), v_s.at[slot], p_s)
        if slots == 1:  # the slot is free again only now

            @pl.when(b + 1 < tiles)
            def _():
                load_tile(b + 1, 0)

        return state

    def template_step(b, state):
        first = branch + b * BRANCH_BLOCK
        keys = pl.ds(first, BRANCH_BLOCK)
        copy_block(cache_k_ref.at[keys, kv], cache_v_ref.at[keys, kv], staged_s, bk_s, bv_s, bar_b)
        s = scores(bk_s)
        idx = first + iota(s.shape, 1)
        ok = idx < slot_end
        if window is not None:
            ok &= pos - (trunk_len + idx - branch) < window
        return online_softmax_step(state, jnp.where(ok, s, -jnp.inf), bv_s, bp_s)

    def path_step(b, state):
        columns = pl.ds(b * BRANCH_BLOCK, BRANCH_BLOCK)
        plgpu.copy_gmem_to_smem(seen_ref.at[g, columns], seen_s, bar_b.at[2])
        copy_block(hist_k_ref.at[g, columns, kv], hist_v_ref.at[g, columns, kv], staged_s, bk_s, bv_s, bar_b)
        s = scores(bk_s)
        plgpu.barrier_wait(bar_b.at[2])
        # seen_s holds a row of TILE per column: one row-layout load each, placed at its column.
        seen = jnp.zeros(s.shape, jnp.int32)
        column = iota(s.shape, 1)
        for c in range(BRANCH_BLOCK):
            row = lax.broadcast_in_dim(plgpu.load(seen_s.at[c], layout=ROW), s.shape, [0])
            seen = jnp.where(column == c, row, seen)
        return online_softmax_step(state, jnp.where(seen != 0, s, -jnp.inf), bv_s, bp_s)

    state = initial_state(q_s.shape[-1])

    @pl.when(tiles > 0)
    def _():
        load_tile(0, 0)

    state = lax.fori_loop(0, tiles, tile_step, state)
    template_blocks = jnp.where(live, (slot_end - branch + BRANCH_BLOCK - 1) // BRANCH_BLOCK, 0)
    state = lax.fori_loop(0, template_blocks, template_step, state)
    path_blocks = jnp.where(live, (step * width + BRANCH_BLOCK - 1) // BRANCH_BLOCK, 0)
    state = lax.fori_loop(0, path_blocks, path_step, state)
    # The rows' own keys: the program's own TILE keys, each row seeing its own only.
    plgpu.copy_gmem_to_smem(k_now_ref.at[g, kv], k_s.at[0], bar_k.at[0])
    plgpu.copy_gmem_to_smem(v_now_ref.at[g, kv], v_s.at[0], bar_v.at[0])
    plgpu.barrier_wait(bar_k.at[0])
    s = scores(k_s.at[0])
    own = iota(s.shape, 0) == iota(s.shape, 1)
    plgpu.barrier_wait(bar_v.at[0])
    _, denom, acc = online_softmax_step(state, jnp.where(own, s, -jnp.inf), v_s.at[0], p_s)
    q_s[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(q_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, o_ref.at[g, kv])
    plgpu.wait_smem_to_gmem(0)


def supports(dtype, head_dim: int, rows: int) -> bool:
    """Shapes this kernel runs: tree_attention_mosaic's dtypes and head sizes, and a group's (hypothesis,
    query head) rows within one TILE."""
    return tree_attention_mosaic.supports(dtype, head_dim) and rows <= TILE


@partial(jax.jit, static_argnames=("scale", "window", "block", "group_tile", "slots", "interpret"))
def kernel(
    q: jax.Array,  # [R, H, D], R = G * W
    k: jax.Array,  # [R, K, D]
    v: jax.Array,  # [R, K, D]
    cache_k: jax.Array,  # [T, K, D]
    cache_v: jax.Array,  # [T, K, D]
    hist_k: jax.Array,  # [G, S, W, K, D]: keys of earlier steps (columns ≥ step are not read)
    hist_v: jax.Array,  # [G, S, W, K, D]
    positions: jax.Array,  # [R]
    tree_start: jax.Array,  # [G]: rows of the pass, multiples of 8
    trunk_end: jax.Array,  # [G]
    branch_start: jax.Array,  # [G]
    slot_end: jax.Array,  # [G]
    path: jax.Array,  # [G, W, S]
    step: jax.Array,  # []
    *,
    scale: float,
    window: int | None,
    block: int,
    group_tile: int | None = None,
    slots: int = 1,
    interpret: bool = False,
) -> jax.Array:  # [R, H, D]
    """decode_attention.blockwise on Hopper's tensor cores (module docstring); `slots` trunk tiles are in
    flight at once (2: the next tile's copy runs under this one's arithmetic). `block` and `group_tile` are
    blockwise's (unused here)."""
    del block, group_tile
    _, h, d = q.shape
    g, s_max, w, kv = hist_k.shape[:4]
    groups = h // kv
    if not supports(q.dtype, d, w * groups):
        raise ValueError(f"Mosaic decode attention: {q.dtype} head_dim {d}, {w * groups} rows a group")
    by_group = partial(group_rows, width=w, kv=kv, groups=groups, rows=TILE)
    seen = path_seen(path, step, groups, TILE)  # [G, TILE, S * W]
    if window is not None:  # column s * W + j holds the key of step s
        seen &= (step - jnp.arange(s_max * w) // w < window)[None, None, :]
    # The path's blocks are read whole: the columns padded to whole blocks (the engine's already are).
    columns = -(-s_max * w // BRANCH_BLOCK) * BRANCH_BLOCK
    padding = ((0, 0), (0, columns - s_max * w), (0, 0), (0, 0))
    hist_k = jnp.pad(hist_k.reshape(g, s_max * w, kv, d), padding)
    hist_v = jnp.pad(hist_v.reshape(g, s_max * w, kv, d), padding)
    seen = jnp.pad(seen.transpose(0, 2, 1), padding[:3]).astype(jnp.int32)  # [G, columns, TILE]
    fields = jnp.stack(
        [tree_start, trunk_end, branch_start, slot_end, positions.reshape(g, w)[:, 0], jnp.full((g,), step)]
        + [jnp.zeros((g,), jnp.int32)] * (FIELDS - 6),
        axis=1,
    ).astype(jnp.int32)
    out = plgpu.kernel(
        partial(_kernel, width=w, slots=slots, scale=scale, window=window),
        out_type=jax.ShapeDtypeStruct((g, kv, TILE, d), q.dtype),
        grid=(g, kv),
        grid_names=("group", "head"),
        scratch_types=[
            plgpu.SMEM((FIELDS,), jnp.int32),
            operand(q.dtype, TILE, d),
            operand(q.dtype, slots, TILE, d),
            operand(q.dtype, slots, TILE, d),
            operand(q.dtype, TILE, TILE),
            operand(q.dtype, BRANCH_BLOCK, d),
            operand(q.dtype, BRANCH_BLOCK, d, swizzle=BRANCH_SWIZZLE),
            operand(q.dtype, TILE, BRANCH_BLOCK, swizzle=BRANCH_SWIZZLE),
            plgpu.SMEM((2, BRANCH_BLOCK, d), q.dtype),
            plgpu.SMEM((BRANCH_BLOCK, TILE), jnp.int32),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=3),
        ],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="decode_attention_mosaic",
    )(fields, seen, by_group(q), by_group(k), by_group(v), cache_k, cache_v, hist_k, hist_v)
    return ungroup_rows(out, width=w, heads=h)
