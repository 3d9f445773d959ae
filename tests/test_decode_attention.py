"""Decode-step attention (extraction): a hypothesis sees its slot's trunk and template in the pass, its own
path of decoded tokens and its own new key; the CPU form and the Pallas kernel (interpreted) against the
dense definition, and a group's bits whatever the other groups of the step are. On a GPU the kernel runs
compiled (pytest tests/test_decode_attention.py on the H200), elsewhere in Pallas' interpreter."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention_mosaic
from pallas_kernels.decode_attention import blockwise, kernel, reference
from tests.draws import normals

T, S, HEADS, KV = 128, 6, 4, 2
# Slots as (tree start, trunk end, template start, slot end) in a pass of T rows; the last is a padding group.
PLACES = [(0, 37, 40, 45), (0, 37, 45, 71), (64, 70, 72, 73), (0, 0, 0, 0)]


def _step(places, width, step, d=16, seed=0, dtype=jnp.float32):
    g, r = len(places), len(places) * width
    rows, cache, slots = (r, KV, d), (T, KV, d), (g, S, width, KV, d)
    # q, k, v of the rows decoded now; the pass's cached k, v; k, v of the slots' earlier steps (history)
    drawn = normals((seed, 1), (r, HEADS, d), rows, rows, cache, cache, slots, slots)
    start, trunk_end, branch, slot_end = (jnp.array(x, jnp.int32) for x in zip(*places, strict=True))
    first = trunk_end - start + slot_end - branch  # the first decoded token's position
    rng = np.random.default_rng(seed)
    return (
        *(jnp.asarray(x).astype(dtype) for x in drawn),
        jnp.repeat(first + step, width),
        start,
        trunk_end,
        branch,
        slot_end,
        jnp.asarray(rng.integers(0, width, (g, width, S)), jnp.int32),
        jnp.int32(step),
    )


ON_GPU = jax.default_backend() == "gpu"
IMPLS = {
    "blockwise": jax.jit(partial(blockwise, block=32, group_tile=2), static_argnames=("scale", "window")),
    "kernel": partial(kernel, block=32, tile=16, interpret=not ON_GPU),
}
MOSAIC = partial(decode_attention_mosaic.kernel, block=32, interpret=not ON_GPU)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize(("width", "step", "window"), [(4, 3, None), (1, 5, None), (4, 0, None), (4, 4, 30)])
def test_matches_the_dense_definition(impl, width, step, window):
    args = _step(PLACES, width, step)
    want = reference(*args, scale=0.3, window=window)
    got = impl(*args, scale=0.3, window=window)
    live = 3 * width  # the padding group's rows are not meaningful
    np.testing.assert_allclose(got[:live], want[:live], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_bf16_at_a_real_head_dim(impl):
    """Gemma 3's head_dim (256) in bf16, searched (width 8) and generated (width 1) steps."""
    for width, step in ((8, 5), (1, 4)):
        args = _step(PLACES, width, step, d=256, seed=2, dtype=jnp.bfloat16)
        want = reference(*args, scale=256**-0.5, window=None)
        got = impl(*args, scale=256**-0.5, window=None)
        live = 3 * width
        np.testing.assert_allclose(np.asarray(got[:live], np.float32), np.asarray(want[:live], np.float32),
                                   atol=0.02)  # fmt: skip


@pytest.mark.parametrize(("width", "step", "window"), [(4, 5, 30), (1, 5, None)])
def test_mosaic_kernel_matches_the_dense_definition(width, step, window):
    """The Mosaic GPU kernel (bf16, head_dim 128 or 256) at 128, interpreted on the CPU (1.5 s a call), or at
    Gemma 3's 256 on a GPU: templates that start off 8-row boundaries, a path over two blocks whose last runs
    past the history's 24 columns (padded to whole blocks), and a window that hides part of the trunk and
    path."""
    d = 256 if ON_GPU else 128
    args = _step(PLACES, width, step, d=d, seed=3, dtype=jnp.bfloat16)
    want = np.asarray(reference(*args, scale=d**-0.5, window=window), np.float32)
    if window is not None:
        assert not np.allclose(want, np.asarray(reference(*args, scale=d**-0.5, window=None), np.float32))
    got = np.asarray(MOSAIC(*args, scale=d**-0.5, window=window), np.float32)
    live = 3 * width
    np.testing.assert_allclose(got[:live], want[:live], atol=0.02)


# The Mosaic kernel's invariance runs on GPUs only (1.5 s a call interpreted), with one and two trunk tiles
# in flight.
MOSAIC_SLOTS = {"mosaic-1-slot": MOSAIC, "mosaic-2-slots": partial(MOSAIC, slots=2)}
GROUP_IMPLS = IMPLS | (MOSAIC_SLOTS if ON_GPU else {})


@pytest.mark.parametrize("impl", GROUP_IMPLS.values(), ids=GROUP_IMPLS.keys())
def test_a_group_keeps_its_bits_whatever_the_other_groups(impl):
    """Slot 1's rows alone, after other slots, and beside a padding group: the same bits (the history and
    path move with the slot, its place in the pass stays)."""
    width, step = 4, 4
    full = _step(PLACES, width, step, d=128, dtype=jnp.bfloat16)
    out = impl(*full, scale=0.3, window=None)[width : 2 * width]

    def only(groups):  # the step's per-group arrays restricted to these groups, in this order
        rows = np.concatenate([np.arange(i * width, (i + 1) * width) for i in groups])
        q, k, v, ck, cv, hk, hv, pos, *per_group, path, st = full
        per_group = [a[np.array(groups)] for a in per_group]
        return (q[rows], k[rows], v[rows], ck, cv, hk[np.array(groups)], hv[np.array(groups)], pos[rows],
                *per_group, path[np.array(groups)], st)  # fmt: skip

    for groups, at in (([1, 3], 0), ([2, 0, 1, 3], 2), ([3, 1], 1)):
        got = impl(*only(groups), scale=0.3, window=None)[at * width : (at + 1) * width]
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(out, np.float32))
