"""Weights as `nnx.Param`s that say where they come from: each carries its Hugging Face tensor name (`source`)
and its `kind`, which decides the form it is kept in at a given precision. A family declares its Params once,
in its modules' constructors; the model is built abstractly (`nnx.eval_shape`) and loaders fill it."""

from enum import StrEnum
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.quant import Precision, QuantArray


class Kind(StrEnum):
    LINEAR = "linear"  # [out, in] projection: stored at the model precision (quantized for fp8 / int8)
    EMBED = "embed"  # [vocab, hidden] table, also the tied LM head: quantized per row like a linear
    NORM = "norm"  # norm scales and biases stay f32: tiny, and precision-sensitive
    BIAS = "bias"
    # A mixture of experts' router [experts, hidden]: small, and it picks the experts, so it stays in the
    # activation dtype (bf16 at fp8 / int8) rather than move a token to another expert by rounding.
    ROUTER = "router"
    # A media encoder's matrices (spinf_jax.models.siglip): bf16 at fp8 / int8. It runs once per image, a
    # small share of the work, and its rounding would reach every soft token of the image.
    TOWER = "tower"


def stored_as(kind: Kind, precision: Precision) -> Precision:
    """The form a weight is kept in when the model runs at `precision`."""
    if kind in (Kind.NORM, Kind.BIAS):
        return Precision.FP32
    if kind in (Kind.ROUTER, Kind.TOWER) and precision in (Precision.FP8, Precision.INT8):
        return Precision.BF16
    if kind is Kind.EMBED and precision in (Precision.FP8, Precision.INT8):
        # The embedding doubles as the LM head, which runs only at the few positions read: bf16 costs little
        # time there, and per-row fp8 would move every logit by several percent.
        return Precision.BF16
    return precision


def weight(
    shape: tuple[int, ...], source: str | tuple, kind: Kind, precision: Precision, present: bool = True
) -> nnx.Param | None:
    """A Param of the given shape in its stored form, filled with zeros: build models under nnx.eval_shape,
    where this allocates nothing, then fill each Param from a checkpoint (spinf_jax.loader). A weight the
    configuration does not have (present=False) is None.

    source: the checkpoint tensor's name, or a tuple of names for the same weight of several layers, stacked
    along a new leading axis ([len(source), *shape]: models.decoder.Stack scans over it); tuples of tuples
    stack twice (a stack of layers' experts, each its own tensor: [layers, experts, *shape])."""
    if not present:
        return None
    shape = (*stacked_shape(source), *shape)
    form = stored_as(kind, precision)
    if form in (Precision.FP32, Precision.BF16):
        value = jnp.zeros(shape, form.activation_dtype)
    else:
        values = jnp.zeros(shape, jnp.float8_e4m3fn if form is Precision.FP8 else jnp.int8)
        value = QuantArray(values, jnp.ones(shape[:-1], jnp.float32))
    return nnx.Param(value, source=source, kind=kind)


def layer_weight(
    ids: tuple, precision: Precision, shape: tuple[int, ...], name: str, kind: Kind, present: bool = True
) -> nnx.Param | None:
    """Weight `name` of layers `ids` (Hugging Face's model.layers.{i}.name), stacked [len(ids), *shape]."""
    return weight(shape, tuple(f"model.layers.{i}.{name}" for i in ids), kind, precision, present)


def stacked_shape(source: str | tuple) -> tuple[int, ...]:
    """The leading axes a Param's stacked sources add: () for one tensor, (layers,), (layers, experts)."""
    return (len(source), *stacked_shape(source[0])) if isinstance(source, tuple) else ()


def sources(param: nnx.Param) -> tuple[str, ...]:
    """The checkpoint tensors a Param holds, in the order of its stacked axes."""
    return tuple(name for name, _ in per_source(param, None))


def per_source(param: nnx.Param, value) -> list[tuple[str, object]]:
    """A Param's value (or one shaped like it, or None) as (checkpoint name, that tensor's part) pairs."""
    return _per_source(param.source, value)


def _per_source(source: str | tuple, value) -> list[tuple[str, object]]:
    if not isinstance(source, tuple):
        return [(source, value)]
    parts = [None if value is None else jax.tree.map(partial(_layer, i=i), value) for i in range(len(source))]
    return [pair for name, part in zip(source, parts, strict=True) for pair in _per_source(name, part)]


def _layer(a, i: int):
    if isinstance(a, jax.ShapeDtypeStruct):  # an abstract model's
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[i]


def params(module: nnx.Module) -> list[nnx.Param]:
    """Every Param of a module and its submodules, in a fixed order."""
    return [v for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)]


def nbytes(module: nnx.Module) -> int:
    """Bytes the module's weights take in their stored form (abstract or loaded)."""
    leaves = jax.tree.leaves([p.get_value() for p in params(module)])
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)
