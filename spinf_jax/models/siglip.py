"""Gemma 3's vision tower: a SigLIP encoder over an image's patches, and the projector that pools them into
the soft tokens the text decoder reads in the image's place (transformers' SiglipVisionModel and
Gemma3MultiModalProjector).

The tower runs once per image, one image per call: its program has one shape, so an image's soft tokens are
the same bits whatever else a request or a pass holds.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.models.layers import gelu_tanh, rms_norm
from spinf_jax.models.params import Kind, weight
from spinf_jax.quant import Precision, linear

_TOWER = "model.vision_tower."
_PROJECTOR = "model.multi_modal_projector."


@dataclass(frozen=True)
class Config:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the square every image is resized to (preprocessing: spinf_jax.media)
    patch_size: int
    layer_norm_eps: float
    soft_tokens: int  # per image, after pooling
    text_hidden: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """Side of the square of patches averaged into one soft token."""
        return self.patches_per_side // round(self.soft_tokens**0.5)

    @staticmethod
    def from_hf(c: dict) -> "Config":
        v = c["vision_config"]
        if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision tower activation {v['hidden_act']!r} is not supported (gelu_pytorch_tanh)"
            )
        if v.get("vision_use_head"):
            raise ValueError("a SigLIP tower with its pooling head is not Gemma 3's (vision_use_head)")
        return Config(
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"],
            num_heads=v["num_attention_heads"],
            image_size=v["image_size"],
            patch_size=v["patch_size"],
            layer_norm_eps=v.get("layer_norm_eps", 1e-6),
            soft_tokens=c.get("mm_tokens_per_image", 256),
            text_hidden=c["text_config"]["hidden_size"],
        )


class VisionTower(nnx.Module):
    """Pixels [3, image_size, image_size] (normalised) → soft tokens [soft_tokens, text_hidden]."""

    def __init__(self, cfg: Config, precision: Precision):
        d, f, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
        self.config, self.precision = cfg, precision
        w = partial(weight, precision=precision)
        layers = tuple(range(cfg.num_layers))

        def layer(shape, name, kind=Kind.TOWER):  # every encoder layer's `name`, stacked [layers, *shape]
            return w(shape, tuple(f"{_TOWER}encoder.layers.{i}.{name}" for i in layers), kind)

        self.patch = w((d, 3, p, p), _TOWER + "embeddings.patch_embedding.weight", Kind.TOWER)
        self.patch_bias = w((d,), _TOWER + "embeddings.patch_embedding.bias", Kind.BIAS)
        self.position = w(
            (cfg.patches_per_side**2, d), _TOWER + "embeddings.position_embedding.weight", Kind.BIAS
        )
        self.norm1 = layer((d,), "layer_norm1.weight", Kind.NORM)
        self.norm1_bias = layer((d,), "layer_norm1.bias", Kind.NORM)
        self.q, self.k, self.v = (layer((d, d), f"self_attn.{n}_proj.weight") for n in "qkv")
        self.o = layer((d, d), "self_attn.out_proj.weight")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (
            layer((d,), f"self_attn.{n}.bias", Kind.BIAS) for n in ("q_proj", "k_proj", "v_proj", "out_proj")
        )
        self.norm2 = layer((d,), "layer_norm2.weight", Kind.NORM)
        self.norm2_bias = layer((d,), "layer_norm2.bias", Kind.NORM)
        self.fc1, self.fc2 = layer((f, d), "mlp.fc1.weight"), layer((d, f), "mlp.fc2.weight")
        self.fc1_bias, self.fc2_bias = (
            layer((f,), "mlp.fc1.bias", Kind.BIAS),
            layer((d,), "mlp.fc2.bias", Kind.BIAS),
        )
        self.final_norm = w((d,), _TOWER + "post_layernorm.weight", Kind.NORM)
        self.final_norm_bias = w((d,), _TOWER + "post_layernorm.bias", Kind.NORM)
        self.soft_norm = w((d,), _PROJECTOR + "mm_soft_emb_norm.weight", Kind.NORM)
        # Applied as x @ W, unlike every other projection ([in, out], as transformers keeps it).
        self.projection = w((d, cfg.text_hidden), _PROJECTOR + "mm_input_projection_weight", Kind.TOWER)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg, dtype = self.config, self.precision.activation_dtype
        x = self._patches(pixels.astype(dtype))  # [patches, hidden]
        per_layer = {name: getattr(self, name).get_value() for name in _LAYER_WEIGHTS}
        x, _ = jax.lax.scan(lambda x, ws: (self._layer(x, ws), None), x, per_layer)
        x = _layer_norm(x, self.final_norm.get_value(), self.final_norm_bias.get_value(), cfg.layer_norm_eps)
        # Average each pool × pool square of patches (row-major patch grid) into one soft token.
        side, pool = cfg.patches_per_side, cfg.pool
        x = x.astype(jnp.float32).reshape(side // pool, pool, side // pool, pool, -1).mean(axis=(1, 3))
        x = rms_norm(
            x.reshape(-1, cfg.hidden_size).astype(dtype), self.soft_norm.get_value(), 1e-6, style="gemma3"
        )
        return linear(x, _transposed(self.projection.get_value()))

    def _patches(self, pixels: jax.Array) -> jax.Array:
        """The patch embedding (a convolution with stride = kernel = patch, as a matmul) plus positions."""
        cfg = self.config
        side, p = cfg.patches_per_side, cfg.patch_size
        patches = pixels.reshape(3, side, p, side, p).transpose(1, 3, 0, 2, 4).reshape(side * side, 3 * p * p)
        kernel = self.patch.get_value().reshape(cfg.hidden_size, 3 * p * p)
        x = linear(patches, kernel) + self.patch_bias.get_value().astype(pixels.dtype)
        return x + self.position.get_value().astype(pixels.dtype)

    def _layer(self, x: jax.Array, ws: dict) -> jax.Array:
        """One pre-norm encoder layer: bidirectional attention over the image's patches, then the MLP."""
        cfg = self.config
        n, heads = x.shape[0], cfg.num_heads
        head_dim = cfg.hidden_size // heads
        h = _layer_norm(x, ws["norm1"], ws["norm1_bias"], cfg.layer_norm_eps)

        def project(name):  # [patches, heads, head_dim]
            return (linear(h, ws[name]) + ws[name + "_bias"].astype(x.dtype)).reshape(n, heads, head_dim)

        q, k, v = project("q"), project("k"), project("v")
        exact = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        scores = jnp.einsum("qhd,khd->hqk", q, k, precision=exact, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * head_dim**-0.5, axis=-1).astype(x.dtype)
        attn = jnp.einsum("hqk,khd->qhd", probs, v, precision=exact, preferred_element_type=jnp.float32)
        x = x + linear(attn.astype(x.dtype).reshape(n, -1), ws["o"]) + ws["o_bias"].astype(x.dtype)
        h = _layer_norm(x, ws["norm2"], ws["norm2_bias"], cfg.layer_norm_eps)
        h = gelu_tanh(linear(h, ws["fc1"]) + ws["fc1_bias"].astype(x.dtype))
        return x + linear(h, ws["fc2"]) + ws["fc2_bias"].astype(x.dtype)


# The encoder layers' Params (each stacked over the layers) that VisionTower._layer reads, by attribute name.
_LAYER_WEIGHTS = (
    "norm1", "norm1_bias", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias",
    "norm2", "norm2_bias", "fc1", "fc2", "fc1_bias", "fc2_bias",
)  # fmt: skip


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm in f32, cast back to x's dtype (torch's LayerNorm in bf16 computes in f32 too)."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _transposed(w):
    """The projector's [in, out] weight as the [out, in] every linear takes."""
    return w.T
