"""Weights as `nnx.Param`s that say where they come from: each carries its Hugging Face tensor name (`source`)
and its `kind`, which decides the form it is kept in at a given precision. A family declares its Params once,
in its modules' constructors; the model is built abstractly (`nnx.eval_shape`) and loaders fill it."""

from enum import StrEnum

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.quant import Precision, QuantArray


class Kind(StrEnum):
    LINEAR = "linear"  # [out, in] projection: stored at the model precision (quantized for fp8 / int8)
    EMBED = "embed"  # [vocab, hidden] table, also the tied LM head: quantized per row like a linear
    NORM = "norm"  # norm scales and biases stay f32: tiny, and precision-sensitive
    BIAS = "bias"


def stored_as(kind: Kind, precision: Precision) -> Precision:
    """The form a weight is kept in when the model runs at `precision`."""
    if kind in (Kind.NORM, Kind.BIAS):
        return Precision.FP32
    if kind is Kind.EMBED and precision in (Precision.FP8, Precision.INT8):
        # The embedding doubles as the LM head, which runs only at the few positions read: bf16 costs little
        # time there, and per-row fp8 would move every logit by several percent.
        return Precision.BF16
    return precision


def weight(
    shape: tuple[int, ...], source: str, kind: Kind, precision: Precision, present: bool = True
) -> nnx.Param | None:
    """A Param of the given shape in its stored form, filled with zeros: build models under nnx.eval_shape,
    where this allocates nothing, then fill each Param from a checkpoint (spinf_jax.loader). A weight the
    configuration does not have (present=False) is None."""
    if not present:
        return None
    form = stored_as(kind, precision)
    if form in (Precision.FP32, Precision.BF16):
        value = jnp.zeros(shape, form.activation_dtype)
    else:
        values = jnp.zeros(shape, jnp.float8_e4m3fn if form is Precision.FP8 else jnp.int8)
        value = QuantArray(values, jnp.ones(shape[:1], jnp.float32))
    return nnx.Param(value, source=source, kind=kind)


def params(module: nnx.Module) -> list[nnx.Param]:
    """Every Param of a module and its submodules, in a fixed order."""
    return [v for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)]


def nbytes(module: nnx.Module) -> int:
    """Bytes the module's weights take in their stored form (abstract or loaded)."""
    leaves = jax.tree.leaves([p.get_value() for p in params(module)])
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)
