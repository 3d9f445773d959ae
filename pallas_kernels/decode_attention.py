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

`reference` is the dense definition; `blockwise` computes it in plain JAX (the CPU path), `kernel` in Pallas
(GPUs, Triton backend); tests compare both with it. decode_attention_mosaic has the kernel on the Mosaic GPU
backend, measured slower (its docstring).
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.late_map import late_map
from pallas_kernels.tree_attention import BRANCH_BLOCK, _online_softmax_step, matmul_precision


def reference(
    q: jax.Array,  # [R, H, D], R = G * W
    k: jax.Array,  # [R, K, D]
    v: jax.Array,  # [R, K, D]
    cache_k: jax.Array,  # [T, K, D]
    cache_v: jax.Array,  # [T, K, D]
    hist_k: jax.Array,  # [G, S, W, K, D]
    hist_v: jax.Array,  # [G, S, W, K, D]
    positions: jax.Array,  # [R]
    tree_start: jax.Array,  # [G]
    trunk_end: jax.Array,  # [G]
    branch_start: jax.Array,  # [G]
    slot_end: jax.Array,  # [G]
    path: jax.Array,  # [G, W, S]
    step: jax.Array,  # []
    *,
    scale: float,
    window: int | None,
) -> jax.Array:  # [R, H, D]
    """The definition, densely: every row against all the pass's keys, all history rows and all of this
    step's keys at once, under a mask that admits its trunk, its template, its path and its own key."""
    r, h, d = q.shape
    g, s_max, w, kv = hist_k.shape[:4]
    t = cache_k.shape[0]
    group = jnp.arange(r) // w
    hyp = jnp.arange(r) % w
    rows = jnp.arange(t)[None, :]
    start, t_end = tree_start[group][:, None], trunk_end[group][:, None]
    b_start, s_end = branch_start[group][:, None], slot_end[group][:, None]
    trunk = (start <= rows) & (rows < t_end)
    template = (b_start <= rows) & (rows < s_end)
    pass_pos = jnp.where(trunk, rows - start, t_end - start + rows - b_start)
    # History row (g', s, j) is on row i's path when g' is its group, s < step and path[g, w, s] == j.
    on_path = path[group, hyp][:, :, None] == jnp.arange(w)  # [R, S, W]
    before = (jnp.arange(s_max) < step)[None, :, None]
    hist_seen = (group[:, None] == jnp.arange(g)[None, :])[:, :, None, None] & (on_path & before)[:, None]
    hist_pos = positions[:, None, None] - step + jnp.arange(s_max)[None, :, None]
    seen = jnp.concatenate(
        [trunk | template, hist_seen.reshape(r, -1), jnp.eye(r, dtype=bool)], axis=1
    )  # [R, T + G*S*W + R]
    key_pos = jnp.concatenate(
        [pass_pos, jnp.broadcast_to(hist_pos[:, None], (r, g, s_max, w)).reshape(r, -1), positions[:, None]
         + jnp.zeros((1, r), jnp.int32)], axis=1
    )  # fmt: skip
    if window is not None:
        seen &= positions[:, None] - key_pos < window
    keys = jnp.concatenate([cache_k, hist_k.reshape(-1, kv, d), k])
    values = jnp.concatenate([cache_v, hist_v.reshape(-1, kv, d), v])
    exact = matmul_precision(q.dtype)
    qg = q.reshape(r, kv, h // kv, d)
    s = jnp.einsum("rkgd,ckd->kgrc", qg, keys, precision=exact, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(seen[None, None], s, -jnp.inf), axis=-1).astype(values.dtype)
    out = jnp.einsum("kgrc,ckd->rkgd", probs, values, precision=exact, preferred_element_type=jnp.float32)
    return out.reshape(r, h, d).astype(q.dtype)


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


def group_rows(x: jax.Array, *, width: int, kv: int, groups: int, rows: int) -> jax.Array:
    """[R, heads, D] → [G, K, rows, D], the kernels' rows: per group and kv head its (hypothesis, query head)
    pairs, then zero rows up to `rows`. Keys and values (a head per kv head) repeat over the query heads."""
    d = x.shape[-1]
    x = x.reshape(-1, width, kv, x.shape[1] // kv, d)
    g = x.shape[0]
    x = jnp.broadcast_to(x, (g, width, kv, groups, d)).transpose(0, 2, 1, 3, 4)
    x = x.reshape(g, kv, width * groups, d)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - width * groups), (0, 0)))


def ungroup_rows(out: jax.Array, *, width: int, heads: int) -> jax.Array:
    """group_rows' inverse for the query heads: [G, K, rows, D] → [R, heads, D]."""
    g, kv, _, d = out.shape
    out = out[:, :, : width * heads // kv].reshape(g, kv, width, heads // kv, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(g * width, heads, d)


def path_seen(path: jax.Array, step: jax.Array, groups: int, rows: int) -> jax.Array:
    """[G, rows, S * W] bool: whether row (hypothesis, query head)'s path holds history row j at step s
    (column s * W + j) before this step; padding rows hold none."""
    g, w, s_max = path.shape
    cols = jnp.arange(s_max, dtype=jnp.int32)
    seen = (path[..., None] == jnp.arange(w, dtype=jnp.int32)) & (cols < step)[None, None, :, None]
    seen = jnp.repeat(seen.reshape(g, w, s_max * w), groups, axis=1)
    return jnp.pad(seen, ((0, 0), (0, rows - w * groups), (0, 0)))


def _kernel(
    start_ref,  # [G] the group's tree start, trunk end, template start and end (rows of the pass)
    trunk_end_ref,
    branch_ref,
    slot_end_ref,
    pos_ref,  # [G] the position of the group's rows (all hypotheses of a slot are at the same step)
    step_ref,  # [1]
    seen_ref,  # [M, S * W] int32: which history columns before `step` each row's path holds
    q_ref,  # [M, D]: the group's W hypotheses × the kv head's query heads, padded to M rows
    k_now_ref,  # [M, D]: each row's own key and value of this step
    v_now_ref,
    cache_k_ref,  # [T, D]: the pass's keys of this kv head
    cache_v_ref,
    hist_k_ref,  # [S * W, D]: the group's history of this kv head, step-major
    hist_v_ref,
    o_ref,  # [M, D]
    *,
    width,
    tile,
    scale,
    window,
):
    """One group (slot) and one kv head: the trunk in `tile`-key tiles, the template and the path in
    BRANCH_BLOCK-key blocks, each counted from its own start, then the row's own key. A group whose tree is
    empty (padding, or a slot whose search is done) reads nothing."""
    g = pl.program_id(0)
    q = q_ref[...]
    exact = q_ref.dtype == jnp.float32  # f32 means f32, not TF32
    start, trunk_end, branch, slot_end = start_ref[g], trunk_end_ref[g], branch_ref[g], slot_end_ref[g]
    pos, step = pos_ref[g], step_ref[0]
    live = trunk_end > start
    trunk_len = trunk_end - start
    columns = hist_k_ref.shape[0]

    def dot(p, values):
        return plgpu.dot(p, values, allow_tf32=not exact)

    def fold(state, keys, values, ok):  # ok [M or 1, C]
        s = plgpu.dot(q, keys, trans_b=True, allow_tf32=not exact) * scale  # [M, C] f32
        return _online_softmax_step(state, jnp.where(ok, s, -jnp.inf), values, dot)

    def pass_part(first, end, size, first_pos):  # keys first..end-1 of the pass, at first_pos onwards
        def step_fn(b, state):
            offsets = b * size + jnp.arange(size, dtype=jnp.int32)
            ok = first + offsets < end
            if window is not None:
                ok &= pos - (first_pos + offsets) < window
            rows = pl.ds(first + b * size, size)
            keys = plgpu.load(cache_k_ref.at[rows, :], mask=ok[:, None], other=0.0)
            values = plgpu.load(cache_v_ref.at[rows, :], mask=ok[:, None], other=0.0)
            return fold(state, keys, values, ok[None, :])

        return step_fn

    def path_step(b, state):
        cols = b * BRANCH_BLOCK + jnp.arange(BRANCH_BLOCK, dtype=jnp.int32)
        inside = cols < columns
        block = pl.ds(b * BRANCH_BLOCK, BRANCH_BLOCK)
        ok = plgpu.load(seen_ref.at[:, block], mask=inside[None, :], other=0) != 0
        if window is not None:
            ok &= (step - cols // width < window)[None, :]
        keys = plgpu.load(hist_k_ref.at[block, :], mask=inside[:, None], other=0.0)
        values = plgpu.load(hist_v_ref.at[block, :], mask=inside[:, None], other=0.0)
        return fold(state, keys, values, ok)

    m_rows = q.shape[0]
    state = (
        jnp.full((m_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    trunk = pass_part(start, trunk_end, tile, 0)
    state = jax.lax.fori_loop(0, jnp.where(live, (trunk_len + tile - 1) // tile, 0), trunk, state)
    template = pass_part(branch, slot_end, BRANCH_BLOCK, trunk_len)
    template_blocks = jnp.where(live, (slot_end - branch + BRANCH_BLOCK - 1) // BRANCH_BLOCK, 0)
    state = jax.lax.fori_loop(0, template_blocks, template, state)
    path_blocks = jnp.where(live, (step * width + BRANCH_BLOCK - 1) // BRANCH_BLOCK, 0)
    m, denom, acc = jax.lax.fori_loop(0, path_blocks, path_step, state)
    # The row's own key, last: one key per row, so a row-wise product rather than a dot.
    k_now = k_now_ref[...].astype(jnp.float32)
    s = jnp.sum(q.astype(jnp.float32) * k_now, axis=-1) * scale
    m_new = jnp.maximum(m, s)
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    denom = denom * alpha + p
    v_now = v_now_ref[...]
    p = p.astype(v_now.dtype).astype(jnp.float32)  # as the blocks' dots see p
    acc = acc * alpha[:, None] + p[:, None] * v_now.astype(jnp.float32)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)


@partial(jax.jit, static_argnames=("scale", "window", "block", "group_tile", "tile", "interpret"))
def kernel(
    q: jax.Array,  # [R, H, D], R = G * W
    k: jax.Array,  # [R, K, D]
    v: jax.Array,  # [R, K, D]
    cache_k: jax.Array,  # [T, K, D]
    cache_v: jax.Array,  # [T, K, D]
    hist_k: jax.Array,  # [G, S, W, K, D]: keys of earlier steps (columns ≥ step are not read)
    hist_v: jax.Array,  # [G, S, W, K, D]
    positions: jax.Array,  # [R]
    tree_start: jax.Array,  # [G]: rows of the pass
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
    tile: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [R, H, D]
    """`blockwise` as a Pallas kernel (Triton backend): a program per (group, kv head) reads its own slot's
    trunk, template and path, so padding groups and finished slots cost nothing and keys are read straight
    from the pass's cache and the history (no gathered copies). The query heads that share a kv head and the
    W hypotheses form the program's rows, padded to a power of two of at least 16 (Triton's smallest dot).

    The trunk tile is 64 keys while a key row is at most 512 bytes, else 32 (shared memory, as in
    tree_attention.kernel). The reduction runs in the order `blockwise` does, in other blocks: the two agree
    to rounding, and each is invariant on its own. `block` and `group_tile` are blockwise's (unused here)."""
    del block, group_tile
    _, h, d = q.shape
    g, s_max, w, kv = hist_k.shape[:4]
    groups = h // kv
    m = max(16, 1 << (w * groups - 1).bit_length())
    tile = tile or (64 if d * q.dtype.itemsize <= 512 else 32)
    by_group = partial(group_rows, width=w, kv=kv, groups=groups, rows=m)
    seen = path_seen(path, step, groups, m).astype(jnp.int32)
    hist_k = hist_k.reshape(g, s_max * w, kv, d)
    hist_v = hist_v.reshape(g, s_max * w, kv, d)
    per_group = pl.BlockSpec((g,), lambda i, j: (0,))
    own = pl.BlockSpec((None, None, m, d), lambda i, j: (i, j, 0, 0))
    cache = pl.BlockSpec((cache_k.shape[0], None, d), lambda i, j: (0, j, 0))
    history = pl.BlockSpec((None, s_max * w, None, d), lambda i, j: (i, 0, j, 0))
    out = pl.pallas_call(
        partial(_kernel, width=w, tile=tile, scale=scale, window=window),
        out_shape=jax.ShapeDtypeStruct((g, kv, m, d), q.dtype),
        grid=(g, kv),
        in_specs=[
            *[per_group] * 5,
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((None, m, s_max * w), lambda i, j: (i, 0, 0)),
            *[own] * 3,
            cache,
            cache,
            history,
            history,
        ],
        out_specs=own,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(
        tree_start,
        trunk_end,
        branch_start,
        slot_end,
        positions.reshape(g, w)[:, 0],
        step.reshape(1),
        seen,
        by_group(q),
        by_group(k),
        by_group(v),
        cache_k,
        cache_v,
        hist_k,
        hist_v,
    )
    return ungroup_rows(out, width=w, heads=h)
