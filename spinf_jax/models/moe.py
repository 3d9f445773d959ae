"""What the mixture-of-experts families share: top-k routing and the experts' weights (the computation is
pallas_kernels.moe.grouped)."""

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.moe import grouped
from spinf_jax.models.params import Kind, layer_weight, weight
from spinf_jax.quant import Precision, linear

# Rows of one expert a tile of the grouped computation holds: GEMMs of [TILE, hidden] on every backend.
TILE = 64


def route(probs: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """probs [T, experts] f32 → (the k most likely experts [T, k], their weights [T, k] f32), renormalised to
    sum to one when `normalize`. Row-local."""
    weight, index = jax.lax.top_k(probs, k)
    if normalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    return index, weight


class Experts(nnx.Module):
    """A layer stack's experts ([repeats, experts, ...]), a SwiGLU or GeGLU feed-forward each, as the
    checkpoint keeps them: `fused` (Gemma 4: `{prefix}.gate_up_proj` [E, 2·inner, hidden] and
    `{prefix}.down_proj` [E, hidden, inner] per layer) or one tensor per expert (Qwen:
    `{prefix}.{e}.gate_proj.weight`, ...)."""

    def __init__(self, ids: tuple[int, ...], precision: Precision, prefix: str, experts: int, top_k: int,
                 hidden: int, inner: int, *, fused: bool, activation):  # fmt: skip
        self.count, self.top_k, self.inner, self.activation = experts, top_k, inner, activation
        if fused:
            w = partial(layer_weight, ids, precision)
            self.gate_up = w((experts, 2 * inner, hidden), f"{prefix}.gate_up_proj", Kind.LINEAR)
            self.gate = self.up = None
            self.down = w((experts, hidden, inner), f"{prefix}.down_proj", Kind.LINEAR)
            return

        def w(shape, name):
            names = tuple(tuple(f"model.layers.{i}.{prefix}.{e}.{name}" for e in range(experts)) for i in ids)
            return weight(shape, names, Kind.LINEAR, precision)

        self.gate_up = None
        self.gate = w((inner, hidden), "gate_proj.weight")
        self.up = w((inner, hidden), "up_proj.weight")
        self.down = w((hidden, inner), "down_proj.weight")

    def __call__(self, x: jax.Array, index: jax.Array, weight: jax.Array) -> jax.Array:
        """x [T, hidden] through each token's experts `index` [T, k], weighted by `weight` [T, k] → [T,
        hidden] f32."""
        return grouped(x, index, weight, self.expert, self.count, tile=TILE)

    def expert(self, rows: jax.Array, e) -> jax.Array:
        """Expert e's feed-forward of rows [N, hidden] → [N, hidden] f32."""

        def pick(param):
            return jax.tree.map(
                lambda w: jax.lax.dynamic_index_in_dim(w, e, keepdims=False), param.get_value()
            )

        if self.gate_up is not None:
            gate, up = jnp.split(linear(rows, pick(self.gate_up)), [self.inner], axis=-1)
        else:
            gate, up = linear(rows, pick(self.gate)), linear(rows, pick(self.up))
        return linear(self.activation(gate) * up, pick(self.down), jnp.float32)
