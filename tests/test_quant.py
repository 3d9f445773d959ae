import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinf_jax.quant import Precision, QuantArray, embed, linear, quantize, stacked_outputs


@pytest.mark.parametrize(("precision", "rel"), [(Precision.FP8, 0.08), (Precision.INT8, 0.02)])
def test_quantized_linear_close_to_f32(precision, rel):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (16, 64), jnp.bfloat16)
    w = jax.random.normal(kw, (32, 64)) * jnp.linspace(0.01, 3.0, 32)[:, None]  # rows of very different scale
    q = quantize(w, precision)
    assert isinstance(q, QuantArray) and q.values.shape == (32, 64) and q.scale.shape == (32,)
    exact = np.asarray(x, np.float32) @ np.asarray(w).T
    got = np.asarray(linear(x, q, jnp.float32))
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < rel


def test_fp8_rows_do_not_depend_on_their_neighbours():
    """Per-token activation scales: a row's result is the same whatever rows it is batched with."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (8, 64), jnp.bfloat16)
    w = quantize(jax.random.normal(kw, (32, 64)), Precision.FP8)
    alone = linear(x[3:4], w)
    loud = x.at[0].multiply(1000.0)  # a neighbour with a huge range must not change row 3
    np.testing.assert_array_equal(np.asarray(linear(loud, w)[3:4]), np.asarray(alone))


def test_quantized_embedding_rows():
    table = jax.random.normal(jax.random.key(2), (50, 16))
    q = quantize(table, Precision.INT8)
    ids = jnp.array([3, 7, 3])
    np.testing.assert_allclose(embed(ids, q, jnp.float32), table[ids], atol=0.02)


def test_unquantized_precisions_cast():
    w = jnp.ones((4, 4), jnp.float32)
    assert quantize(w, Precision.BF16).dtype == jnp.bfloat16
    assert quantize(w, Precision.FP32).dtype == jnp.float32


@pytest.mark.parametrize("precision", [Precision.FP8, Precision.BF16])
def test_stacked_outputs_are_one_gemm_of_the_same_bits(precision):
    kx, ka, kb = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(kx, (16, 64), jnp.bfloat16)
    a, b = (quantize(jax.random.normal(k, (n, 64)), precision) for k, n in ((ka, 32), (kb, 16)))
    both = jax.jit(lambda x: linear(x, stacked_outputs(a, b)))(x)
    apart = jax.jit(lambda x: jnp.concatenate([linear(x, a), linear(x, b)], axis=-1))(x)
    np.testing.assert_array_equal(np.asarray(both, np.float32), np.asarray(apart, np.float32))
