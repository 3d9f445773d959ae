"""The tree mask is the product's core promise: a token sees its own content's trunk and its ancestors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.late_map import late_map
from pallas_kernels.tree_attention import blockwise, kernel, reference, tree_mask


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


def _packed_trees(trees, block, total_blocks):
    """Lay out (positions, span_end-relative) trees at block boundaries; returns arrays and tree offsets."""
    t = total_blocks * block
    positions = np.zeros(t, np.int32)
    span_end = np.arange(1, t + 1, dtype=np.int32)
    start_block = np.arange(total_blocks, dtype=np.int32)
    offsets, cursor = [], 0
    for pos, rel_end in trees:
        n = len(pos)
        positions[cursor : cursor + n] = pos
        span_end[cursor : cursor + n] = np.asarray(rel_end) + cursor
        first, last = cursor // block, (cursor + n - 1) // block
        start_block[first : last + 1] = first
        offsets.append(cursor)
        cursor += -(-n // block) * block
    return jnp.asarray(positions), jnp.asarray(span_end), jnp.asarray(start_block), offsets


def test_blockwise_matches_reference_and_is_invariant():
    block = 4
    tree_a = ([0, 1, 2, 3, 4, 5, 4, 5], [8, 8, 8, 8, 6, 6, 8, 8])  # trunk 4, two branches of 2
    tree_b = ([0, 1, 2, 3, 4], [5] * 5)
    q, k, v = _qkv(40, seed=3)
    for layout, blocks in (([tree_a], 2), ([tree_b, tree_a], 10), ([tree_b, tree_b, tree_a], 10)):
        positions, span_end, start_block, offsets = _packed_trees(layout, block, blocks)
        t = blocks * block
        args = (q[:t], k[:t], v[:t], positions, span_end)
        got = blockwise(*args, start_block, scale=0.25, window=3, block=block)
        np.testing.assert_allclose(got, reference(*args, scale=0.25, window=3), rtol=1e-5, atol=1e-5)


def test_blockwise_bit_identical_across_layouts():
    """A tree's outputs are the same bits wherever it sits, whatever is packed around it, in any pass size."""
    block = 4
    tree = ([0, 1, 2, 3, 4, 5, 4, 5], [8, 8, 8, 8, 6, 6, 8, 8])
    other = ([0, 1, 2, 3, 4], [5] * 5)
    qa, ka, va = _qkv(8, seed=5)
    qo, ko, vo = _qkv(8, seed=6)
    outs = []
    for layout, blocks in (([tree], 2), ([other, tree], 6), ([other, other, tree], 12), ([tree, other], 4)):
        positions, span_end, start_block, offsets = _packed_trees(layout, block, blocks)
        t = blocks * block
        q, k, v = (
            np.zeros((t, 4, 16), np.float32),
            np.zeros((t, 2, 16), np.float32),
            np.zeros((t, 2, 16), np.float32),
        )
        for (pos, _), off in zip(layout, offsets, strict=True):
            src = (qa, ka, va) if pos is tree[0] else (qo, ko, vo)
            for dst, s in zip((q, k, v), src, strict=True):
                dst[off : off + len(pos)] = np.asarray(s)[: len(pos)]
        out = blockwise(q, k, v, positions, span_end, start_block, scale=0.25, window=None, block=block)
        off = offsets[[i for i, (pos, _) in enumerate(layout) if pos is tree[0]][0]]
        outs.append(np.asarray(out[off : off + 8]))
    for other_out in outs[1:]:
        np.testing.assert_array_equal(other_out, outs[0])


@pytest.mark.parametrize(("block", "tile", "head_dim"), [(16, 16, 32), (32, 16, 32), (64, None, 512)])
def test_pallas_kernel_matches_reference_in_interpret_mode(block, tile, head_dim):
    """The GPU kernel, run by Pallas' interpreter on the CPU, against the pure-JAX definition (head_dim 512
    is Gemma 4's global layers: it takes the 32-row tiles)."""
    trunk_and_branches = ([0, 1, 2, 3, 4, 5, 4, 5, *range(6, 30)], [32] * 4 + [6, 6] + [32] * 26)
    chain = (list(range(20)), [20] * 20)
    total = 128 if block == 64 else 96
    positions, span_end, start_block, _ = _packed_trees([chain, trunk_and_branches], block, total // block)
    q, k, v = _qkv(total, h=4, k=2, d=head_dim, seed=1)
    for window in (None, 5):
        expected = reference(q, k, v, positions, span_end, scale=0.2, window=window)
        args = (q, k, v, positions, span_end, start_block)
        got = kernel(*args, scale=0.2, window=window, block=block, tile=tile, interpret=True)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_late_map_is_lax_map():
    xs = (jnp.arange(24.0).reshape(4, 6), jnp.arange(4))
    fn = lambda x: (x[0] * x[1], {"sum": x[0].sum()})  # noqa: E731
    got, want = jax.tree.leaves(late_map(fn, xs)), jax.tree.leaves(jax.lax.map(fn, xs))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
