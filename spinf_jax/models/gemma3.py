"""Gemma 3 text decoder (google/gemma-3-*), as a plain forward function over a packed tree batch.

What differs from Llama: RMSNorm scales by (1 + w); four norms per layer (before and after attention and
MLP) plus per-head q/k norms; queries scaled by query_pre_attn_scalar^-0.5; embeddings multiplied by
sqrt(hidden); sliding-window (local rope theta) and global (global rope theta, optional linear scaling)
layers; GeGLU (tanh gelu); tied embeddings.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from spinf_jax.models.layers import (
    Rope,
    TreeBatch,
    apply_rope,
    embedding_scale,
    gated_mlp,
    gelu_tanh,
    rms_norm,
    tree_attention,
)
from spinf_jax.models.params import Kind, Param
from spinf_jax.quant import Precision, embed, linear

SLIDING, GLOBAL = "sliding_attention", "full_attention"


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


def param_specs(cfg: Config) -> dict:
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        return {
            "input_norm": Param((d,), p + "input_layernorm.weight", Kind.NORM),
            "q": Param((cfg.num_heads * hd, d), p + "self_attn.q_proj.weight", Kind.LINEAR),
            "k": Param((cfg.num_kv_heads * hd, d), p + "self_attn.k_proj.weight", Kind.LINEAR),
            "v": Param((cfg.num_kv_heads * hd, d), p + "self_attn.v_proj.weight", Kind.LINEAR),
            "o": Param((d, cfg.num_heads * hd), p + "self_attn.o_proj.weight", Kind.LINEAR),
            "q_norm": Param((hd,), p + "self_attn.q_norm.weight", Kind.NORM),
            "k_norm": Param((hd,), p + "self_attn.k_norm.weight", Kind.NORM),
            "post_attn_norm": Param((d,), p + "post_attention_layernorm.weight", Kind.NORM),
            "pre_mlp_norm": Param((d,), p + "pre_feedforward_layernorm.weight", Kind.NORM),
            "gate": Param((f, d), p + "mlp.gate_proj.weight", Kind.LINEAR),
            "up": Param((f, d), p + "mlp.up_proj.weight", Kind.LINEAR),
            "down": Param((d, f), p + "mlp.down_proj.weight", Kind.LINEAR),
            "post_mlp_norm": Param((d,), p + "post_feedforward_layernorm.weight", Kind.NORM),
        }

    return {
        "embed": Param((cfg.vocab_size, d), "model.embed_tokens.weight", Kind.EMBED),
        "layers": [layer(i) for i in range(cfg.num_layers)],
        "final_norm": Param((d,), "model.norm.weight", Kind.NORM),
    }


def _norm(x, w, cfg: Config):
    return rms_norm(x, w, cfg.rms_norm_eps, plus_one=True)


def _attention(x, w, batch: TreeBatch, cfg: Config, layer_type: str):
    t = x.shape[0]
    q = _norm(linear(x, w["q"]).reshape(t, cfg.num_heads, cfg.head_dim), w["q_norm"], cfg)
    k = _norm(linear(x, w["k"]).reshape(t, cfg.num_kv_heads, cfg.head_dim), w["k_norm"], cfg)
    v = linear(x, w["v"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    sliding = layer_type == SLIDING
    rope = cfg.rope_local if sliding else cfg.rope_global
    q, k = apply_rope(q, batch.positions, rope), apply_rope(k, batch.positions, rope)
    scale, window = cfg.query_pre_attn_scalar**-0.5, cfg.sliding_window if sliding else None
    out = tree_attention(q, k, v, batch, scale=scale, window=window)
    return linear(out.reshape(t, -1), w["o"])


def forward(params: dict, batch: TreeBatch, cfg: Config, precision: Precision) -> jax.Array:
    """Final hidden states [T, hidden] for every token of the pass (logits come from `logits`)."""
    dtype = precision.activation_dtype
    x = embed(batch.tokens, params["embed"], dtype) * embedding_scale(cfg.hidden_size, dtype)
    for w, layer_type in zip(params["layers"], cfg.layer_types, strict=True):
        h = _attention(_norm(x, w["input_norm"], cfg), w, batch, cfg, layer_type)
        x = x + _norm(h, w["post_attn_norm"], cfg)
        h = gated_mlp(_norm(x, w["pre_mlp_norm"], cfg), w["gate"], w["up"], w["down"], gelu_tanh)
        x = x + _norm(h, w["post_mlp_norm"], cfg)
    return _norm(x, params["final_norm"], cfg)


def logits(params: dict, hidden: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden] → [N, vocab] f32 logits through the tied embedding, only for the rows asked for."""
    out = linear(hidden, params["embed"], jnp.float32)
    if cfg.final_logit_softcapping:
        out = jnp.tanh(out / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return out
