"""The tree mask is the product's core promise: a token sees its own content's trunk and its ancestors."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tree_attention_mosaic
from pallas_kernels.late_map import late_map
from pallas_kernels.tree_attention import BRANCH_BLOCK, blockwise, kernel, reference, tree_mask
from spinf_jax.layout import QuestionKey, Tree, build_tree
from tests.draws import normals
from tests.trees import lay_out


def _qkv(t, h=4, k=2, d=16, seed=0):
    return tuple(map(jnp.asarray, normals(seed, (t, h, d), (t, k, d), (t, k, d))))


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


BRANCHES = [
    QuestionKey((11, 12, 13), ((40,), (41,))),
    QuestionKey((14, 15), ((50, 51, 52), (50, 51, 53), (50, 60), (70,))),  # a trie of option prefixes
    QuestionKey((16,) * 9, ((80, 81), (82, 83, 84, 85))),
    QuestionKey((), ((90, 91, 92), (93,))),  # no template: the trie hangs off the trunk's last token
]


def _rows_of(tree: Tree, questions: list[QuestionKey]) -> list[tuple]:
    """A name for each row that does not depend on the companions: (content, "trunk", index) or (content,
    question, row in its branch)."""
    content = tuple(tree.tokens[: tree.trunk_tokens])
    names = [(content, "trunk", i) for i in range(tree.trunk_tokens)]
    for row in range(tree.trunk_tokens, len(tree)):
        first = tree.branch_start[row]
        q = sum(1 for r in range(tree.trunk_tokens, first + 1) if tree.branch_start[r] == r)
        names.append((content, questions[q - 1], row - first))
    return names


def _inputs(names: list, t: int, h=4, k=2, d=16, dtype=jnp.float32):
    """q, k, v rows drawn from each row's name: the same name gets the same values in any layout."""
    q, kk, v = (
        np.zeros((t, h, d), np.float32),
        np.zeros((t, k, d), np.float32),
        np.zeros((t, k, d), np.float32),
    )
    for row, name in enumerate(names):
        if name is None:
            continue
        rng = np.random.default_rng(abs(hash(name)) % 2**32)
        q[row], kk[row], v[row] = (
            rng.standard_normal((h, d)),
            rng.standard_normal((k, d)),
            rng.standard_normal((k, d)),
        )
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v))


def _attend(impl, trees, questions, placement, total_blocks, window, **inputs):
    """Lay trees out (placement: block, align, gap: tests.trees.lay_out's), run an implementation, and return
    every tree's rows keyed by their names."""
    block, align, gap = placement
    arrays, offsets = lay_out(trees, block, total_blocks, align, gap)
    names = [None] * (total_blocks * block)
    for tree, qs, off in zip(trees, questions, offsets, strict=True):
        names[off : off + len(tree)] = _rows_of(tree, qs)
    q, k, v = _inputs(names, total_blocks * block, **inputs)
    out = np.asarray(impl(q, k, v, *arrays, scale=0.25, window=window, block=block), np.float32)
    want = np.asarray(reference(q, k, v, *arrays[:2], scale=0.25, window=window), np.float32)
    return {name: row for name, row in zip(names, out, strict=True) if name}, out, want


@pytest.mark.parametrize("window", [None, 3])
def test_blockwise_matches_reference(window):
    trees = [build_tree([2], list(range(30, 30 + n)), BRANCHES[i:]) for i, n in enumerate((4, 9, 1))]
    _, got, want = _attend(blockwise, trees, [BRANCHES[i:] for i in range(3)], (4, 4, 0), 40, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _companion_layouts():
    """One content asked its questions in four ways (all; a subset in another order; one alone; each
    question twice), alone or after another tree; each layout as (trees, their questions)."""
    target, other = list(range(30, 37)), list(range(60, 65))
    asks = [BRANCHES, [BRANCHES[2], BRANCHES[0]], [BRANCHES[1]], [*BRANCHES, *BRANCHES], [BRANCHES[3]]]
    for questions in asks:
        for before in ([], [(other, BRANCHES[1:3])]):
            layout = [*before, (target, questions)]
            yield [build_tree([2], c, qs) for c, qs in layout], [qs for _, qs in layout]


def same_rows_in_every_layout(impl, placements, rows=160, tol=1e-5, **inputs) -> None:
    """Every companion layout (_companion_layouts), laid out at each placement in turn (block, align, gap:
    trees start on `align`-row boundaries `gap` rows or more after the last, in passes of `rows` that are
    multiples of `block`): each output within `tol` of the reference, and each named row the same bits
    wherever and however it was asked. `inputs`: _inputs' sizes and dtype."""
    seen: dict = {}
    for placement in placements:
        for trees, questions in _companion_layouts():
            rows_of, got, want = _attend(impl, trees, questions, placement, rows // placement[0], 5, **inputs)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
            for name, row in rows_of.items():
                np.testing.assert_array_equal(row, seen.setdefault(name, row), err_msg=f"{name}, {placement}")
    assert len(seen) > 50


@pytest.mark.parametrize(
    "impl",
    [blockwise, partial(kernel, tile=4, interpret=True)],
    ids=["blockwise", "kernel-interpret"],
)
def test_rows_bit_identical_whatever_the_companions(impl):
    """A row's output depends on its content and its own question only: not on the other questions of its
    content, their order, duplicates, where its tree sits (on a block boundary or not, with another tree's
    rows in its first query block), or what is packed before it."""
    same_rows_in_every_layout(impl, placements=((8, 8, 0), (8, 2, 3)))


def test_kernel_rows_do_not_depend_on_the_block():
    """The kernel counts key tiles from each tree's first row, so passes in blocks of one tile (the GPUs'
    default block, packer.default_block) give every row the bits it gets in blocks of two tiles."""
    same_rows_in_every_layout(partial(kernel, tile=4, interpret=True), placements=((8, 8, 0), (4, 4, 0)))


@pytest.mark.parametrize(("block", "tile", "head_dim"), [(16, 16, 32), (32, 16, 32), (64, None, 512)])
def test_pallas_kernel_matches_reference_in_interpret_mode(block, tile, head_dim):
    """The GPU kernel, run by Pallas' interpreter on the CPU, against the pure-JAX definition (head_dim 512
    is Gemma 4's global layers: it takes the 32-row tiles)."""
    chain = build_tree([2], list(range(30, 49)), [])
    branched = build_tree([2], list(range(50, 54)), BRANCHES)
    total = 128 if block == 64 else 96
    arrays, _ = lay_out([chain, branched], block, total // block)
    q, k, v = _qkv(total, h=4, k=2, d=head_dim, seed=1)
    for window in (None, 5):
        expected = reference(q, k, v, *arrays[:2], scale=0.2, window=window)
        got = kernel(q, k, v, *arrays, scale=0.2, window=window, block=block, tile=tile, interpret=True)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_image_rows_see_their_whole_image():
    """`reach`: an image's rows (here rows 3-10 of each tree's trunk) attend to each other both ways and to
    nothing after the image; every other row stays causal. The blockwise path and the GPU kernel (interpreted)
    agree with the definition, with and without a sliding window shorter than the image."""
    trees = [
        build_tree([2], list(range(30, 45)), BRANCHES),
        build_tree([2], list(range(60, 72)), BRANCHES[1:]),
    ]
    arrays, offsets = lay_out(trees, 16, 8)
    reach = np.arange(1, 129, dtype=np.int32)
    for offset in offsets:
        reach[offset + 3 : offset + 11] = offset + 11
    reach = jnp.asarray(reach)
    mask = np.asarray(tree_mask(arrays[0], arrays[1], None, reach))
    first = offsets[1]
    assert mask[first + 3, first + 10] and not mask[first + 3, first + 11], "an image row sees its image only"
    assert not mask[first + 2, first + 3] and not mask[first + 11, first + 12], "text rows stay causal"
    q, k, v = _qkv(128, h=2, k=1, seed=3)  # one kv head: half the interpreted kernel's programs
    for window in (None, 3):
        want = reference(q, k, v, *arrays[:2], scale=0.25, window=window, reach=reach)
        assert not np.allclose(want, reference(q, k, v, *arrays[:2], scale=0.25, window=window), atol=1e-3)
        # The interpreted kernel once (4 s a call on the CPU): with the window, which reads the most masks.
        for impl in (blockwise, partial(kernel, tile=8, interpret=True))[: 1 if window is None else 2]:
            got = impl(q, k, v, *arrays, scale=0.25, window=window, block=16, reach=reach)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mosaic_kernel_matches_reference_in_interpret_mode():
    """The Mosaic GPU kernel, run by its interpreter on the CPU, against the pure-JAX definition: a chain,
    then a tree that starts inside a query tile (on an 8-row boundary) with branches ending near the pass's
    end (its last branch blocks are read past it). Its rows' invariance (every companion layout, with a
    window) is tests/test_gpu.py's, on the GPU: the engine does not run this kernel, and the interpreted copy
    took 20-27 s of CI's 15 minutes."""
    chain = build_tree([2], list(range(30, 160)), [])  # 131 rows
    branched = build_tree([2], list(range(50, 80)), BRANCHES)
    arrays, offsets = lay_out([chain, branched], 64, 3, align=8, gap=5)
    assert offsets[1] % 64 and offsets[1] + len(branched) > 192 - BRANCH_BLOCK
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(192, h=4, k=2, d=128, seed=1))
    expected = reference(q, k, v, *arrays[:2], scale=0.125)
    got = tree_attention_mosaic.kernel(q, k, v, *arrays, scale=0.125, block=64, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=2e-2)


def test_late_map_is_lax_map():
    xs = (jnp.arange(24.0).reshape(4, 6), jnp.arange(4))
    fn = lambda x: (x[0] * x[1], {"sum": x[0].sum()})  # noqa: E731
    got, want = jax.tree.leaves(late_map(fn, xs)), jax.tree.leaves(jax.lax.map(fn, xs))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_late_maps_write_their_own_buffers():
    """Two loops a layer, over the layers of a scan, the first with two outputs of one shape: each loop
    writes into buffers of its own. (With zeros for every loop's buffers XLA merged them into one constant
    and copied it into each loop: the copies were 4.5% of a pass's kernel time at the 12B shape.)"""

    def layers(x, ws):
        def layer(x, w):  # x [tiles, rows, 32], w [32, 48]
            q, k = late_map(lambda t: ((t[0] @ w).astype(x.dtype), (-t[0] @ w).astype(x.dtype)), (x,))
            return late_map(lambda t: (t[0] + (t[1] * t[2]) @ w.T).astype(x.dtype), (x, q, k)), None

        return jax.lax.scan(layer, x, ws)[0]

    x, ws = jnp.ones((4, 64, 32), jnp.bfloat16), jnp.ones((3, 32, 48), jnp.bfloat16)
    hlo = jax.jit(layers).lower(x, ws).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "[4,64,48]" in line.split("copy(")[0]]
    assert not copies, copies
