"""Tree attention over a packed pass.

`reference` is the pure-JAX definition every kernel here is tested against: dense scores with the tree
mask of `TreeBatch` (spinf_jax.models.layers), optional sliding window over tree positions, GQA.

`blockwise` (pure JAX, the CPU path) and `kernel` (Pallas, GPUs) compute it so that a row's bits depend on
its own content and question alone. A row sees the trunk of its tree (BOS + content) and the rows of its own
branch (its question's template and option trie) above it; nothing else. The two parts are read separately,
each in key blocks that start at a fixed place: the trunk in blocks counted from the tree's first row, the
branch in BRANCH_BLOCK-key blocks counted from the branch's first row. One online softmax runs over the trunk
blocks, then over the branch blocks. The keys a reduction adds up, and the offsets they sit at, are then the
same whatever else is in the pass: other contents, other questions of the same content, their order, where
the tree starts. A query block may hold rows of several trees (trees start on any row; the packer puts them
on 16-row boundaries) and of several branches: it reads each one's blocks in turn (`trunk_lists`,
`branch_lists`). Blocks that hold none of a row's keys, visited for the sake of other rows in the same query
block, add exact zeros for it and leave its state bit for bit as it was.

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


def _listed(flags: jax.Array, values: jax.Array, tile: int) -> jax.Array:
    """[n, tile]: `values` at the rows where `flags` is set, each query tile's in row order from column 0,
    the unused columns 0 (n = T // tile)."""
    n = flags.shape[0] // tile
    flags = flags.reshape(n, tile)
    slot = jnp.where(flags, jnp.cumsum(flags, axis=1) - 1, tile)  # `tile`: out of range, dropped
    which = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, tile))
    return jnp.zeros((n, tile), jnp.int32).at[which, slot].set(values.reshape(n, tile), mode="drop")


def trunk_lists(
    tree_start: jax.Array, trunk_end: jax.Array, tile: int, reach: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The trees that have rows in each query tile: (first row of each tree [n, tile], the last trunk key
    its rows there reach [n, tile], how many [n]) for n = T // tile, in row order, unused entries 0. A
    tree's rows reach its trunk up to themselves (an image's rows to their image's end), its branch rows
    the whole trunk."""
    t = tree_start.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tree_start[:-1]])
    first = (rows % tile == 0) | (tree_start != previous)
    # Each row's entry: the running count of first rows in its tile; the entry's last key is the most
    # any of its rows reaches.
    running = jnp.cumsum(first.reshape(-1, tile), axis=1)  # [n, tile]
    entry = (rows // tile) * tile + running.reshape(-1) - 1
    reached = jax.ops.segment_max(jnp.minimum(trunk_end, _reach(reach, t)) - 1, entry, num_segments=t)
    counts = running[:, -1]
    last = jnp.where(jnp.arange(tile)[None, :] < counts[:, None], reached.reshape(-1, tile), 0)
    return _listed(first, tree_start, tile), last, counts


def branch_lists(branch_start: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The branches that have rows in each query block: (first row of each branch [n, block], last row of it
    inside the block [n, block], how many [n]) for n = T // block, in row order, unused entries 0."""
    t = branch_start.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    inside = branch_start <= rows
    col = rows % block
    following = jnp.concatenate([branch_start[1:], jnp.full((1,), -1, jnp.int32)])
    first = inside & ((col == 0) | (branch_start == rows))
    last = inside & ((col == block - 1) | (following != branch_start))
    return (
        _listed(first, branch_start, block),
        _listed(last, rows, block),
        jnp.sum(first.reshape(-1, block), axis=1),
    )


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
    tree_start: jax.Array,  # [T]: first row of the row's tree
    *,
    scale: float,
    window: int | None = None,
    block: int,
    reach: jax.Array | None = None,  # [T]
) -> jax.Array:  # [T, H, D]
    """Tree attention in plain JAX, one query block at a time: for each tree with rows in the block,
    `block`-key blocks of its trunk from the tree's first row, then, for each branch with rows in the block,
    BRANCH_BLOCK-key blocks from the branch's first row (see the module docstring). This is the algorithm
    the GPU kernel implements."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    t, h, d = q.shape
    kv = k.shape[1]
    groups = h // kv
    nb = t // block
    qb = q.reshape(nb, block, kv, groups, d)
    # A key block may run past the pass's end (its keys there are never visible); pad so that dynamic_slice
    # reads zeros there instead of moving the block back.
    pad = ((0, max(block, BRANCH_BLOCK)), (0, 0), (0, 0))
    k_pad, v_pad = jnp.pad(k, pad), jnp.pad(v, pad)
    offsets = jnp.arange(block, dtype=jnp.int32)
    exact = matmul_precision(q.dtype)
    trunks = trunk_lists(tree_start, trunk_end, block, reach)
    branches = branch_lists(branch_start, block)
    reach = _reach(reach, t)

    def scores(q_block, keys):  # [block, K, G, D], [keys, K, D] → [K, G, block, keys] f32
        s = jnp.einsum("bkgd,ckd->kgbc", q_block, keys, precision=exact, preferred_element_type=jnp.float32)
        return s * scale

    def weighted(p, values):  # [K, G, block, keys], [keys, K, D] → [K, G, block, D] f32
        return jnp.einsum("kgbc,ckd->kgbd", p, values, precision=exact, preferred_element_type=jnp.float32)

    def query_block(
        i, q_block, trunk_first, trunk_last, trunk_count, branch_first, branch_last, branch_count
    ):
        # One query block at a time, with the same loop body whatever the pass size: the row bits then
        # depend only on the rows' own keys (vectorising over all query blocks let XLA's CPU code vary
        # with T).
        q_idx = i * block + offsets
        q_pos = positions[q_idx]

        def part(state, firsts, lasts, count, size, own):
            """One part's key blocks: for each of its entries, `size`-key blocks from the entry's first row
            through the one holding its last key. own(first, k_idx) [block, keys]: the part's test."""

            def entry(j, state):
                first = firsts[j]

                def step(r, state):
                    start = first + r * size
                    # Indices past the end are clamped by the gathers below; those keys come after every
                    # query row, so the causal test hides them anyway.
                    k_idx = start + jnp.arange(size, dtype=jnp.int32)
                    ok = (k_idx[None, :] < reach[q_idx][:, None]) & (
                        q_idx[:, None] < span_end[k_idx][None, :]
                    )
                    ok &= own(first, k_idx)
                    if window is not None:
                        ok &= q_pos[:, None] - positions[k_idx][None, :] < window
                    keys = jax.lax.dynamic_slice_in_dim(k_pad, start, size)
                    s = jnp.where(ok[None, None], scores(q_block, keys), -jnp.inf)
                    return _online_softmax_step(
                        state, s, jax.lax.dynamic_slice_in_dim(v_pad, start, size), weighted
                    )

                return jax.lax.fori_loop(0, (lasts[j] - first) // size + 1, step, state)

            return jax.lax.fori_loop(0, count, entry, state)

        state = (
            jnp.full((kv, groups, block), -jnp.inf, jnp.float32),
            jnp.zeros((kv, groups, block), jnp.float32),
            jnp.zeros((kv, groups, block, d), jnp.float32),
        )
        # A tree's trunk: its padding's runs may start among its keys (packer.tree_starts), hence the first
        # row's test.
        in_trunk = lambda first, k_idx: (  # noqa: E731
            (tree_start[q_idx] == first)[:, None] & (k_idx[None, :] < trunk_end[q_idx][:, None])
        )
        in_branch = lambda first, k_idx: (branch_start[q_idx] == first)[:, None]  # noqa: E731
        state = part(state, trunk_first, trunk_last, trunk_count, block, in_trunk)
        _, denom, acc = part(state, branch_first, branch_last, branch_count, BRANCH_BLOCK, in_branch)
        out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # [kv, groups, block, d]
        return out.transpose(2, 0, 1, 3).reshape(block, h, d)

    out = late_map(lambda args: query_block(*args), (jnp.arange(nb, dtype=jnp.int32), qb, *trunks, *branches))
    return out.reshape(t, h, d).astype(q.dtype)


def _kernel(
    trunk_count_ref,  # [n] trees with rows in the query tile
    trunk_first_ref,  # [n * tile] their first rows
    trunk_last_ref,  # [n * tile] the last trunk key their rows in the tile reach
    branch_count_ref,  # [n] branches with rows in the query tile
    branch_first_ref,  # [n * tile] their first rows
    branch_last_ref,  # [n * tile] their last rows inside the query tile
    pos_ref,
    end_ref,
    trunk_end_ref,
    branch_ref,
    tree_ref,
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
    """One query tile of one head: online softmax over its trees' trunks in `tile`-key blocks counted from
    each tree's first row, then over its branches in `branch_block`-key blocks counted from each branch's
    first row (blockwise, on the GPU)."""
    i = pl.program_id(0)
    t = pos_ref.shape[0]
    q = q_ref[...]  # [tile, D]
    exact = q_ref.dtype == jnp.float32  # f32 means f32, not TF32
    rows = pl.ds(i * tile, tile)
    q_idx = i * tile + jnp.arange(tile, dtype=jnp.int32)
    q_pos = pos_ref[rows]
    q_trunk_end = trunk_end_ref[rows]
    q_branch = branch_ref[rows]
    q_tree = tree_ref[rows]
    q_reach = reach_ref[rows]

    def dot(p, values):
        return plgpu.dot(p, values, allow_tf32=not exact)

    def part(state, count_ref, first_ref, last_ref, size, own):
        def entry(j, state):
            first = first_ref[i * tile + j]

            def step(r, state):
                keys = pl.ds(first + r * size, size)
                k_idx = first + r * size + jnp.arange(size, dtype=jnp.int32)
                ok = k_idx < t  # a block may run past the pass's end: load nothing there
                k_end = plgpu.load(end_ref.at[keys], mask=ok, other=0)  # span 0: invisible
                k_pos = plgpu.load(pos_ref.at[keys], mask=ok, other=0)
                key_rows = plgpu.load(k_ref.at[keys, :], mask=ok[:, None], other=0.0)
                values = plgpu.load(v_ref.at[keys, :], mask=ok[:, None], other=0.0)
                s = plgpu.dot(q, key_rows, trans_b=True, allow_tf32=not exact) * scale  # [tile, size] f32
                visible = (k_idx[None, :] < q_reach[:, None]) & (q_idx[:, None] < k_end[None, :])
                visible &= own(first, k_idx)
                if window is not None:
                    visible &= q_pos[:, None] - k_pos[None, :] < window
                return _online_softmax_step(state, jnp.where(visible, s, -jnp.inf), values, dot)

            return jax.lax.fori_loop(0, (last_ref[i * tile + j] - first) // size + 1, step, state)

        return jax.lax.fori_loop(0, count_ref[i], entry, state)

    state = (
        jnp.full((tile,), -jnp.inf, jnp.float32),
        jnp.zeros((tile,), jnp.float32),
        jnp.zeros((tile, q.shape[-1]), jnp.float32),
    )
    in_trunk = lambda first, k_idx: (q_tree == first)[:, None] & (k_idx[None, :] < q_trunk_end[:, None])  # noqa: E731
    in_branch = lambda first, k_idx: (q_branch == first)[:, None]  # noqa: E731
    state = part(state, trunk_count_ref, trunk_first_ref, trunk_last_ref, tile, in_trunk)
    _, denom, acc = part(state, branch_count_ref, branch_first_ref, branch_last_ref, branch_block, in_branch)
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
    tree_start: jax.Array,  # [T]
    *,
    scale: float,
    window: int | None = None,
    block: int,
    tile: int | None = None,
    branch_block: int = BRANCH_BLOCK,
    interpret: bool = False,
    reach: jax.Array | None = None,  # [T]
) -> jax.Array:  # [T, H, D]
    """`blockwise` as a Pallas kernel (Triton backend): a program per (query tile, head) reads its trees'
    trunk tiles and then its branches' key blocks, so tiles no query in it can see are skipped, and the order
    of each row's reduction is its own content's and question's whatever else shares the pass.

    The kernel works in tiles of `tile` rows (a divisor of `block`, which T is a multiple of); by default 64
    while a row of q is at most 512 bytes (bf16 head_dim 256), else 32: q, k, v tiles and the scores must
    fit the H200's 227 KiB of shared memory (f32 at head_dim 256 with 64-row tiles asked for 256 KiB)."""
    t, h, d = q.shape
    groups = h // k.shape[1]
    tile = min(tile or (64 if d * q.dtype.itemsize <= 512 else 32), block)
    n = t // tile
    trunk_first, trunk_last, trunk_count = trunk_lists(tree_start, trunk_end, tile, reach)
    branch_first, branch_last, branch_count = branch_lists(branch_start, tile)
    whole = lambda i, j: (0,)  # noqa: E731 - index maps are tiny lambdas by convention
    lists = [pl.BlockSpec((n,), whole), *[pl.BlockSpec((n * tile,), whole)] * 2]
    return pl.pallas_call(
        partial(_kernel, tile=tile, branch_block=branch_block, scale=scale, window=window),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(n, h),
        in_specs=[
            *lists,
            *lists,
            *[pl.BlockSpec((t,), whole)] * 6,
            pl.BlockSpec((tile, None, d), lambda i, j: (i, j, 0)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j // groups, 0)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j // groups, 0)),
        ],
        out_specs=pl.BlockSpec((tile, None, d), lambda i, j: (i, j, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="tree_attention",
    )(
        trunk_count,
        trunk_first.reshape(-1),
        trunk_last.reshape(-1),
        branch_count,
        branch_first.reshape(-1),
        branch_last.reshape(-1),
        positions,
        span_end,
        trunk_end,
        branch_start,
        tree_start,
        _reach(reach, t),
        q,
        k,
        v,
    )
