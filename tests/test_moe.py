"""Mixtures of experts (pallas_kernels.moe): the grouped computation against the dense reference, and a
token's result independent of every other token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import dense, grouped
from spinf_jax.models.moe import route
from spinf_jax.quant import Precision, linear, quantize

T, HIDDEN, INNER, EXPERTS, K = 48, 32, 24, 8, 2


def _experts(precision: Precision):
    keys = jax.random.split(jax.random.key(0), 3)
    gate, up = (jax.random.normal(k, (EXPERTS, INNER, HIDDEN)) * HIDDEN**-0.5 for k in keys[:2])
    down = jax.random.normal(keys[2], (EXPERTS, HIDDEN, INNER)) * INNER**-0.5
    gate, up, down = (quantize(w, precision) for w in (gate, up, down))

    def expert(rows, e):
        pick = lambda w: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), w)  # noqa: E731
        return linear(jax.nn.silu(linear(rows, pick(gate))) * linear(rows, pick(up)), pick(down), jnp.float32)

    return expert


def _tokens(seed: int, n: int = T, skew: bool = False):
    x = jax.random.normal(jax.random.key(seed), (n, HIDDEN))
    logits = jax.random.normal(jax.random.key(seed + 1), (n, EXPERTS))
    if skew:  # most tokens to expert 3: one expert's rows fill several tiles
        logits = logits.at[:, 3].add(4.0)
    return x, *route(jax.nn.softmax(logits), K, normalize=True)


@pytest.mark.parametrize(
    "precision, skew", [(Precision.FP32, False), (Precision.FP32, True), (Precision.FP8, True)]
)
def test_grouped_is_the_dense_reference(precision, skew):
    expert = _experts(precision)
    x, index, weight = _tokens(1, skew=skew)
    want = dense(x, index, weight, expert, EXPERTS)
    got = jax.jit(lambda *a: grouped(*a, expert, EXPERTS, tile=8))(x, index, weight)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_tokens_bits_do_not_depend_on_the_other_tokens():
    """The same token alone, among others, after others, or with the whole batch routed elsewhere: the same
    bits (its row lands at another place of another tile each time)."""
    expert = _experts(Precision.FP8)
    run = jax.jit(lambda *a: grouped(*a, expert, EXPERTS, tile=8))
    x, index, weight = _tokens(2)
    full = np.asarray(run(x, index, weight))
    others = _tokens(3, skew=True)
    for rows in (slice(0, 1), slice(5, 17), slice(30, T)):
        np.testing.assert_array_equal(np.asarray(run(x[rows], index[rows], weight[rows])), full[rows])
        mixed = [jnp.concatenate([o, a[rows]]) for o, a in zip(others, (x, index, weight), strict=True)]
        np.testing.assert_array_equal(np.asarray(run(*mixed))[T:], full[rows])
