"""What the mixture-of-experts families share: top-k routing and the experts' weights. The computation is
pallas_kernels.moe.grouped: on GPUs every tile of a GEMM in one Pallas kernel, elsewhere a loop over tiles."""

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.moe import grouped, per_tile
from spinf_jax.models.params import Kind, layer_weight, weight
from spinf_jax.quant import Precision, grouped_linear, linear

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

    # True: the GPU path (the grouped kernel) on any machine, through Pallas' interpreter; for tests.
    interpret = False

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
        kernel = self.interpret or jax.default_backend() == "gpu"
        feed_forward = self.tiles if kernel else per_tile(self.expert)
        return grouped(x, index, weight, feed_forward, self.count, tile=TILE)

    def tiles(self, rows: jax.Array, tile_expert: jax.Array) -> jax.Array:
        """Every tile of rows [R, hidden] through its expert `tile_expert` [tiles] → [R, hidden] f32: each
        GEMM of `expert` one grouped kernel over all the tiles."""

        def gemm(x, param, out_dtype=None):
            return grouped_linear(x, tile_expert, param.get_value(), out_dtype, interpret=self.interpret)

        return self._feed_forward(rows, gemm)

    def expert(self, rows: jax.Array, e) -> jax.Array:
        """Expert e's feed-forward of rows [N, hidden] → [N, hidden] f32."""

        def gemm(x, param, out_dtype=None):
            pick = partial(jax.lax.dynamic_index_in_dim, index=e, keepdims=False)
            return linear(x, jax.tree.map(pick, param.get_value()), out_dtype)

        return self._feed_forward(rows, gemm)

    def _feed_forward(self, rows, gemm):
        """The gated feed-forward, gemm(x, weight param, out_dtype=None) doing each projection."""
        if self.gate_up is not None:
            gate, up = jnp.split(gemm(rows, self.gate_up), [self.inner], axis=-1)
        else:
            gate, up = gemm(rows, self.gate), gemm(rows, self.up)
        return gemm(self.activation(gate) * up, self.down, jnp.float32)
