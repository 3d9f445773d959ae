"""Tree attention over a packed pass.

`reference` is the pure-JAX definition every kernel here is tested against: dense scores with the tree
mask of `TreeBatch` (spinf_jax.models.layers), optional sliding window over tree positions, GQA.
"""

import jax
import jax.numpy as jnp


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
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = tree_mask(positions, span_end, window)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(t, h, d).astype(q.dtype)
