"""Checks that only mean something on a GPU (CI has none; run `pytest tests/test_gpu.py` on the H200).

The CPU versions of the same properties are tested elsewhere: the kernel in interpret mode
(test_tree_attention), invariance of the CPU path (test_layout, test_engine)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import kernel, reference
from spinf_jax.engine import Engine
from spinf_jax.layout import QuestionKey, build_tree
from spinf_jax.loader import load_model
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision, linear, quantize

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def test_fp8_weights_use_cublaslt_fp8_gemm():
    x = jnp.ones((4096, 3840), jnp.bfloat16)
    w = quantize(jax.random.normal(jax.random.key(0), (15360, 3840)), Precision.FP8)
    assert "__cublas$lt$matmul$f8" in jax.jit(linear).lower(x, w).compile().as_text()


@pytest.mark.parametrize(("head_dim", "window"), [(512, None), (256, None), (256, 100), (128, None)])
def test_kernel_matches_reference(head_dim, window):
    t, block = 1024, 128
    positions = np.arange(t, dtype=np.int32) % 512
    span_end = np.where(np.arange(t) < 512, 512, t).astype(np.int32)  # two chains of 512
    start = np.repeat([0, 4], 4).astype(np.int32)
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (t, 8, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (t, 2, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (t, 2, head_dim), jnp.bfloat16)
    got = kernel(q, k, v, positions, span_end, start, scale=head_dim**-0.5, window=window, block=block)
    want = reference(q, k, v, positions, span_end, scale=head_dim**-0.5, window=window)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.02)


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "gemma4-e2b"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_scores_bit_identical_across_packing_and_buckets(family, precision):
    # Without row tiles this failed on the H200 (f32 GEMM and fused RMSNorm rows, and Qwen3 in bf16, differed
    # between 512- and 2,048-row programs); the default GPU row tile is what makes it pass.
    model = load_model(str(TINY / family), precision)
    questions = [QuestionKey((11, 12, 13), ((40,), (41,))), QuestionKey((14,) * 20, ((50, 51, 52), (53,)))]
    rng = np.random.default_rng(0)
    target = build_tree([2], rng.integers(5, 500, 300).tolist(), questions)
    others = [build_tree([2], rng.integers(5, 500, 100 + 57 * i).tolist(), questions) for i in range(6)]
    engine = Engine(model, Buckets((2048, 4096)))
    alone = engine.score_trees([target])[0].logprobs
    packed = engine.score_trees([*others, target])[-1].logprobs
    bigger = Engine(model, Buckets((4096,))).score_trees([target])[0].logprobs
    np.testing.assert_array_equal(packed, alone)
    np.testing.assert_array_equal(bigger, alone)
