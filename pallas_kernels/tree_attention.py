"""Tree attention over a packed pass.

`reference` is the pure-JAX definition every kernel here is tested against: dense scores with the tree
mask of `TreeBatch` (spinf_jax.models.layers), optional sliding window over tree positions, GQA.

`blockwise` (pure JAX, the CPU path) and `kernel` (Pallas, GPUs) compute it so that a row's bits depend on
its own content and question alone. A row sees the trunk of its tree (BOS + content) and the rows of its own
branch (its question's template and option trie) above it; nothing else. The two parts are read separately,
each in key blocks that start at a fixed place: the trunk in blocks counted from the tree's first row (trees
start on block boundaries), the branch in BRANCH_BLOCK-key blocks counted from the branch's first row. One
online softmax runs over the trunk blocks, then over the branch blocks. The keys a reduction adds up, and the
offsets they sit at, are then the same whatever else is in the pass: other contents, other questions of the
same content, their order. Blocks that hold none of a row's keys may be visited for the sake of other rows in
the same query block; for that row they add exact zeros and leave its state bit for bit as it was.

`reach` (optional, [T]) lets a row see keys after itself: row i sees keys j < reach[i] (i + 1 without it).
An image's soft tokens attend to each other both ways (Gemma 3), and they are all in the trunk.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.late_map import late_map

# Keys per step over a branch. Branches are short (a template of at most 256 tokens and its option trie) and
# several share a query tile, so small steps waste less than trunk-sized ones: on the H200, one seed-job
# pass's attention took 64 ms with 16-key steps, 69 with 32 and 78 with 64 (benchmarks/gpu_attention.py).
# 16 is also Triton's smallest dot. Part of the arithmetic: programs that should agree must share it.
BRANCH_BLOCK = 16


def matmul_precision(dtype):
    """f32 attention is f32 (GPUs would run it as TF32); the kernels here depend on nothing of spinf_jax."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def tree_mask(
    positions: jax.Array, span_end: jax.Array, window: int | None, reach: jax.Array | None = None
) -> jax.Array:
    """[T, T] bool: query i may attend to key j."""
    n = positions.shape[0]
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    visible = (j < _reach(reach, n)[:, None]) & (i < span_end[None, :])
    if window is not None:
        # Sliding layers see keys less than `window` positions back, counted along the tree path.
        visible &= positions[:, None] - positions[None, :] < window
    return visible


def reference(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D], H % K == 0
    v: jax.Array,  # [T, K, D]
    positions: jax.Array,  # [T]
    span_end: jax.Array,  # [T]
    *,
    scale: float,
    window: int | None = None,
    reach: jax.Array | None = None,  # [T]
) -> jax.Array:  # [T, H, D]
    t, h, d = q.shape
    groups = h // k.shape[1]
    qg = q.reshape(t, k.shape[1], groups, d)
    exact = matmul_precision(q.dtype)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, precision=exact, preferred_element_type=jnp.float32) * scale
    mask = tree_mask(positions, span_end, window, reach)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v, precision=exact, preferred_element_type=jnp.float32)
    return out.reshape(t, h, d).astype(q.dtype)


def _reach(reach: jax.Array | None, t: int) -> jax.Array:
    """[T]: the end of the keys each row may see (itself and those before it, where `reach` says nothing)."""
    return jnp.arange(1, t + 1, dtype=jnp.int32) if reach is None else reach


def trunk_last_block(trunk_end: jax.Array, block: int, reach: jax.Array | None = None) -> jax.Array:
    """[T // block]: the last key block a query block reads in its trunk part (the last its rows reach: its
    own block, or further where an image's rows see the rest of their image)."""
    n = trunk_end.shape[0] // block
    last = (jnp.max(trunk_end.reshape(n, block), axis=1) - 1) // block
    reached = (jnp.max(_reach(reach, trunk_end.shape[0]).reshape(n, block), axis=1) - 1) // block
    return jnp.minimum(last, reached)


def branch_lists(branch_start: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The branches that have rows in each query block: (first row of each branch [n, block], last row of it
    inside the block [n, block], how many [n]) for n = T // block, in row order, unused entries 0."""
    t = branch_start.shape[0]
    n = t // block
    rows = jnp.arange(t, dtype=jnp.int32)
    inside = branch_start <= rows
    col = rows % block
    following = jnp.concatenate([branch_start[1:], jnp.full((1,), -1, jnp.int32)])
    first = inside & ((col == 0) | (branch_start == rows))
    last = inside & ((col == block - 1) | (following != branch_start))

    def listed(flags, values):
        flags = flags.reshape(n, block)
        slot = jnp.where(flags, jnp.cumsum(flags, axis=1) - 1, block)  # `block`: out of range, dropped
        which = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, block))
        return jnp.zeros((n, block), jnp.int32).at[which, slot].set(values.reshape(n, block), mode="drop")

    return listed(first, branch_start), listed(last, rows), jnp.sum(first.reshape(n, block), axis=1)


def _online_softmax_step(state, s, values, dot):
    """Fold one key block into (m, denom, acc): s [..., rows, keys] masked scores (f32), values [keys, D].
    A row whose scores are all -inf keeps its state exactly (alpha = 1, adds 0)."""
    m, denom, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 there so no inf - inf appears.
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    denom = denom * alpha + jnp.sum(p, axis=-1)
    return m_new, denom, acc * alpha[..., None] + dot(p.astype(values.dtype), values)


def blockwise(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    positions: jax.Array,  # [T]
    span_end: jax.Array,  # [T]
    trunk_end: jax.Array,  # [T]: end of the row's trunk (i + 1 for padding)
    branch_start: jax.Array,  # [T]: first row of the row's branch (i + 1 for trunk rows and padding)
    tree_start_block: jax.Array,  # [T // block]: first key block of the tree each query block belongs to
    *,
    scale: float,
    window: int | None = None,
    block: int,
    reach: jax.Array | None = None,  # [T]
) -> jax.Array:  # [T, H, D]
    """Tree attention in plain JAX, one query block at a time: trunk key blocks from the tree's first block,
    then, for each branch with rows in the block, BRANCH_BLOCK-key blocks from the branch's first row (see
    the module docstring). This is the algorithm the GPU kernel implements."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    t, h, d = q.shape
    kv = k.shape[1]
    groups = h // kv
    nb = t // block
    qb = q.reshape(nb, block, kv, groups, d)
    kb = k.reshape(nb, block, kv, d)
    vb = v.reshape(nb, block, kv, d)
    # A branch block may run past the pass's end (its keys there are never visible); pad so that
    # dynamic_slice reads zeros there instead of moving the block back.
    k_pad = jnp.pad(k, ((0, BRANCH_BLOCK), (0, 0), (0, 0)))
    v_pad = jnp.pad(v, ((0, BRANCH_BLOCK), (0, 0), (0, 0)))
    offsets = jnp.arange(block, dtype=jnp.int32)
    branch_offsets = jnp.arange(BRANCH_BLOCK, dtype=jnp.int32)
    exact = matmul_precision(q.dtype)
    trunk_last = trunk_last_block(trunk_end, block, reach)
    reach = _reach(reach, t)
    first_rows, last_rows, counts = branch_lists(branch_start, block)

    def scores(q_block, keys):  # [block, K, G, D], [keys, K, D] → [K, G, block, keys] f32
        s = jnp.einsum("bkgd,ckd->kgbc", q_block, keys, precision=exact, preferred_element_type=jnp.float32)
        return s * scale

    def weighted(p, values):  # [K, G, block, keys], [keys, K, D] → [K, G, block, D] f32
        return jnp.einsum("kgbc,ckd->kgbd", p, values, precision=exact, preferred_element_type=jnp.float32)

    def query_block(i, q_block, first_rows, last_rows, count):
        # One query block at a time, with the same loop body whatever the pass size: the row bits then
        # depend only on the rows' own keys (vectorising over all query blocks let XLA's CPU code vary
        # with T).
        q_idx = i * block + offsets
        q_pos = positions[q_idx]

        def visible(k_idx, own):  # [block, keys]: the tree mask, restricted to one part
            ok = (k_idx[None, :] < reach[q_idx][:, None]) & (q_idx[:, None] < span_end[k_idx][None, :]) & own
            if window is not None:
                ok &= q_pos[:, None] - positions[k_idx][None, :] < window
            return ok[None, None]

        def trunk_step(key_block, state):
            k_idx = key_block * block + offsets
            own = k_idx[None, :] < trunk_end[q_idx][:, None]
            s = jnp.where(visible(k_idx, own), scores(q_block, kb[key_block]), -jnp.inf)
            return _online_softmax_step(state, s, vb[key_block], weighted)

        def branch(j, state):
            first = first_rows[j]
            own = (branch_start[q_idx] == first)[:, None]

            def step(r, state):
                start = first + r * BRANCH_BLOCK
                # Indices past the end are clamped by the gathers in `visible`; those keys come after every
                # query row, so the causal test hides them anyway.
                k_idx = start + branch_offsets
                keys = jax.lax.dynamic_slice_in_dim(k_pad, start, BRANCH_BLOCK)
                values = jax.lax.dynamic_slice_in_dim(v_pad, start, BRANCH_BLOCK)
                s = jnp.where(visible(k_idx, own), scores(q_block, keys), -jnp.inf)
                return _online_softmax_step(state, s, values, weighted)

            return jax.lax.fori_loop(0, (last_rows[j] - first) // BRANCH_BLOCK + 1, step, state)

        state = (
            jnp.full((kv, groups, block), -jnp.inf, jnp.float32),
            jnp.zeros((kv, groups, block), jnp.float32),
            jnp.zeros((kv, groups, block, d), jnp.float32),
        )
        state = jax.lax.fori_loop(tree_start_block[i], trunk_last[i] + 1, trunk_step, state)
        _, denom, acc = jax.lax.fori_loop(0, count, branch, state)
        out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # [kv, groups, block, d]
        return out.transpose(2, 0, 1, 3).reshape(block, h, d)

    out = late_map(
        lambda args: query_block(*args), (jnp.arange(nb, dtype=jnp.int32), qb, first_rows, last_rows, counts)
    )
    return out.reshape(t, h, d).astype(q.dtype)


def _kernel(
    start_ref,  # [n] first key tile of the query tile's tree
    trunk_last_ref,  # [n] last key tile of its trunk part
    count_ref,  # [n] branches with rows in the query tile
    first_ref,  # [n * tile] their first rows
    last_ref,  # [n * tile] their last rows inside the query tile
    pos_ref,
    end_ref,
    trunk_end_ref,
    branch_ref,
    reach_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    tile,
    branch_block,
    scale,
    window,
):
    """One query tile of one head: online softmax over its trunk's key tiles, then over each of its branches'
    `branch_block`-key blocks counted from the branch's first row (blockwise, on the GPU)."""
    i = pl.program_id(0)
    t = pos_ref.shape[0]
    q = q_ref[...]  # [tile, D]
    exact = q_ref.dtype == jnp.float32  # f32 means f32, not TF32
    rows = pl.ds(i * tile, tile)
    q_idx = i * tile + jnp.arange(tile, dtype=jnp.int32)
    q_pos = pos_ref[rows]
    q_trunk_end = trunk_end_ref[rows]
    q_branch = branch_ref[rows]
    q_reach = reach_ref[rows]

    def dot(p, values):
        return plgpu.dot(p, values, allow_tf32=not exact)

    def masked_scores(keys, k_idx, k_end, k_pos, own):
        s = plgpu.dot(q, keys, trans_b=True, allow_tf32=not exact) * scale  # [tile, keys] f32
        ok = (k_idx[None, :] < q_reach[:, None]) & (q_idx[:, None] < k_end[None, :]) & own
        if window is not None:
            ok &= q_pos[:, None] - k_pos[None, :] < window
        return jnp.where(ok, s, -jnp.inf)

    def trunk_step(kb, state):
        keys = pl.ds(kb * tile, tile)
        k_idx = kb * tile + jnp.arange(tile, dtype=jnp.int32)
        own = k_idx[None, :] < q_trunk_end[:, None]
        s = masked_scores(k_ref[keys, :], k_idx, end_ref[keys], pos_ref[keys], own)
        return _online_softmax_step(state, s, v_ref[keys, :], dot)

    def branch(j, state):
        first = first_ref[i * tile + j]
        own = (q_branch == first)[:, None]

        def step(r, state):
            keys = pl.ds(first + r * branch_block, branch_block)
            k_idx = first + r * branch_block + jnp.arange(branch_block, dtype=jnp.int32)
            ok = k_idx < t  # a block may run past the pass's end: load nothing there
            k_end = plgpu.load(end_ref.at[keys], mask=ok, other=0)  # span 0: invisible
            k_pos = plgpu.load(pos_ref.at[keys], mask=ok, other=0)
            key_rows = plgpu.load(k_ref.at[keys, :], mask=ok[:, None], other=0.0)
            values = plgpu.load(v_ref.at[keys, :], mask=ok[:, None], other=0.0)
            return _online_softmax_step(state, masked_scores(key_rows, k_idx, k_end, k_pos, own), values, dot)

        return jax.lax.fori_loop(0, (last_ref[i * tile + j] - first) // branch_block + 1, step, state)

    state = (
        jnp.full((tile,), -jnp.inf, jnp.float32),
        jnp.zeros((tile,), jnp.float32),
        jnp.zeros((tile, q.shape[-1]), jnp.float32),
    )
    state = jax.lax.fori_loop(start_ref[i], trunk_last_ref[i] + 1, trunk_step, state)
    _, denom, acc = jax.lax.fori_loop(0, count_ref[i], branch, state)
    o_ref[...] = (acc / jnp.where(denom == 0, 1.0, denom)[:, None]).astype(o_ref.dtype)


@partial(jax.jit, static_argnames=("scale", "window", "block", "tile", "branch_block", "interpret"))
def kernel(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    positions: jax.Array,  # [T]
    span_end: jax.Array,  # [T]
    trunk_end: jax.Array,  # [T]
    branch_start: jax.Array,  # [T]
    tree_start_block: jax.Array,  # [T // block]
    *,
    scale: float,
    window: int | None = None,
    block: int,
    tile: int | None = None,
    branch_block: int = BRANCH_BLOCK,
    interpret: bool = False,
    reach: jax.Array | None = None,  # [T]
) -> jax.Array:  # [T, H, D]
    """`blockwise` as a Pallas kernel (Triton backend): a program per (query tile, head) reads its trunk's
    key tiles and then its branches' key blocks, so tiles no query in it can see are skipped, and the order
    of each row's reduction is its own content's and question's whatever else shares the pass.

    Trees are aligned to `block`; the kernel works in tiles of `tile` ≤ block rows. By default 64 rows while
    a row of q is at most 512 bytes (bf16 head_dim 256), else 32: q, k, v tiles and the scores must fit the
    H200's 227 KiB of shared memory (f32 at head_dim 256 with 64-row tiles asked for 256 KiB)."""
    t, h, d = q.shape
    groups = h // k.shape[1]
    tile = min(tile or (64 if d * q.dtype.itemsize <= 512 else 32), block)
    per_block = block // tile
    n = t // tile
    start = jnp.repeat(tree_start_block * per_block, per_block)  # in tiles now
    first_rows, last_rows, counts = branch_lists(branch_start, tile)
    whole = lambda i, j: (0,)  # noqa: E731 - index maps are tiny lambdas by convention
    return pl.pallas_call(
        partial(_kernel, tile=tile, branch_block=branch_block, scale=scale, window=window),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(n, h),
        in_specs=[
            *[pl.BlockSpec((n,), whole)] * 3,
            *[pl.BlockSpec((n * tile,), whole)] * 2,
            *[pl.BlockSpec((t,), whole)] * 5,
            pl.BlockSpec((tile, None, d), lambda i, j: (i, j, 0)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j // groups, 0)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j // groups, 0)),
        ],
        out_specs=pl.BlockSpec((tile, None, d), lambda i, j: (i, j, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="tree_attention",
    )(
        start,
        trunk_last_block(trunk_end, tile, reach),
        counts,
        first_rows.reshape(-1),
        last_rows.reshape(-1),
        positions,
        span_end,
        trunk_end,
        branch_start,
        _reach(reach, t),
        q,
        k,
        v,
    )
