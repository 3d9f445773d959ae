"""Weights are described once per family as a tree of `Param`s; loaders fill that tree from a checkpoint."""

from dataclasses import dataclass
from enum import StrEnum

import jax
import jax.numpy as jnp

from spinf_jax.quant import Precision, QuantArray


class Kind(StrEnum):
    LINEAR = "linear"  # [out, in] projection: stored at the model precision (quantized for fp8 / int8)
    EMBED = "embed"  # [vocab, hidden] table, also the tied LM head: quantized per row like a linear
    NORM = "norm"  # norm scales and biases stay f32: tiny, and precision-sensitive
    BIAS = "bias"


@dataclass(frozen=True)
class Param:
    shape: tuple[int, ...]
    source: str  # tensor name in a Hugging Face checkpoint
    kind: Kind


def is_param(x) -> bool:
    return isinstance(x, Param)


def stored_as(p: Param, precision: Precision) -> Precision:
    """The form a weight is kept in when the model runs at `precision`."""
    if p.kind in (Kind.NORM, Kind.BIAS):
        return Precision.FP32
    if p.kind is Kind.EMBED and precision in (Precision.FP8, Precision.INT8):
        # The embedding doubles as the LM head, which runs only at the few positions read: bf16 costs little
        # time there, and per-row fp8 would move every logit by several percent.
        return Precision.BF16
    return precision


def abstract(specs, precision: Precision):
    """The loaded weights' shapes and dtypes, without loading anything (jax.ShapeDtypeStruct leaves)."""

    def leaf(p: Param):
        form = stored_as(p, precision)
        if form in (Precision.FP32, Precision.BF16):
            return jax.ShapeDtypeStruct(p.shape, form.activation_dtype)
        values = jnp.float8_e4m3fn if form is Precision.FP8 else jnp.int8
        scale = jax.ShapeDtypeStruct(p.shape[:1], jnp.float32)
        return QuantArray(jax.ShapeDtypeStruct(p.shape, values), scale)

    return jax.tree.map(leaf, specs, is_leaf=is_param)


def nbytes(specs, precision: Precision) -> int:
    leaves = jax.tree.leaves(abstract(specs, precision))
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)
