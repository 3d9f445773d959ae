"""The gated delta rule in chunks against its definition, a token at a time (pallas_kernels.gated_delta).

Every test runs 40 tokens of the same heads, so the recurrence compiles once for the file (the tree test once
more, at its paths' length)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta
from pallas_kernels.gated_delta import chunked, recurrent, tree_chunked
from spinf_jax.layout import Extract, QuestionKey, build_tree
from spinf_jax.packer import Buckets, pack
from tests.draws import normals


def _inputs(seed: int, t: int, h: int = 2, dk: int = 16, dv: int = 8):
    """Tokens as Qwen3.5's layer hands them over: q and k L2-normalised (q scaled), g ≤ 0, β in (0, 1)."""
    q, k, v, g, beta, state = normals(seed, (t, h, dk), (t, h, dk), (t, h, dv), (t, h), (t, h), (h, dk, dv))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * np.float32(dk**-0.5)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g, beta = -np.logaddexp(np.float32(0), g), 1 / (1 + np.exp(-beta))  # softplus and sigmoid
    return tuple(map(jnp.asarray, (q, k, v, g, beta, state)))


T = 40


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_is_the_recurrence(chunk):
    """Whole chunks and a ragged last one (or one ragged chunk), from a state that is not zero: the same
    outputs and last state."""
    q, k, v, g, beta, state = _inputs(chunk, T)
    want_o, want_state = recurrent(q, k, v, g, beta, state)
    o, last = chunked(q, k, v, g, beta, state, chunk=chunk)
    assert o.shape == want_o.shape and last.shape == want_state.shape
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(last, want_state, rtol=1e-4, atol=1e-5)


def test_a_branch_continues_from_the_trunks_last_state():
    """The tree's fork: the trunk on its own chunk grid, then a branch on a grid from its own first token,
    from the trunk's last state, give what the recurrence gives over trunk + branch."""
    q, k, v, g, beta, state = _inputs(3, T)
    zeros = jnp.zeros_like(state)
    want, _ = recurrent(q, k, v, g, beta, zeros)
    trunk_o, trunk_state = chunked(q[:24], k[:24], v[:24], g[:24], beta[:24], zeros, chunk=16)
    branch_o, _ = chunked(q[24:], k[24:], v[24:], g[24:], beta[24:], trunk_state, chunk=16)
    np.testing.assert_allclose(jnp.concatenate([trunk_o, branch_o]), want, rtol=1e-4, atol=1e-5)


def test_the_recurrence_is_not_vacuous():
    """β = 0 writes nothing and g = 0 keeps the state: the output is the start state read by the queries; any
    other β changes it."""
    q, k, v, g, beta, state = _inputs(4, T)
    o, last = recurrent(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), state)
    np.testing.assert_allclose(o, jnp.einsum("hkv,thk->thv", state, q), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(last, state)
    assert not np.allclose(recurrent(q, k, v, g, beta, state)[0], o, atol=1e-3)


@pytest.mark.parametrize("width", [1, 4, 32])
def test_a_packed_tree_pass_is_the_recurrence_along_every_rows_path(width):
    """Two trees in one pass (a trunk over a chunk, a template over a chunk, option tries with shared
    prefixes and forks, an empty template, a question on empty content, extraction slots): every row's
    output is the recurrence from zero along its own path, the rows before it that it descends from, and
    the state handed to each slot's decoding is the recurrence's at the slot row; chunks one at a time, or
    4 or 32 side by side (a wave's lanes idle where fewer are ready)."""
    p, trees = _packed_pass()
    q, k, v, g, beta, _ = _inputs(5, p.size)
    slots = len(p.export_rows)
    o, states = tree_chunked(
        q, k, v, g, beta, jnp.asarray(p.span_end), jnp.asarray(p.chunks), exports=slots, width=width
    )
    paths = []
    for offset, tree in zip(p.row_offset, trees, strict=True):
        for row in range(len(tree)):
            path = [offset + row]
            while tree.parent[path[-1] - offset] >= 0:
                path.append(offset + tree.parent[path[-1] - offset])
            paths.append(path[::-1])
    longest = max(map(len, paths))
    # Every path padded to one length with the pass's last row, a padding row with k = β = g = 0 there.
    padded = np.array([path + [p.size - 1] * (longest - len(path)) for path in paths])
    zero_pad = [x.at[-1].set(0) for x in (k, g, beta)]
    follow = jax.vmap(lambda rows: recurrent(q[rows], *(x[rows] for x in (zero_pad[0], v, *zero_pad[1:])),
                                             jnp.zeros((2, 16, 8))))  # fmt: skip
    want, last = follow(jnp.asarray(padded))
    for path, expected in zip(paths, want, strict=True):
        np.testing.assert_allclose(
            o[path[-1]], expected[len(path) - 1], rtol=1e-4, atol=1e-5, err_msg=str(path)
        )
    ends = [path[-1] for path in paths]
    # the first tree's two slots: its last template's last row, and the trunk's last row (an empty template)
    assert slots == 32 and list(p.export_rows[:3]) == [len(trees[0]) - 1, 70, -1]
    for i, row in enumerate(p.export_rows[:2]):
        np.testing.assert_allclose(states[i], last[ends.index(row)], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_block", [64, 4])
def test_the_wave_kernel_is_the_waves_arithmetic(value_block, monkeypatch):
    """`kernel=True`: each wave as Triton programs per (lane, head, block of value columns), here in interpret
    mode on the CPU, the waves' functions with the corrections' system solved row by row: the outputs and
    handed-over states of the waves in XLA, to f32 rounding, whether a program takes all 8 value columns
    or 4."""
    monkeypatch.setattr(gated_delta, "VALUE_BLOCK", value_block)
    jax.clear_caches()  # the kernel's programs are traced with the block in force
    p, _ = _packed_pass()
    inputs = _inputs(7, p.size)[:5]
    table = (jnp.asarray(p.span_end), jnp.asarray(p.chunks))
    slots = len(p.export_rows)
    want_o, want_states = tree_chunked(*inputs, *table, exports=slots, width=4)
    o, states = tree_chunked(*inputs, *table, exports=slots, width=4, kernel=True, interpret=True)
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(states, want_states, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(o).max()) > 0 and float(jnp.abs(states).max()) > 0


def test_the_wave_kernel_lowers_to_triton_for_an_h100(monkeypatch):
    """Every operation of the wave kernel has a Triton lowering: the pass lowered for CUDA here, with jax
    told it lowers for an H100 (what a GPU machine finds itself), holds the kernel as a Triton call. (Triton's
    own compile to the GPU, registers and shared memory, happens there: tests/test_gpu.py.)"""
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *args, **kwargs: h100)
    p, _ = _packed_pass()
    inputs = _inputs(9, p.size, dk=128, dv=128)[:5]
    table = (jnp.asarray(p.span_end), jnp.asarray(p.chunks))
    run = jax.jit(partial(tree_chunked, exports=len(p.export_rows), width=4, kernel=True, group=2))
    text = run.trace(*inputs, *table).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "gated_delta_wave"' in text


@pytest.mark.parametrize("kernel", [False, True])
def test_waves_in_groups_of_a_fixed_count_change_no_bit(kernel):
    """`group`: the waves 3 or 8 to a step of the loop (a ragged last step, or one step), with or without
    the wave kernel (interpret mode): the bits of one wave a step."""
    p, _ = _packed_pass()
    inputs = _inputs(10, p.size)[:5]
    table = (jnp.asarray(p.span_end), jnp.asarray(p.chunks))
    run = partial(tree_chunked, *inputs, *table, exports=len(p.export_rows), width=4, kernel=kernel,
                  interpret=kernel)  # fmt: skip
    want_o, want_states = run()
    for group in (3, 8):
        o, states = run(group=group)
        np.testing.assert_array_equal(o, want_o)
        np.testing.assert_array_equal(states, want_states)


def _packed_pass():
    """Two trees in one pass (test_a_packed_tree_pass_is_the_recurrence_along_every_rows_path says what they
    hold): (the pass, its trees)."""
    questions = [
        QuestionKey((11, 12, 13), ((40,), (41,))),
        QuestionKey((14,) * 70, ((50, 51, 52), (50, 51, 53), (50, 60), (70,))),
        QuestionKey((), ((7, 8), (9,))),
        QuestionKey((15, 16), ((60, 61, 62), (60, 63, 64), (65, 66))),  # a trie that forks twice
        QuestionKey((17, 18, 19), extract=Extract()),
        QuestionKey((), extract=Extract(generate=True)),  # decodes from the trunk's last row
    ]
    trees = [build_tree([2], list(range(5, 75)), questions), build_tree([], [], questions[1:2])]
    [p] = pack(trees, Buckets((512,), block=32, recurrent=True))
    return p, trees
