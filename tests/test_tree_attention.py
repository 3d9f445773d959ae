"""The tree mask is the product's core promise: a token sees its own content's trunk and its ancestors."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention import reference, tree_mask


def _qkv(t, h=4, k=2, d=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (t, h, d)),
        jax.random.normal(keys[1], (t, k, d)),
        jax.random.normal(keys[2], (t, k, d)),
    )


def _causal(q, k, v, window=None):
    n = q.shape[0]
    return reference(q, k, v, jnp.arange(n), jnp.full((n,), n), scale=q.shape[-1] ** -0.5, window=window)


def test_packed_sequences_equal_separate_sequences():
    q, k, v = _qkv(12)
    # two sequences of 5 and 7 tokens packed into one pass
    positions = jnp.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6])
    span_end = jnp.array([5] * 5 + [12] * 7)
    packed = reference(q, k, v, positions, span_end, scale=0.25)
    np.testing.assert_allclose(packed[:5], _causal(q[:5], k[:5], v[:5]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(packed[5:], _causal(q[5:], k[5:], v[5:]), rtol=1e-6, atol=1e-6)


def test_branches_equal_their_linear_sequences():
    # trunk of 3 tokens, then two sibling branches of 2 tokens each (depth-first layout)
    q, k, v = _qkv(7)
    positions = jnp.array([0, 1, 2, 3, 4, 3, 4])
    span_end = jnp.array([7, 7, 7, 5, 5, 7, 7])
    tree = reference(q, k, v, positions, span_end, scale=0.25)
    for branch in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):
        idx = jnp.array(branch)
        linear = _causal(q[idx], k[idx], v[idx])
        np.testing.assert_allclose(tree[idx[3:]], linear[3:], rtol=1e-6, atol=1e-6)
    mask = np.asarray(tree_mask(positions, span_end, None))
    assert not mask[5, 3] and not mask[6, 4], "siblings must not see each other"


def test_sliding_window_counts_tree_positions():
    q, k, v = _qkv(7)
    positions = jnp.array([0, 1, 2, 3, 4, 3, 4])
    span_end = jnp.array([7, 7, 7, 5, 5, 7, 7])
    tree = reference(q, k, v, positions, span_end, scale=0.25, window=2)
    idx = jnp.array([0, 1, 2, 5, 6])
    linear = _causal(q[idx], k[idx], v[idx], window=2)
    np.testing.assert_allclose(tree[idx], linear, rtol=1e-6, atol=1e-6)
    mask = np.asarray(tree_mask(positions, span_end, 2))
    assert mask[6].nonzero()[0].tolist() == [5, 6]
