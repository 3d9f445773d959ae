"""Tree attention over a packed pass.

`reference` is the pure-JAX definition every kernel here is tested against: dense scores with the tree
mask of `TreeBatch` (spinf_jax.models.layers), optional sliding window over tree positions, GQA.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.late_map import late_map


def matmul_precision(dtype):
    """f32 attention is f32 (GPUs would run it as TF32); the kernels here depend on nothing of spinf_jax."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def tree_mask(positions: jax.Array, span_end: jax.Array, window: int | None) -> jax.Array:
    """[T, T] bool: query i may attend to key j."""
    n = positions.shape[0]
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    visible = (j <= i) & (i < span_end[None, :])
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
) -> jax.Array:  # [T, H, D]
    t, h, d = q.shape
    groups = h // k.shape[1]
    qg = q.reshape(t, k.shape[1], groups, d)
    exact = matmul_precision(q.dtype)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, precision=exact, preferred_element_type=jnp.float32) * scale
    mask = tree_mask(positions, span_end, window)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v, precision=exact, preferred_element_type=jnp.float32)
    return out.reshape(t, h, d).astype(q.dtype)


def blockwise(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    positions: jax.Array,  # [T]
    span_end: jax.Array,  # [T]
    tree_start_block: jax.Array,  # [T // block]: first key block of the tree each query block belongs to
    *,
    scale: float,
    window: int | None = None,
    block: int,
) -> jax.Array:  # [T, H, D]
    """Batch-invariant tree attention: online softmax over key blocks, counted from the query's own tree.

    Every tree of the pass starts on a block boundary. Query block qb visits key blocks
    tree_start_block[qb], ..., qb in order, so the reduction order of a query depends only on its own tree,
    never on where the tree sits in the pass or what else is packed with it; blocks outside the tree are
    never visited. This is the algorithm the GPU kernels implement; here it is plain JAX.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    t, h, d = q.shape
    kv = k.shape[1]
    groups = h // kv
    nb = t // block
    qb = q.reshape(nb, block, kv, groups, d)
    kb = k.reshape(nb, block, kv, d)
    vb = v.reshape(nb, block, kv, d)
    offsets = jnp.arange(block, dtype=jnp.int32)
    exact = matmul_precision(q.dtype)

    def query_block(i, q_block):
        # One query block at a time, with the same loop body whatever the pass size: the row bits then
        # depend only on the tree (vectorising over all query blocks let XLA's CPU code vary with T).
        q_idx = i * block + offsets
        q_pos = positions[q_idx]

        def step(r, state):
            m, denom, acc = state
            key_block = tree_start_block[i] + r
            k_idx = key_block * block + offsets
            visible = (k_idx[None, :] <= q_idx[:, None]) & (q_idx[:, None] < span_end[k_idx][None, :])
            if window is not None:
                visible &= q_pos[:, None] - positions[k_idx][None, :] < window
            s = jnp.einsum(
                "bkgd,ckd->kgbc", q_block, kb[key_block], precision=exact, preferred_element_type=jnp.float32
            )
            s = s * scale
            s = jnp.where(visible[None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # A row that has seen nothing yet keeps m = -inf; shift by 0 there so no inf - inf appears.
            shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            denom = denom * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "kgbc,ckd->kgbd",
                p.astype(v.dtype),
                vb[key_block],
                precision=exact,
                preferred_element_type=jnp.float32,
            )
            return m_new, denom, acc * alpha[..., None] + pv

        init = (
            jnp.full((kv, groups, block), -jnp.inf, jnp.float32),
            jnp.zeros((kv, groups, block), jnp.float32),
            jnp.zeros((kv, groups, block, d), jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(0, i - tree_start_block[i] + 1, step, init)
        out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # [kv, groups, block, d]
        return out.transpose(2, 0, 1, 3).reshape(block, h, d)

    out = late_map(lambda args: query_block(*args), (jnp.arange(nb, dtype=jnp.int32), qb))
    return out.reshape(t, h, d).astype(q.dtype)


def _kernel(start_ref, pos_ref, end_ref, q_ref, k_ref, v_ref, o_ref, *, block, scale, window):
    """One query block of one head: online softmax over its tree's key blocks, first to own, in order."""
    i = pl.program_id(0)
    q = q_ref[...]  # [block, D]
    exact = q_ref.dtype == jnp.float32  # f32 means f32, not TF32
    q_idx = i * block + jnp.arange(block, dtype=jnp.int32)
    q_pos = pos_ref[pl.ds(i * block, block)]

    def step(kb, state):
        acc, m, denom = state
        keys = pl.ds(kb * block, block)
        s = plgpu.dot(q, k_ref[keys, :], trans_b=True, allow_tf32=not exact) * scale  # [block, block] f32
        k_idx = kb * block + jnp.arange(block, dtype=jnp.int32)
        visible = (k_idx[None, :] <= q_idx[:, None]) & (q_idx[:, None] < end_ref[keys][None, :])
        if window is not None:
            visible &= q_pos[:, None] - pos_ref[keys][None, :] < window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[:, None])
        alpha = jnp.exp(m - shift)
        denom = denom * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[keys, :], allow_tf32=not exact)
        return acc, m_new, denom

    init = (
        jnp.zeros((block, q.shape[-1]), jnp.float32),
        jnp.full((block,), -jnp.inf, jnp.float32),
        jnp.zeros((block,), jnp.float32),
    )
    acc, _, denom = jax.lax.fori_loop(start_ref[i], i + 1, step, init)
    o_ref[...] = (acc / jnp.where(denom == 0, 1.0, denom)[:, None]).astype(o_ref.dtype)


@partial(jax.jit, static_argnames=("scale", "window", "block", "tile", "interpret"))
def kernel(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    positions: jax.Array,  # [T]
    span_end: jax.Array,  # [T]
    tree_start_block: jax.Array,  # [T // block]
    *,
    scale: float,
    window: int | None = None,
    block: int,
    tile: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]
    """`blockwise` as a Pallas kernel (Triton backend): a program per (query tile, head) visits only the
    key tiles of its own tree, so tiles no query in it can see are skipped, and the order of its
    reduction is the tree's own whatever else shares the pass.

    Trees are aligned to `block`; the kernel works in tiles of `tile` ≤ block rows. By default 64 rows while
    a row of q is at most 512 bytes (bf16 head_dim 256), else 32: q, k, v tiles and the scores must fit the
    H200's 227 KiB of shared memory (f32 at head_dim 256 with 64-row tiles asked for 256 KiB)."""
    t, h, d = q.shape
    groups = h // k.shape[1]
    tile = min(tile or (64 if d * q.dtype.itemsize <= 512 else 32), block)
    per_block = block // tile
    tree_start_block = jnp.repeat(tree_start_block * per_block, per_block)  # in tiles now
    block = tile
    nb = t // block
    whole = lambda i, j: (0,)  # noqa: E731 - index maps are tiny lambdas by convention
    return pl.pallas_call(
        partial(_kernel, block=block, scale=scale, window=window),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(nb, h),
        in_specs=[
            pl.BlockSpec((nb,), whole),
            pl.BlockSpec((t,), whole),
            pl.BlockSpec((t,), whole),
            pl.BlockSpec((block, None, d), lambda i, j: (i, j, 0)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j // groups, 0)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j // groups, 0)),
        ],
        out_specs=pl.BlockSpec((block, None, d), lambda i, j: (i, j, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="tree_attention",
    )(tree_start_block, positions, span_end, q, k, v)
