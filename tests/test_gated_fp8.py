"""The fp8 gated product (pallas_kernels.gated_fp8): the kernel, in Pallas' interpreter, against its
reference; the reference against what `linear` computes; a row's bits whatever shares its launch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_fp8
from spinf_jax.models.layers import gelu_tanh
from spinf_jax.quant import Precision, gated_linear, linear, quantize


def products(rows: int, width: int, seed: int = 0):
    """Raw gate and up GEMM outputs (bf16), their rows' scales [rows, 1] and their columns' [width]."""
    k = jax.random.split(jax.random.key(seed), 5)
    g = (jax.random.normal(k[0], (rows, width)) * 40).astype(jnp.bfloat16)
    u = (jax.random.normal(k[1], (rows, width)) * 40).astype(jnp.bfloat16)
    x_scale = jax.random.uniform(k[2], (rows, 1), minval=0.002, maxval=0.02)
    return g, u, x_scale, *(jax.random.uniform(key, (width,), minval=1e-4, maxval=1e-3) for key in k[3:])


def assert_close_to_reference(got, want):
    """(h, scale) pairs: the kernel's activation runs in f32 and is rounded once (the reference's in bf16),
    so a value may land one fp8 step from the reference's, 32/448 of the row's largest at the top of e4m3's
    range; the scales within 1%."""
    (h, scale), (want_h, want_scale) = got, want
    np.testing.assert_allclose(scale, want_scale, rtol=1e-2)
    one_step = np.asarray(want_scale) * gated_fp8.FP8_MAX * 32 / 448
    difference = np.abs(np.asarray(h.astype(jnp.float32) * scale - want_h.astype(jnp.float32) * want_scale))
    assert (difference <= one_step * 1.001).all()


@pytest.mark.parametrize("activation", [gelu_tanh, jax.nn.silu])
@pytest.mark.parametrize(("width", "rows"), [(96, 1), (2048, 2)])  # chunks of 32 and of 1,024 columns
def test_kernel_matches_reference(activation, width, rows):
    args = products(8, width)
    h, scale = gated_fp8.kernel(*args, activation=activation, rows=rows, interpret=True)
    assert h.dtype == jnp.float8_e4m3fn and scale.shape == (8, 1)
    assert_close_to_reference((h, scale), gated_fp8.reference(*args, activation=activation))


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    g, u, x_scale, g_scale, u_scale = products(8, 256)
    together = gated_fp8.kernel(g, u, x_scale, g_scale, u_scale, activation=gelu_tanh, interpret=True)
    moved = [jnp.roll(a, 3, axis=0) for a in (g, u, x_scale)]
    rolled = gated_fp8.kernel(*moved, g_scale, u_scale, activation=gelu_tanh, interpret=True)
    for a, b in zip(together, rolled, strict=True):
        np.testing.assert_array_equal(
            np.asarray(jnp.roll(a, 3, axis=0)).view(np.uint8), np.asarray(b).view(np.uint8)
        )


def test_gated_linear_is_the_linears():
    """The fp8 path's reference gives the bits of linear(activation(linear(x, gate)) · linear(x, up), down),
    and through the kernel the same up to its rounding."""
    k = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(k[0], (16, 64)).astype(jnp.bfloat16)
    gate, up = (quantize(jax.random.normal(key, (128, 64)) * 0.1, Precision.FP8) for key in k[1:3])
    down = quantize(jax.random.normal(k[3], (64, 128)) * 0.1, Precision.FP8)
    want = jax.jit(lambda x: linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down))(x)
    got = jax.jit(lambda x: gated_linear(x, gate, up, down, jax.nn.silu))(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    kernel = jax.jit(lambda x: gated_linear(x, gate, up, down, jax.nn.silu, interpret=True))(x)
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(kernel, np.float32), want, atol=0.05 * np.abs(want).max())
