"""The gated delta rule in chunks against its definition, a token at a time (pallas_kernels.gated_delta).

Every test runs 40 tokens of the same heads, so the recurrence compiles once for the file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import chunked, recurrent


def _inputs(seed: int, t: int, h: int = 2, dk: int = 16, dv: int = 8):
    """Tokens as Qwen3.5's layer hands them over: q and k L2-normalised (q scaled), g ≤ 0, β in (0, 1)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q, k = (jax.random.normal(key, (t, h, dk)) for key in keys[:2])
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (t, h)))
    state = jax.random.normal(keys[5], (h, dk, dv))
    return q, k, v, g, beta, state


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
