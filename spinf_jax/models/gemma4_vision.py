"""Gemma 4's vision tower: an encoder over an image's patches at their own (x, y) grid positions, the pooling
of k × k patches into one soft token, and the projection into the text decoder's width (transformers'
Gemma4VisionModel and the `embed_vision` Gemma4MultimodalEmbedder).

What differs from Gemma 3's SigLIP: the image keeps its aspect ratio, so it has as many patches as fit its
shape within a budget and as many soft tokens (spinf_jax.media.PatchedImages pads every image's patches to
the budget, so the tower has one program and an image's soft tokens do not depend on any other image); the
patch positions index two learned tables (x and y) and rotate queries and keys by a 2-D rope (the first half
of each head by x, the second by y); layers are Gemma 4's text layers in miniature (q/k/v RMS norms,
attention scale 1, norms before and after attention and MLP, a gated GELU MLP); linears may clip their inputs
and outputs to bounds stored in the checkpoint (`use_clipped_linears`); pooled soft tokens are scaled by
sqrt(hidden) and, with `standardize`, shifted and scaled per channel.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.models.layers import Rope, apply_rope, gelu_tanh, rms_norm
from spinf_jax.models.params import Kind, weight
from spinf_jax.quant import Precision, linear

_TOWER = "model.vision_tower."
_EMBED = "model.embed_vision."
_CLIPS = ("input_min", "input_max", "output_min", "output_max")


@dataclass(frozen=True)
class Config:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    patch_size: int
    pool: int  # pooling_kernel_size: the side of the square of patches averaged into one soft token
    positions: int  # position_embedding_size: rows of each of the x and y tables
    rope_theta: float
    rms_norm_eps: float
    clipped: bool  # use_clipped_linears
    standardize: bool
    text_hidden: int

    @staticmethod
    def from_hf(c: dict) -> "Config":
        v = c["vision_config"]
        if v.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision tower activation {v['hidden_activation']!r} is not supported")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4 vision rope {rope['rope_type']!r} is not supported (axial)")
        if v.get("attention_bias"):
            raise ValueError("a Gemma 4 vision tower with attention biases is not supported")
        heads = v.get("num_attention_heads", 12)
        return Config(
            hidden_size=v.get("hidden_size", 768),
            intermediate_size=v.get("intermediate_size", 3072),
            num_layers=v.get("num_hidden_layers", 16),
            num_heads=heads,
            kv_heads=v.get("num_key_value_heads") or heads,
            head_dim=v.get("head_dim", 64),
            patch_size=v.get("patch_size", 16),
            pool=v.get("pooling_kernel_size", 3),
            positions=v.get("position_embedding_size", 10240),
            rope_theta=rope.get("rope_theta", 100.0),
            rms_norm_eps=v.get("rms_norm_eps", 1e-6),
            clipped=bool(v.get("use_clipped_linears", False)),
            standardize=bool(v.get("standardize", False)),
            text_hidden=c["text_config"]["hidden_size"],
        )


class VisionTower(nnx.Module):
    """Patches [P, 3 · patch²] in [0, 1] (row, column, channel within a patch) and their grid positions
    [P, 2] (x, y; -1 for padding) → [P / pool², text_hidden]: the image's soft tokens first (as many as its
    real patches / pool²), then rows that stand for padding."""

    def __init__(self, cfg: Config, precision: Precision):
        d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        heads, kv = cfg.num_heads, cfg.kv_heads
        self.config, self.precision = cfg, precision
        w = partial(weight, precision=precision)
        layers = tuple(range(cfg.num_layers))

        def layer(shape, name, kind=Kind.TOWER, present=True):  # stacked [layers, *shape]
            names = tuple(f"{_TOWER}encoder.layers.{i}.{name}" for i in layers)
            return w(shape, names, kind, present=present)

        self.patch = w((d, 3 * cfg.patch_size**2), _TOWER + "patch_embedder.input_proj.weight", Kind.TOWER)
        table = _TOWER + "patch_embedder.position_embedding_table"  # [x or y, position, hidden]
        self.position = w((2, cfg.positions, d), table, Kind.BIAS)
        self.input_norm = layer((d,), "input_layernorm.weight", Kind.NORM)
        self.post_attn_norm = layer((d,), "post_attention_layernorm.weight", Kind.NORM)
        self.pre_mlp_norm = layer((d,), "pre_feedforward_layernorm.weight", Kind.NORM)
        self.post_mlp_norm = layer((d,), "post_feedforward_layernorm.weight", Kind.NORM)
        self.q_norm = layer((hd,), "self_attn.q_norm.weight", Kind.NORM)
        self.k_norm = layer((hd,), "self_attn.k_norm.weight", Kind.NORM)
        shapes = {
            "q": ("self_attn.q_proj", (heads * hd, d)),
            "k": ("self_attn.k_proj", (kv * hd, d)),
            "v": ("self_attn.v_proj", (kv * hd, d)),
            "o": ("self_attn.o_proj", (d, heads * hd)),
            "gate": ("mlp.gate_proj", (f, d)),
            "up": ("mlp.up_proj", (f, d)),
            "down": ("mlp.down_proj", (d, f)),
        }
        assert tuple(shapes) == _LINEARS
        for name, (module, shape) in shapes.items():
            setattr(self, name, layer(shape, module + ".linear.weight"))
            # Each linear's clip bounds: four scalars per layer, [layers, 4] in _CLIPS' order.
            bounds = [layer((), f"{module}.{b}", Kind.NORM, cfg.clipped) for b in _CLIPS]
            setattr(self, name + "_clip", None if not cfg.clipped else nnx.List(bounds))
        self.std_bias = w((d,), _TOWER + "std_bias", Kind.NORM, present=cfg.standardize)
        self.std_scale = w((d,), _TOWER + "std_scale", Kind.NORM, present=cfg.standardize)
        self.projection = w((cfg.text_hidden, d), _EMBED + "embedding_projection.weight", Kind.TOWER)

    def __call__(self, patches: jax.Array, positions: jax.Array) -> jax.Array:
        cfg, dtype = self.config, self.precision.activation_dtype
        padding = jnp.all(positions == -1, axis=-1)  # [P]
        # transformers maps the processor's [0, 1] pixels to [-1, 1] inside the model.
        x = linear((2.0 * (patches.astype(jnp.float32) - 0.5)).astype(dtype), self.patch.get_value())
        x = x + self._positions(positions, padding).astype(dtype)
        names = _LAYER_WEIGHTS + (tuple(f"{n}_clip" for n in _LINEARS) if cfg.clipped else ())
        per_layer = {name: self._stacked(name) for name in names}
        x, _ = jax.lax.scan(lambda x, ws: (self._layer(x, ws, positions, padding), None), x, per_layer)
        soft = self._pool(x, positions, padding)  # [P / pool², hidden] f32
        if cfg.standardize:
            soft = (soft - self.std_bias.get_value()) * self.std_scale.get_value()
        soft = rms_norm(soft.astype(dtype), None, cfg.rms_norm_eps, style="gemma4")
        return linear(soft, self.projection.get_value())

    def _stacked(self, name: str):
        value = getattr(self, name)
        if isinstance(value, nnx.List):  # a linear's clip bounds → [layers, 4]
            return jnp.stack([b.get_value() for b in value], axis=-1)
        return value.get_value()

    def _positions(self, positions: jax.Array, padding: jax.Array) -> jax.Array:
        """[P, hidden] f32: the x table's row plus the y table's; zero for padding."""
        table = self.position.get_value()
        at = jnp.maximum(positions, 0)
        embedded = table[0][at[:, 0]] + table[1][at[:, 1]]
        return jnp.where(padding[:, None], 0.0, embedded)

    def _layer(self, x: jax.Array, ws: dict, positions: jax.Array, padding: jax.Array) -> jax.Array:
        """One encoder layer: attention over every real patch of the image (both ways), then the MLP."""
        cfg, n = self.config, x.shape[0]

        def project(name, h, shape=None):
            y = _clipped_linear(h, ws[name], ws.get(name + "_clip"))
            return y if shape is None else y.reshape(n, *shape)

        def norm(h, w):
            return rms_norm(h, w, cfg.rms_norm_eps, style="gemma4")

        h = norm(x, ws["input_norm"])
        q = _rope_2d(norm(project("q", h, (cfg.num_heads, cfg.head_dim)), ws["q_norm"]), positions, cfg)
        k = _rope_2d(norm(project("k", h, (cfg.kv_heads, cfg.head_dim)), ws["k_norm"]), positions, cfg)
        v = norm(project("v", h, (cfg.kv_heads, cfg.head_dim)), None)
        group = cfg.num_heads // cfg.kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        exact = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        scores = jnp.einsum("qhd,khd->hqk", q, k, precision=exact, preferred_element_type=jnp.float32)
        scores = jnp.where(padding[None, None, :], -jnp.inf, scores)  # scale 1: the q/k norms scale
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attn = jnp.einsum("hqk,khd->qhd", probs, v, precision=exact, preferred_element_type=jnp.float32)
        x = x + norm(project("o", attn.astype(x.dtype).reshape(n, -1)), ws["post_attn_norm"])
        h = norm(x, ws["pre_mlp_norm"])
        h = project("down", gelu_tanh(project("gate", h)) * project("up", h))
        return x + norm(h, ws["post_mlp_norm"])

    def _pool(self, x: jax.Array, positions: jax.Array, padding: jax.Array) -> jax.Array:
        """[P, hidden] → [P / pool², hidden] f32, × sqrt(hidden): each soft token the mean of its pool × pool
        square of patches, numbered row-major over the image's grid of squares (so an image's soft tokens
        are the first rows; padding patches count as zeros in row 0's mean, as in transformers)."""
        cfg, k = self.config, self.config.pool
        at = jnp.maximum(positions, 0) // k  # [P, 2]: the square a patch falls in
        squares_wide = (jnp.max(jnp.maximum(positions[:, 0], 0)) + 1) // k
        index = at[:, 0] + squares_wide * at[:, 1]
        weights = jax.nn.one_hot(index, x.shape[0] // k**2, dtype=jnp.float32) / k**2  # [P, P / pool²]
        x = jnp.where(padding[:, None], 0.0, x)
        pooled = jnp.einsum("pt,pd->td", weights, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        # transformers rounds the mean to the tower's dtype before scaling in f32.
        return pooled.astype(x.dtype).astype(jnp.float32) * cfg.hidden_size**0.5


# The encoder layers' weights (each stacked over the layers) that VisionTower._layer reads, by attribute name;
# with clipped linears, also each linear's bounds ("q_clip", ...).
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
_NORMS = ("input_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")
_LAYER_WEIGHTS = (*_NORMS, *_LINEARS)


def _clipped_linear(x: jax.Array, w, clip: jax.Array | None) -> jax.Array:
    """linear, with a clipped linear's input and output clamped to its bounds [4] (_CLIPS' order)."""
    if clip is None:
        return linear(x, w)
    clip = clip.astype(x.dtype)
    y = linear(jnp.clip(x, clip[0], clip[1]), w)
    return jnp.clip(y, clip[2], clip[3])


def _rope_2d(x: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """x [P, heads, head_dim]: the first half of each head rotated by the patch's x, the second by its y,
    each half as a rotate-half rope of its own width."""
    half = cfg.head_dim // 2
    rope = Rope(cfg.rope_theta)
    return jnp.concatenate(
        [apply_rope(x[..., :half], positions[:, 0], rope), apply_rope(x[..., half:], positions[:, 1], rope)],
        axis=-1,
    )
