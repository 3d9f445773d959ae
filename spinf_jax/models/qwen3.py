"""Qwen3 decoder, with Qwen2 and Llama as configuration variants of the same stack.

Qwen3: per-head RMSNorm on q and k before rope, GQA, no biases. Qwen2: Llama plus biases on q/k/v.
Llama (SmolLM2 among others): neither. RMSNorm scales by w after casting back; SwiGLU MLP.
"""

from dataclasses import dataclass
from functools import partial

import jax

from spinf_jax.models.layers import (
    Rope,
    TreeBatch,
    apply_rope,
    by_rows,
    gated_mlp,
    head_logits,
    head_token_logits,
    rms_norm,
    tree_attention,
)
from spinf_jax.models.params import Kind, Param
from spinf_jax.quant import Precision, embed, linear

FAMILIES = ("qwen3", "qwen2", "llama")


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope
    qk_norm: bool  # Qwen3
    qkv_bias: bool  # Qwen2 (and Llama/Qwen3 checkpoints with attention_bias)
    tie_embeddings: bool
    rms_norm_eps: float = 1e-6

    @staticmethod
    def from_hf(c: dict) -> "Config":
        family = c["model_type"]
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not one of {FAMILIES}")
        if c.get("use_sliding_window") or c.get("mlp_bias"):
            raise ValueError("sliding-window Qwen layers and MLP biases are not supported")
        rope = c.get("rope_parameters") or {
            **(c.get("rope_scaling") or {}),
            "rope_theta": c.get("rope_theta"),
        }
        return Config(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rope=Rope.from_hf({k: v for k, v in rope.items() if v is not None}, 1e4),
            qk_norm=family == "qwen3",
            qkv_bias=family == "qwen2" or bool(c.get("attention_bias")),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        )


def param_specs(cfg: Config) -> dict:
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        w = {
            "input_norm": Param((d,), p + "input_layernorm.weight", Kind.NORM),
            "q": Param((q_out, d), p + "self_attn.q_proj.weight", Kind.LINEAR),
            "k": Param((kv_out, d), p + "self_attn.k_proj.weight", Kind.LINEAR),
            "v": Param((kv_out, d), p + "self_attn.v_proj.weight", Kind.LINEAR),
            "o": Param((d, q_out), p + "self_attn.o_proj.weight", Kind.LINEAR),
            "post_attn_norm": Param((d,), p + "post_attention_layernorm.weight", Kind.NORM),
            "gate": Param((f, d), p + "mlp.gate_proj.weight", Kind.LINEAR),
            "up": Param((f, d), p + "mlp.up_proj.weight", Kind.LINEAR),
            "down": Param((d, f), p + "mlp.down_proj.weight", Kind.LINEAR),
        }
        if cfg.qk_norm:
            w["q_norm"] = Param((hd,), p + "self_attn.q_norm.weight", Kind.NORM)
            w["k_norm"] = Param((hd,), p + "self_attn.k_norm.weight", Kind.NORM)
        if cfg.qkv_bias:
            w["q_bias"] = Param((q_out,), p + "self_attn.q_proj.bias", Kind.BIAS)
            w["k_bias"] = Param((kv_out,), p + "self_attn.k_proj.bias", Kind.BIAS)
            w["v_bias"] = Param((kv_out,), p + "self_attn.v_proj.bias", Kind.BIAS)
        return w

    specs = {
        "embed": Param((cfg.vocab_size, d), "model.embed_tokens.weight", Kind.EMBED),
        "layers": [layer(i) for i in range(cfg.num_layers)],
        "final_norm": Param((d,), "model.norm.weight", Kind.NORM),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = Param((cfg.vocab_size, d), "lm_head.weight", Kind.EMBED)
    return specs


def _norm(x, w, cfg: Config):
    return rms_norm(x, w, cfg.rms_norm_eps, style="llama")


def _project(x, w, name: str, heads: int, cfg: Config):
    y = linear(x, w[name])
    if cfg.qkv_bias:
        y = y + w[name + "_bias"].astype(y.dtype)
    return y.reshape(x.shape[0], heads, cfg.head_dim)


def _qkv(x, positions, w, cfg: Config):
    """Row-local: attention inputs [T, heads, head_dim] from the residual stream [T, hidden]."""
    h = _norm(x, w["input_norm"], cfg)
    q = _project(h, w, "q", cfg.num_heads, cfg)
    k = _project(h, w, "k", cfg.num_kv_heads, cfg)
    v = _project(h, w, "v", cfg.num_kv_heads, cfg)
    if cfg.qk_norm:
        q, k = _norm(q, w["q_norm"], cfg), _norm(k, w["k_norm"], cfg)
    return apply_rope(q, positions, cfg.rope), apply_rope(k, positions, cfg.rope), v


def _after_attention(x, attn, w, cfg: Config):
    """Row-local: output projection, MLP and residuals."""
    x = x + linear(attn.reshape(x.shape[0], -1), w["o"])
    return x + gated_mlp(_norm(x, w["post_attn_norm"], cfg), w["gate"], w["up"], w["down"], jax.nn.silu)


def forward(
    params: dict, batch: TreeBatch, cfg: Config, precision: Precision, row_tile: int | None = None
) -> jax.Array:
    """Final hidden states [T, hidden] for every token of the pass (logits come from `logits`)."""
    x = by_rows(lambda t: embed(t, params["embed"], precision.activation_dtype), row_tile, batch.tokens)
    for w in params["layers"]:
        q, k, v = by_rows(partial(_qkv, w=w, cfg=cfg), row_tile, x, batch.positions)
        attn = tree_attention(q, k, v, batch, scale=cfg.head_dim**-0.5)
        x = by_rows(partial(_after_attention, w=w, cfg=cfg), row_tile, x, attn)
    return by_rows(lambda x: _norm(x, params["final_norm"], cfg), row_tile, x)


def _head(params: dict, cfg: Config):
    return params["embed"] if cfg.tie_embeddings else params["lm_head"]


def logits(params: dict, hidden: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden] → [N, vocab] f32 logits, only for the rows asked for."""
    return head_logits(hidden, _head(params, cfg), None)


def token_logits(params: dict, hidden: jax.Array, tokens: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden], [N] token ids → [N] f32: each row's logit for its one token."""
    return head_token_logits(hidden, _head(params, cfg), tokens, None)
