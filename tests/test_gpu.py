"""Checks that only mean something on a GPU (CI has none; run `pytest tests/test_gpu.py` on the H200).

The CPU versions of the same properties are tested elsewhere: the kernel in interpret mode
(test_tree_attention), invariance of the CPU path (test_layout, test_engine)."""

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tree_attention_mosaic
from pallas_kernels.gated_delta import tree_chunked
from pallas_kernels.tree_attention import kernel, reference
from spinf_jax import fingerprint
from spinf_jax.decision_apis import DecisionApis
from spinf_jax.engine import Engine
from spinf_jax.layout import build_tree
from spinf_jax.loader import load_model
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision, linear, quantize
from tests import engines
from tests.test_gated_delta import _inputs, _packed_pass
from tests.test_tree_attention import same_rows_in_every_layout
from tests.trees import POOL, lay_out
from tests.typed_pool import POOL as DECISION_POOL
from tests.typed_pool import SHORT

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def test_fp8_weights_use_cublaslt_fp8_gemm():
    x = jnp.ones((4096, 3840), jnp.bfloat16)
    w = quantize(jax.random.normal(jax.random.key(0), (15360, 3840)), Precision.FP8)
    assert "__cublas$lt$matmul$f8" in jax.jit(linear).lower(x, w).compile().as_text()


KERNELS = {"triton": kernel, "mosaic": tree_attention_mosaic.kernel}


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize(("head_dim", "window"), [(512, None), (256, None), (256, 100), (128, None)])
def test_kernel_matches_reference(impl, head_dim, window):
    # A 600-token chain, then a tree of a 300-token trunk and every question of the pool (tries, a long and
    # an empty template), at the engine's block size.
    if impl == "mosaic" and not tree_attention_mosaic.supports(jnp.bfloat16, head_dim):
        pytest.skip(f"the Mosaic kernel does not take head_dim {head_dim}")
    chain = build_tree([2], list(range(5, 605)), [])
    branched = build_tree([2], list(range(5, 305)), POOL)
    (positions, span_end, trunk_end, branch_start, start), _ = lay_out([chain, branched], 128, 10)
    t = positions.shape[0]
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (t, 8, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (t, 2, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (t, 2, head_dim), jnp.bfloat16)
    args = (q, k, v, positions, span_end)
    attend = KERNELS[impl]
    got = attend(*args, trunk_end, branch_start, start, scale=head_dim**-0.5, window=window, block=128)
    want = reference(*args, scale=head_dim**-0.5, window=window)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.02)


@pytest.mark.parametrize(
    "attend",
    [kernel, partial(tree_attention_mosaic.kernel, slots=1), partial(tree_attention_mosaic.kernel, slots=2)],
    ids=["triton", "mosaic-1-slot", "mosaic-2-slots"],
)
def test_kernel_rows_bit_identical_whatever_the_companions(attend):
    """On the GPU at Gemma 3's head size: every companion layout, at 64- and 128-row blocks, with trees on
    block boundaries and on 8-row boundaries off them (the Mosaic kernel copies trunk tiles in 8-row
    units; the packer puts trees on 16-row boundaries)."""
    placements = ((64, 64, 0), (128, 128, 0), (64, 8, 5))
    same_rows_in_every_layout(attend, placements, rows=256, tol=2e-2, d=256, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "family", ["gemma3", "qwen3", "gemma4-e2b", "qwen3_5", "qwen3_moe", "gemma4-moe", "qwen3_5_moe"]
)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_scores_bit_identical_across_packing_buckets_and_companions(family, precision):
    # Without row tiles this failed on the H200 (f32 GEMM and fused RMSNorm rows, and Qwen3 in bf16, differed
    # between 512- and 2,048-row programs); the default GPU row tile is what makes it pass. Without the
    # separate branch part of attention, the companion check failed (questions at other offsets).
    model = load_model(str(TINY / family), precision)
    rng = np.random.default_rng(0)
    content = rng.integers(5, 500, 300).tolist()
    target = build_tree([2], content, POOL)
    others = [build_tree([2], rng.integers(5, 500, 100 + 57 * i).tolist(), POOL[i:]) for i in range(6)]
    engine = Engine(model, Buckets((4096, 8192)))
    alone = engine.score_trees([target])[0]
    packed = engine.score_trees([*others, target])[-1].logprobs
    bigger = Engine(model, Buckets((8192,))).score_trees([target])[0].logprobs
    # The GPUs' 64-row block (packer.default_block) gives the bits of 128-row blocks: the kernel counts its
    # key tiles from the tree's first row, not from the block.
    in_128 = Engine(model, Buckets((4096,), block=128)).score_trees([*others[:3], target])[-1].logprobs
    np.testing.assert_array_equal(packed, alone.logprobs)
    np.testing.assert_array_equal(bigger, alone.logprobs)
    np.testing.assert_array_equal(in_128, alone.logprobs)
    for seed in range(4):  # a random subset of the questions, in a random order, with other trees around
        order = np.random.default_rng(seed).permutation(len(POOL))[: 2 + seed * 3]
        subset = build_tree([2], content, [POOL[i] for i in order])
        scored = engine.score_trees([others[seed], subset, others[seed + 1]])[1]
        for j, i in enumerate(order):
            np.testing.assert_array_equal(scored.option_logprobs(j), alone.option_logprobs(i))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "gemma4-e2b", "qwen3_5", "gemma4-moe", "qwen3_5_moe"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_decision_answers_bit_identical_whatever_else_is_asked(family, precision):
    """System One's answers on the GPU's programs: any subset of the questions, in another order, under other
    ids, alone or second in a batch, keeps every bit of the whole pool's answers."""
    apis = DecisionApis(engines.with_bytes(family, precision, sizes=(4096, 8192), block=64))
    base = apis.systemone({"state": SHORT, "questions": DECISION_POOL})["answers"]
    names = list(DECISION_POOL)
    for seed in range(4):
        order = np.random.default_rng(seed).permutation(len(names))[: 1 + seed % len(names)]
        asked = {f"id {seed}-{i}": DECISION_POOL[names[i]] for i in order}
        batch = {"states": ["Other text, longer than the first." * (seed + 1), SHORT], "questions": asked}
        reply = (
            apis.systemone_batch(batch)["results"][1]
            if seed % 2
            else apis.systemone(batch | {"state": SHORT})
        )
        for qid, i in zip(asked, order, strict=True):
            assert reply["answers"][qid] == base[names[i]], (qid, names[i])


@pytest.mark.parametrize("width", [4, 32])
def test_the_gated_delta_wave_kernel_is_the_waves_arithmetic(width):
    """The Triton wave kernel (gated_delta.wave_kernel) compiled for the GPU at Qwen3.5's head shape (keys
    and values of 128, two blocks of value columns): the XLA waves' outputs and handed-over states to f32
    rounding, over a packed pass of two trees (test_gated_delta's)."""
    p, _ = _packed_pass()
    inputs = _inputs(9, p.size, h=4, dk=128, dv=128)[:5]
    table = (jnp.asarray(p.span_end), jnp.asarray(p.chunks))
    slots = len(p.export_rows)
    want_o, want_states = tree_chunked(*inputs, *table, exports=slots, width=width)
    o, states = tree_chunked(*inputs, *table, exports=slots, width=width, kernel=True)
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states, want_states, rtol=1e-4, atol=1e-5)


def test_the_fingerprint_names_the_cuda_libraries():
    """On a GPU the fingerprint's parts hold what XLA calls below jax: the driver's and the CUDA libraries'
    versions as loaded, and the jax CUDA plugin's."""
    named = fingerprint.parts(jax.devices()[0], {"model": "m"})
    assert named["backend"] == "gpu" and "cpu" not in named
    for library in ("cuda_driver", "cuda_runtime", "cublas", "cudnn"):
        assert named[library].isdigit() and int(named[library]) > 0, (library, named)
    assert any(name.startswith("jax-cuda") for name in named), named
