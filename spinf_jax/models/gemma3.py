"""Gemma 3 text decoder (google/gemma-3-*) as NNX modules over a packed tree batch.

What differs from Llama: RMSNorm scales by (1 + w); four norms per layer (before and after attention and
MLP) plus per-head q/k norms; queries scaled by query_pre_attn_scalar^-0.5; embeddings multiplied by
sqrt(hidden); sliding-window (local rope theta) and global (global rope theta, optional linear scaling)
layers; GeGLU (tanh gelu); tied embeddings.
"""

from dataclasses import dataclass
from functools import partial

import jax
from flax import nnx

from spinf_jax.models.decoder import Decoder
from spinf_jax.models.layers import (
    GLOBAL,
    SLIDING,
    Batch,
    Rope,
    apply_rope,
    attention,
    by_rows,
    embedding_scale,
    gated_mlp,
    gelu_tanh,
    rms_norm,
    split_heads,
)
from spinf_jax.models.params import Kind, layer_weight
from spinf_jax.quant import Precision, embed, linear, stacked_outputs


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_local: Rope
    rope_global: Rope
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None

    @staticmethod
    def from_hf(c: dict) -> "Config":
        c = c.get("text_config", c)
        n = c["num_hidden_layers"]
        pattern = c.get("sliding_window_pattern", 6)
        layer_types = c.get("layer_types") or [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
        # transformers 5 writes rope_parameters per layer type; older configs use rope_theta,
        # rope_local_base_freq and rope_scaling (which applies to the global layers only).
        rope = c.get("rope_parameters") or {}
        global_params = rope.get(GLOBAL) or {
            **(c.get("rope_scaling") or {}),
            "rope_theta": c.get("rope_theta"),
        }
        local_params = rope.get(SLIDING) or {"rope_theta": c.get("rope_local_base_freq")}
        if c.get("attn_logit_softcapping"):
            raise ValueError("attention logit softcapping (Gemma 2) is not supported by the Gemma 3 stack")
        return Config(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=n,
            num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            query_pre_attn_scalar=c["query_pre_attn_scalar"],
            sliding_window=c["sliding_window"],
            layer_types=tuple(layer_types),
            rope_local=Rope.from_hf({k: v for k, v in local_params.items() if v is not None}, 1e4),
            rope_global=Rope.from_hf({k: v for k, v in global_params.items() if v is not None}, 1e6),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=c.get("final_logit_softcapping"),
        )


class Layer(nnx.Module):
    """Layers `ids` (all of one type), their weights stacked (models.decoder.Stack)."""

    def __init__(self, cfg: Config, ids: tuple[int, ...], precision: Precision):
        d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        w = partial(layer_weight, ids, precision)

        self.cfg = cfg
        self.sliding = cfg.layer_types[ids[0]] == SLIDING
        self.input_norm = w((d,), "input_layernorm.weight", Kind.NORM)
        self.q = w((cfg.num_heads * hd, d), "self_attn.q_proj.weight", Kind.LINEAR)
        self.k = w((cfg.num_kv_heads * hd, d), "self_attn.k_proj.weight", Kind.LINEAR)
        self.v = w((cfg.num_kv_heads * hd, d), "self_attn.v_proj.weight", Kind.LINEAR)
        self.o = w((d, cfg.num_heads * hd), "self_attn.o_proj.weight", Kind.LINEAR)
        self.q_norm = w((hd,), "self_attn.q_norm.weight", Kind.NORM)
        self.k_norm = w((hd,), "self_attn.k_norm.weight", Kind.NORM)
        self.post_attn_norm = w((d,), "post_attention_layernorm.weight", Kind.NORM)
        self.pre_mlp_norm = w((d,), "pre_feedforward_layernorm.weight", Kind.NORM)
        self.gate = w((f, d), "mlp.gate_proj.weight", Kind.LINEAR)
        self.up = w((f, d), "mlp.up_proj.weight", Kind.LINEAR)
        self.down = w((d, f), "mlp.down_proj.weight", Kind.LINEAR)
        self.post_mlp_norm = w((d,), "post_feedforward_layernorm.weight", Kind.NORM)

    def __call__(self, x: jax.Array, batch: Batch, row_tile: int | None):
        """→ (the residual stream after this layer, the keys and values it attended with)."""
        cfg = self.cfg
        qkv = stacked_outputs(self.q.get_value(), self.k.get_value(), self.v.get_value())
        q, k, v = by_rows(partial(self._qkv, qkv), row_tile, x, batch.positions)
        scale, window = cfg.query_pre_attn_scalar**-0.5, cfg.sliding_window if self.sliding else None
        attn = attention(q, k, v, batch, scale=scale, window=window)
        return by_rows(self._after_attention, row_tile, x, attn), (k, v)

    def _qkv(self, qkv, x, positions):
        """Row-local: attention inputs [T, heads, head_dim] from the residual stream [T, hidden], through the
        q, k and v weights stacked (qkv)."""
        cfg = self.cfg
        rope = cfg.rope_local if self.sliding else cfg.rope_global
        h = _norm(x, self.input_norm, cfg)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
        q, k, v = split_heads(linear(h, qkv), heads, cfg.head_dim)
        q, k = _norm(q, self.q_norm, cfg), _norm(k, self.k_norm, cfg)
        return apply_rope(q, positions, rope), apply_rope(k, positions, rope), v

    def _after_attention(self, x, attn):
        """Row-local: output projection, MLP and residuals."""
        cfg = self.cfg
        x = x + _norm(linear(attn.reshape(x.shape[0], -1), self.o.get_value()), self.post_attn_norm, cfg)
        mlp = (self.gate.get_value(), self.up.get_value(), self.down.get_value())
        h = gated_mlp(_norm(x, self.pre_mlp_norm, cfg), *mlp, gelu_tanh)
        return x + _norm(h, self.post_mlp_norm, cfg)


class Gemma3(Decoder):
    Config = Config

    def __init__(self, cfg: Config, precision: Precision):
        make_layer = partial(Layer, cfg, precision=precision)
        types = list(cfg.layer_types)  # a sliding and a global layer differ in window and rope
        super().__init__(cfg, precision, make_layer, types, tied=True, softcap=cfg.final_logit_softcapping)

    def _embed(self, tokens):
        dtype = self.precision.activation_dtype
        return embed(tokens, self.embed.get_value(), dtype) * embedding_scale(self.config.hidden_size, dtype)

    def _final_norm(self, x):
        return _norm(x, self.final_norm, self.config)


def _norm(x, w: nnx.Param, cfg: Config):
    return rms_norm(x, w.get_value(), cfg.rms_norm_eps, style="gemma3")
