"""Gemma 3 text decoder (google/gemma-3-*), as a plain forward function over a packed tree batch.

What differs from Llama: RMSNorm scales by (1 + w); four norms per layer (before and after attention and
MLP) plus per-head q/k norms; queries scaled by query_pre_attn_scalar^-0.5; embeddings multiplied by
sqrt(hidden); sliding-window (local rope theta) and global (global rope theta, optional linear scaling)
layers; GeGLU (tanh gelu); tied embeddings.
"""

from dataclasses import dataclass
from functools import partial

import jax

from spinf_jax.models.layers import (
    GLOBAL,
    SLIDING,
    Rope,
    TreeBatch,
    apply_rope,
    by_rows,
    embedding_scale,
    gated_mlp,
    gelu_tanh,
    head_logits,
    head_token_logits,
    rms_norm,
    tree_attention,
)
from spinf_jax.models.params import Kind, Param
from spinf_jax.quant import Precision, embed, linear


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
    return rms_norm(x, w, cfg.rms_norm_eps, style="gemma3")


def _qkv(x, positions, w, cfg: Config, rope: Rope):
    """Row-local: attention inputs [T, heads, head_dim] from the residual stream [T, hidden]."""
    t = x.shape[0]
    h = _norm(x, w["input_norm"], cfg)
    q = _norm(linear(h, w["q"]).reshape(t, cfg.num_heads, cfg.head_dim), w["q_norm"], cfg)
    k = _norm(linear(h, w["k"]).reshape(t, cfg.num_kv_heads, cfg.head_dim), w["k_norm"], cfg)
    v = linear(h, w["v"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, positions, rope), apply_rope(k, positions, rope), v


def _after_attention(x, attn, w, cfg: Config):
    """Row-local: output projection, MLP and residuals."""
    x = x + _norm(linear(attn.reshape(x.shape[0], -1), w["o"]), w["post_attn_norm"], cfg)
    h = gated_mlp(_norm(x, w["pre_mlp_norm"], cfg), w["gate"], w["up"], w["down"], gelu_tanh)
    return x + _norm(h, w["post_mlp_norm"], cfg)


def forward(
    params: dict, batch: TreeBatch, cfg: Config, precision: Precision, row_tile: int | None = None
) -> jax.Array:
    """Final hidden states [T, hidden] for every token of the pass (logits come from `logits`)."""
    dtype = precision.activation_dtype
    x = by_rows(
        lambda t: embed(t, params["embed"], dtype) * embedding_scale(cfg.hidden_size, dtype),
        row_tile,
        batch.tokens,
    )
    for w, layer_type in zip(params["layers"], cfg.layer_types, strict=True):
        sliding = layer_type == SLIDING
        rope = cfg.rope_local if sliding else cfg.rope_global
        q, k, v = by_rows(partial(_qkv, w=w, cfg=cfg, rope=rope), row_tile, x, batch.positions)
        scale, window = cfg.query_pre_attn_scalar**-0.5, cfg.sliding_window if sliding else None
        attn = tree_attention(q, k, v, batch, scale=scale, window=window)
        x = by_rows(partial(_after_attention, w=w, cfg=cfg), row_tile, x, attn)
    return by_rows(lambda x: _norm(x, params["final_norm"], cfg), row_tile, x)


def logits(params: dict, hidden: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden] → [N, vocab] f32 logits through the tied embedding, only for the rows asked for."""
    return head_logits(hidden, params["embed"], cfg.final_logit_softcapping)


def token_logits(params: dict, hidden: jax.Array, tokens: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden], [N] token ids → [N] f32: each row's logit for its one token."""
    return head_token_logits(hidden, params["embed"], tokens, cfg.final_logit_softcapping)
