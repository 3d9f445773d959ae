"""Tree attention as a Mosaic GPU kernel (Hopper: TMA copies into shared memory, wgmma on the tensor cores).

The algorithm is tree_attention.blockwise's, as in the Triton kernel (tree_attention.kernel): a row reads the
trunk of its tree in key tiles counted from the tree's first row, then its own branch in BRANCH_BLOCK-key
blocks counted from the branch's first row, with one online softmax over both. A tree's first row must be a
multiple of 8 (the packer's trees start on 16-row boundaries): its trunk tiles are copied into tiled shared
memory, which starts only at whole 8-row units. The keys each reduction adds
up, and the offsets they sit at, are then the same whatever else is in the pass.

A program per (64-row query tile, head), one warpgroup. wgmma multiplies 64 rows at a time, so the query tile
and the trunk's key tile are 64 rows at every head size. The tile's plan (the trees and the branches with rows
in it) and the rows' tree fields travel through shared memory with the
keys; a key block that runs past the pass's end is filled with zeros by the copy (span 0: invisible).
bf16 and f16 only: wgmma has no f32 (its TF32 would not be f32 attention), which stays on the Triton kernel.

Measured on the H200 (benchmarks/gpu_attention.py, the seed job's 16,384-row pass at Gemma 3 12B's attention
shape): 63.2 ms a pass against the Triton kernel's 59.8 (one trunk tile in flight; two took 78.2); on an
H100, with trees on 16-row boundaries, 51.5 ms against 50.1 (two in flight: 64.1). The engine keeps the
Triton kernel. The branch blocks are the costly part: each is copied, moved through
registers into wgmma's layout and multiplied before the next is asked for.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.tree_attention import BRANCH_BLOCK, branch_lists, trunk_lists

TILE = 64  # query rows per program and keys per trunk step: wgmma's M
# The tile's plan, [5, TILE] int32 per tile: a head row (how many trees and how many branches have rows in
# the tile, then zeros), then rows of TILE entries each: the trees' first rows, the last trunk keys their rows
# in the tile reach, the branches' first rows, and their last rows in the tile. (Rows, not one long row: a
# copy moves at most 256 elements along a dimension.)
HEAD, TREE_FIRST, TREE_LAST, BRANCH_FIRST, BRANCH_LAST = range(5)
# The rows' tree fields, copied per key block beside the keys: [5, T] for tiles, [T, 4] (the first four) for
# branch blocks.
POS, END, TRUNK_END, BRANCH, TREE = range(5)
# A branch block starts at any row, and a copy into tiled shared memory only at a multiple of 8 rows: the
# block is copied untiled, then moved through registers into the tiled layouts wgmma reads. Its values are
# P·V's contraction side, whose length (BRANCH_BLOCK keys) wgmma takes in multiples of the swizzle's width:
# 32 bytes.
BRANCH_SWIZZLE = 32
ROW = plgpu.Layout.WGMMA.reduce(1)  # a value per query row of a [TILE, keys] wgmma result
COL = plgpu.Layout.WGMMA.reduce(0)  # a value per key


def plan(tree_start: jax.Array, trunk_end: jax.Array, branch_start: jax.Array) -> jax.Array:
    """[T // TILE, 5, TILE] int32: what each query tile reads (see HEAD)."""
    trees, tree_last, tree_count = trunk_lists(tree_start, trunk_end, TILE)
    branches, branch_last, branch_count = branch_lists(branch_start, TILE)
    head = jnp.zeros_like(trees).at[:, 0].set(tree_count).at[:, 1].set(branch_count)
    return jnp.stack([head, trees, tree_last, branches, branch_last], axis=1)


def initial_state(d: int):
    """The online softmax's state before any key, in wgmma's layouts: running max [TILE] (-inf), denominator
    [TILE] and accumulator [TILE, d] (zeros)."""
    return (
        plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), ROW),
        plgpu.layout_cast(jnp.full((TILE,), 0.0, jnp.float32), ROW),
        plgpu.layout_cast(jnp.full((TILE, d), 0.0, jnp.float32), plgpu.Layout.WGMMA),
    )


def online_softmax_step(state, s, values, p_s):
    """tree_attention's online-softmax step in wgmma's layouts: s [TILE, keys] f32 masked scores, values a
    [keys, D] shared-memory ref, p_s [TILE, keys] shared memory for P; P·V on the tensor cores. A row whose
    scores are all -inf keeps its state exactly (alpha = 1, adds 0)."""
    m, denom, acc = state
    m_new = jnp.maximum(m, s.max(axis=1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - lax.broadcast_in_dim(shift, s.shape, [0]))
    alpha = jnp.exp(m - shift)
    denom = denom * alpha + p.sum(axis=1)

    # P goes to the tensor cores through shared memory (the interpreter's wgmma reads operands only there).
    p_s[...] = p.astype(p_s.dtype)
    plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_s, values)
        return acc_ref[...]

    pv = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    return m_new, denom, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv


def copy_block(keys, values, staged_s, bk_s, bv_s, bars):
    """A BRANCH_BLOCK-key block that starts at any row ([BRANCH_BLOCK, D] slices of gmem) into wgmma's tiled
    layouts bk_s and bv_s, through staged_s [2, BRANCH_BLOCK, D] untiled (see BRANCH_SWIZZLE); bars 0 and 1
    are the copies'."""
    plgpu.copy_gmem_to_smem(keys, staged_s.at[0], bars.at[0])
    plgpu.copy_gmem_to_smem(values, staged_s.at[1], bars.at[1])
    for b, (dst, swizzle) in enumerate(((bk_s, 128), (bv_s, BRANCH_SWIZZLE))):
        plgpu.barrier_wait(bars.at[b])
        layout = plgpu.Layout.SMEM_GMEM_COPY(staged_s.shape[1:], dst.dtype, swizzle)
        dst[...] = plgpu.load(staged_s.at[b], layout=layout, optimized=False)
    plgpu.commit_smem()  # the tensor cores read what the threads wrote


def operand(dtype, *shape, swizzle=128):
    """Shared memory that wgmma reads: tiled in 8-row units and swizzled."""
    tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _kernel(
    plan_ref,  # [n, 5, TILE]
    rows_ref,  # [5, T]: positions, span_end, trunk_end, branch_start, tree_start
    fields_ref,  # [T, 4]: the same, a row's four together (for branch blocks, which start at any row)
    q_ref,  # [T, H, D]
    k_ref,  # [T, K, D]
    v_ref,  # [T, K, D]
    o_ref,  # [T, H, D]
    plan_s,
    q_rows_s,  # [5, TILE]
    q_s,  # [TILE, D]; the output on the way out
    k_s,  # [slots, TILE, D]
    v_s,
    k_rows_s,  # [slots, 5, TILE]
    bk_s,  # [BRANCH_BLOCK, D]
    bv_s,
    p_s,  # [TILE, TILE]: a trunk step's probabilities
    bp_s,  # [TILE, BRANCH_BLOCK]: a branch step's
    staged_s,  # [2, BRANCH_BLOCK, D] untiled: a branch block's keys and values as copied (see BRANCH_SWIZZLE)
    b_rows_s,  # [BRANCH_BLOCK, 4]
    bar_q,  # 3: plan, q rows, q
    bar_k,  # slots each
    bar_v,
    bar_rows,
    bar_b,  # 3: branch keys, values, rows
    *,
    groups,
    slots,
    scale,
    window,
):
    i = lax.axis_index("tile")
    head = lax.axis_index("head")
    kv = lax.div(head, jnp.array(groups, head.dtype))
    rows = pl.ds(i * TILE, TILE)
    plgpu.copy_gmem_to_smem(plan_ref.at[i], plan_s, bar_q.at[0])
    plgpu.copy_gmem_to_smem(rows_ref.at[:, rows], q_rows_s, bar_q.at[1])
    plgpu.copy_gmem_to_smem(q_ref.at[rows, head], q_s, bar_q.at[2])
    for b in range(3):
        plgpu.barrier_wait(bar_q.at[b])

    def q_field(f, shape):  # a query-row field broadcast over [TILE, keys]
        return lax.broadcast_in_dim(plgpu.load(q_rows_s.at[f], layout=ROW), shape, [0])

    iota = partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)

    def masked_scores(keys, k_field, first_key, own):
        """[TILE, keys] f32: q·k scaled, -inf where the tree mask or `own` (the part's test) hides the key.
        k_field(f): the keys' field f, [TILE, keys]."""

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_s, keys.T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((TILE, keys.shape[0]), jnp.float32)) * scale
        q_idx = i * TILE + iota(s.shape, 0)
        k_idx = first_key + iota(s.shape, 1)
        ok = (k_idx <= q_idx) & (q_idx < k_field(END)) & own(k_idx)
        if window is not None:
            ok &= q_field(POS, s.shape) - k_field(POS) < window
        return jnp.where(ok, s, -jnp.inf)

    def tile_field(key_rows):  # a trunk tile's fields, [5, TILE] in shared memory
        return lambda f: lax.broadcast_in_dim(plgpu.load(key_rows.at[f], layout=COL), (TILE, TILE), [1])

    def block_field(f):
        """A branch block's field f from b_rows_s [BRANCH_BLOCK, 4], one key at a time: its row is at any
        offset, and reading a vector there (for the copy or the load) is misaligned on the H200."""
        out = jnp.zeros((TILE, BRANCH_BLOCK), jnp.int32)
        column = iota(out.shape, 1)
        for c in range(BRANCH_BLOCK):
            out = jnp.where(column == c, b_rows_s[c, f], out)
        return out

    def load_trunk(first_key, slot):
        # Tree starts are multiples of 8 (module docstring); the compiler must be told so to copy into the
        # tiled layout (it cannot see through the plan's values).
        keys = pl.ds(pl.multiple_of(first_key, 8), TILE)
        plgpu.copy_gmem_to_smem(k_ref.at[keys, kv], k_s.at[slot], bar_k.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys, kv], v_s.at[slot], bar_v.at[slot])
        plgpu.copy_gmem_to_smem(rows_ref.at[:, keys], k_rows_s.at[slot], bar_rows.at[slot])

    trees = plan_s[HEAD, 0]

    def tiles_of(e):  # the trunk tiles tree e reads for this query tile
        return (plan_s[TREE_LAST, e] - plan_s[TREE_FIRST, e]) // TILE + 1

    def tree(e, carry):
        def trunk_step(r, carry):
            state, n = carry  # n: trunk tiles read so far, which picks the slot
            first_key = plan_s[TREE_FIRST, e] + r * TILE
            slot = lax.rem(n, jnp.array(slots, n.dtype))
            following = lax.rem(n + 1, jnp.array(slots, n.dtype))
            # The next tile: this tree's next, or the next tree's first.
            same_tree = r + 1 < tiles_of(e)
            # The next tree's first row (read within the row; used only where there is one).
            following_tree = plan_s[TREE_FIRST, jnp.minimum(e + 1, TILE - 1)]
            next_key = jnp.where(same_tree, first_key + TILE, following_tree)
            more = same_tree | (e + 1 < trees)
            if slots > 1:  # the next tile's copy runs under this tile's arithmetic

                @pl.when(more)
                def _():
                    load_trunk(next_key, following)

            plgpu.barrier_wait(bar_k.at[slot])
            plgpu.barrier_wait(bar_rows.at[slot])
            trunk_end = q_field(TRUNK_END, (TILE, TILE))
            own_rows = q_field(TREE, (TILE, TILE)) == plan_s[TREE_FIRST, e]  # padding may share keys
            s = masked_scores(
                k_s.at[slot],
                tile_field(k_rows_s.at[slot]),
                first_key,
                lambda k_idx: own_rows & (k_idx < trunk_end),
            )
            plgpu.barrier_wait(bar_v.at[slot])
            state = online_softmax_step(state, s, v_s.at[slot], p_s)
            if slots == 1:  # the slot is free again only now

                @pl.when(more)
                def _():
                    load_trunk(next_key, following)

            return state, n + 1

        return lax.fori_loop(0, tiles_of(e), trunk_step, carry)

    def branch(j, state):
        first = plan_s[BRANCH_FIRST, j]
        own_rows = q_field(BRANCH, (TILE, BRANCH_BLOCK)) == first

        def step(r, state):
            keys = pl.ds(first + r * BRANCH_BLOCK, BRANCH_BLOCK)
            plgpu.copy_gmem_to_smem(fields_ref.at[keys], b_rows_s, bar_b.at[2])
            copy_block(k_ref.at[keys, kv], v_ref.at[keys, kv], staged_s, bk_s, bv_s, bar_b)
            plgpu.barrier_wait(bar_b.at[2])
            s = masked_scores(bk_s, block_field, first + r * BRANCH_BLOCK, lambda k_idx: own_rows)
            return online_softmax_step(state, s, bv_s, bp_s)

        return lax.fori_loop(0, (plan_s[BRANCH_LAST, j] - first) // BRANCH_BLOCK + 1, step, state)

    state = initial_state(q_s.shape[-1])

    @pl.when(trees > 0)
    def _():
        load_trunk(plan_s[TREE_FIRST, 0], 0)

    state, _ = lax.fori_loop(0, trees, tree, (state, jnp.int32(0)))
    _, denom, acc = lax.fori_loop(0, plan_s[HEAD, 1], branch, state)
    denom = jnp.where(denom == 0, 1.0, denom)
    q_s[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(q_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, o_ref.at[rows, head])
    plgpu.wait_smem_to_gmem(0)


def supports(dtype, head_dim: int) -> bool:
    """Shapes this kernel runs: 16-bit floats, head_dim 128 or 256. copy_block's register layout needs a
    multiple of four 8 × 64 tiles in a [BRANCH_BLOCK, D] block (64 and 192 fail to compile: "Number of tiles
    is not a multiple of 4"), and the f32 accumulator of a 64-row tile at head_dim 512 would not fit one
    warpgroup's registers."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return sixteen_bit and head_dim in (128, 256)


@partial(jax.jit, static_argnames=("scale", "window", "block", "slots", "interpret"))
def kernel(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    positions: jax.Array,  # [T]
    span_end: jax.Array,  # [T]
    trunk_end: jax.Array,  # [T]
    branch_start: jax.Array,  # [T]
    tree_start: jax.Array,  # [T]: multiples of 8
    *,
    scale: float,
    window: int | None = None,
    block: int,
    slots: int = 1,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]
    """tree_attention.blockwise on Hopper's tensor cores (module docstring). `block` is a multiple of TILE;
    `slots` trunk tiles are in flight at once (2: the next tile's copy overlaps this one's arithmetic; 1
    measured faster on the H200, see the module docstring)."""
    t, h, d = q.shape
    if not supports(q.dtype, d) or block % TILE or t % TILE:
        raise ValueError(f"Mosaic tree attention: {q.dtype} head_dim {d}, block {block}, {t} rows")
    tiles = plan(tree_start, trunk_end, branch_start)
    rows = jnp.stack([positions, span_end, trunk_end, branch_start, tree_start]).astype(jnp.int32)

    return plgpu.kernel(
        partial(_kernel, groups=h // k.shape[1], slots=slots, scale=scale, window=window),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(t // TILE, h),
        grid_names=("tile", "head"),
        scratch_types=[
            plgpu.SMEM(tiles.shape[1:], jnp.int32),
            plgpu.SMEM((5, TILE), jnp.int32),
            operand(q.dtype, TILE, d),
            operand(q.dtype, slots, TILE, d),
            operand(q.dtype, slots, TILE, d),
            plgpu.SMEM((slots, 5, TILE), jnp.int32),
            operand(q.dtype, BRANCH_BLOCK, d),
            operand(q.dtype, BRANCH_BLOCK, d, swizzle=BRANCH_SWIZZLE),
            operand(q.dtype, TILE, TILE),
            operand(q.dtype, TILE, BRANCH_BLOCK, swizzle=BRANCH_SWIZZLE),
            plgpu.SMEM((2, BRANCH_BLOCK, d), q.dtype),
            plgpu.SMEM((BRANCH_BLOCK, 4), jnp.int32),
            plgpu.Barrier(num_barriers=3),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=slots),
            plgpu.Barrier(num_barriers=3),
        ],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="tree_attention_mosaic",
    )(tiles, rows, rows[:4].T, q, k, v)
