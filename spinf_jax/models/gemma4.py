"""Gemma 4 text decoder (google/gemma-4-*), dense variants: a plain forward function over a packed tree batch.

What differs from Gemma 3: RMSNorm scales by w (not 1 + w) and v gets a weightless RMSNorm; attention scale 1
(q/k norms do the scaling); sliding layers (local rope, head_dim 256 in the real models) and global layers
(their own head_dim, 512, and kv-head count, and "proportional" rope that rotates a quarter of the pairs);
`attention_k_eq_v`: global layers use the k projection as v; the last `num_kv_shared_layers` layers compute
no keys or values and read those of the last earlier layer of their type (in a tree pass: the same rows of
the same pass), and may have a double-width MLP; per-layer input embeddings (E2B/E4B): a second embedding
table plus a projection of the input embedding give every layer a small extra input, gated into the
residual stream after its MLP; a learned scalar per layer; final logit softcapping.

The MoE variant (enable_moe_block, 26B-A4B) is not supported: loading it is refused with a clear error.
"""

import math
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
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer: sliding and global layers differ
    kv_heads: tuple[int, ...]  # per layer
    sliding_window: int
    rope_local: Rope
    rope_global: Rope
    k_eq_v: bool  # global layers: v is the k projection (before k's norm and rope)
    num_kv_shared_layers: int
    double_wide_mlp: bool  # KV-shared layers have a 2x intermediate size
    per_layer_size: int  # per-layer input width (0: none)
    per_layer_vocab: int
    tie_embeddings: bool
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @staticmethod
    def from_hf(c: dict) -> "Config":
        tied = c.get("tie_word_embeddings", True)
        c = c.get("text_config", c)
        if c.get("enable_moe_block"):
            raise ValueError(
                "Gemma 4 MoE (enable_moe_block, e.g. 26B-A4B) is not supported yet; dense models are"
            )
        if c.get("use_bidirectional_attention") == "all" or c.get("attention_bias"):
            raise ValueError("bidirectional Gemma 4 text attention and attention biases are not supported")
        n = c["num_hidden_layers"]
        layer_types = list(c.get("layer_types") or [SLIDING if (i + 1) % 6 else GLOBAL for i in range(n)])
        layer_types = tuple(layer_types[:-1] + [GLOBAL])  # transformers makes the last layer global, always
        k_eq_v = bool(c.get("attention_k_eq_v", False))
        # transformers writes per_layer_config (overrides by layer index); Google's configs carry
        # global_head_dim and num_global_key_value_heads (the latter applies with attention_k_eq_v only).
        overrides = {int(i): o for i, o in (c.get("per_layer_config") or {}).items()}
        if not overrides:
            default = {"head_dim": c.get("global_head_dim", 512)}
            if k_eq_v and c.get("num_global_key_value_heads"):
                default["num_key_value_heads"] = c["num_global_key_value_heads"]
            overrides = {i: default for i, t in enumerate(layer_types) if t == GLOBAL}
        kv = c.get("num_key_value_heads") or c["num_attention_heads"]
        rope = c.get("rope_parameters") or {}
        local = rope.get(SLIDING) or {"rope_type": "default", "rope_theta": 1e4}
        glob = rope.get(GLOBAL) or {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e6,
        }
        return Config(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_heads=c["num_attention_heads"],
            layer_types=layer_types,
            head_dims=tuple(overrides.get(i, {}).get("head_dim", c["head_dim"]) for i in range(n)),
            kv_heads=tuple(overrides.get(i, {}).get("num_key_value_heads", kv) for i in range(n)),
            sliding_window=c["sliding_window"],
            rope_local=Rope.from_hf(local, 1e4),
            rope_global=Rope.from_hf(glob, 1e6),
            k_eq_v=k_eq_v,
            num_kv_shared_layers=c.get("num_kv_shared_layers") or 0,
            double_wide_mlp=bool(c.get("use_double_wide_mlp", False)),
            per_layer_size=c.get("hidden_size_per_layer_input") or 0,
            per_layer_vocab=c.get("vocab_size_per_layer_input") or c["vocab_size"],
            tie_embeddings=bool(c.get("tie_word_embeddings", tied)),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=c.get("final_logit_softcapping"),
        )

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends with: itself, or for a KV-shared layer the last
        layer of its type before the shared ones."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if i < first_shared:
            return i
        return max(j for j in range(first_shared) if self.layer_types[j] == self.layer_types[i])

    def v_is_k(self, i: int) -> bool:
        return self.k_eq_v and self.layer_types[i] == GLOBAL


def param_specs(cfg: Config) -> dict:
    d, p = cfg.hidden_size, "model."  # a multimodal checkpoint's text weights are found one level down

    def layer(i: int) -> dict:
        n, hd, kv = f"{p}layers.{i}.", cfg.head_dims[i], cfg.kv_heads[i]
        shared = cfg.kv_source(i) != i
        f = cfg.intermediate_size * (2 if shared and cfg.double_wide_mlp else 1)
        w = {
            "input_norm": Param((d,), n + "input_layernorm.weight", Kind.NORM),
            "q": Param((cfg.num_heads * hd, d), n + "self_attn.q_proj.weight", Kind.LINEAR),
            "q_norm": Param((hd,), n + "self_attn.q_norm.weight", Kind.NORM),
            "o": Param((d, cfg.num_heads * hd), n + "self_attn.o_proj.weight", Kind.LINEAR),
            "post_attn_norm": Param((d,), n + "post_attention_layernorm.weight", Kind.NORM),
            "pre_mlp_norm": Param((d,), n + "pre_feedforward_layernorm.weight", Kind.NORM),
            "gate": Param((f, d), n + "mlp.gate_proj.weight", Kind.LINEAR),
            "up": Param((f, d), n + "mlp.up_proj.weight", Kind.LINEAR),
            "down": Param((d, f), n + "mlp.down_proj.weight", Kind.LINEAR),
            "post_mlp_norm": Param((d,), n + "post_feedforward_layernorm.weight", Kind.NORM),
            "scalar": Param((1,), n + "layer_scalar", Kind.NORM),
        }
        if not shared:
            w["k"] = Param((kv * hd, d), n + "self_attn.k_proj.weight", Kind.LINEAR)
            w["k_norm"] = Param((hd,), n + "self_attn.k_norm.weight", Kind.NORM)
            if not cfg.v_is_k(i):
                w["v"] = Param((kv * hd, d), n + "self_attn.v_proj.weight", Kind.LINEAR)
        if cfg.per_layer_size:
            w["pl_gate"] = Param((cfg.per_layer_size, d), n + "per_layer_input_gate.weight", Kind.LINEAR)
            w["pl_proj"] = Param((d, cfg.per_layer_size), n + "per_layer_projection.weight", Kind.LINEAR)
            w["pl_norm"] = Param((d,), n + "post_per_layer_input_norm.weight", Kind.NORM)
        return w

    specs = {
        "embed": Param((cfg.vocab_size, d), p + "embed_tokens.weight", Kind.EMBED),
        "layers": [layer(i) for i in range(cfg.num_layers)],
        "final_norm": Param((d,), p + "norm.weight", Kind.NORM),
    }
    if cfg.per_layer_size:
        width = cfg.num_layers * cfg.per_layer_size
        specs["pl_embed"] = Param(
            (cfg.per_layer_vocab, width), p + "embed_tokens_per_layer.weight", Kind.EMBED
        )
        specs["pl_model_proj"] = Param((width, d), p + "per_layer_model_projection.weight", Kind.LINEAR)
        specs["pl_proj_norm"] = Param(
            (cfg.per_layer_size,), p + "per_layer_projection_norm.weight", Kind.NORM
        )
    if not cfg.tie_embeddings:
        specs["lm_head"] = Param((cfg.vocab_size, d), "lm_head.weight", Kind.EMBED)
    return specs


def _norm(x, w, cfg: Config):
    return rms_norm(x, w, cfg.rms_norm_eps, style="gemma4")


def _embed(tokens, params, cfg: Config, dtype):
    """Row-local: the input embedding [T, hidden] and, with per-layer inputs, every layer's [T, L, P]."""
    x = embed(tokens, params["embed"], dtype) * embedding_scale(cfg.hidden_size, dtype)
    if not cfg.per_layer_size:
        return x, None
    shape = (tokens.shape[0], cfg.num_layers, cfg.per_layer_size)
    projected = linear(x, params["pl_model_proj"]) * cfg.hidden_size**-0.5
    projected = _norm(projected.reshape(shape), params["pl_proj_norm"], cfg)
    identity = embed(tokens, params["pl_embed"], dtype) * embedding_scale(cfg.per_layer_size, dtype)
    return x, (projected + identity.reshape(shape)) * math.sqrt(0.5)


def _qkv(x, positions, w, cfg: Config, i: int):
    """Row-local: queries [T, H, hd] and, unless layer i reads another layer's, keys and values [T, K, hd]."""
    t, hd = x.shape[0], cfg.head_dims[i]
    rope = cfg.rope_local if cfg.layer_types[i] == SLIDING else cfg.rope_global
    h = _norm(x, w["input_norm"], cfg)
    q = apply_rope(_norm(linear(h, w["q"]).reshape(t, cfg.num_heads, hd), w["q_norm"], cfg), positions, rope)
    if "k" not in w:
        return q, None, None
    k = linear(h, w["k"]).reshape(t, cfg.kv_heads[i], hd)
    v = k if cfg.v_is_k(i) else linear(h, w["v"]).reshape(t, cfg.kv_heads[i], hd)
    k = apply_rope(_norm(k, w["k_norm"], cfg), positions, rope)
    return q, k, _norm(v, None, cfg)


def _after_attention(x, attn, per_layer=None, *, w, cfg: Config):
    """Row-local: output projection, MLP, the per-layer input, residuals and the layer scalar."""
    x = x + _norm(linear(attn.reshape(x.shape[0], -1), w["o"]), w["post_attn_norm"], cfg)
    h = gated_mlp(_norm(x, w["pre_mlp_norm"], cfg), w["gate"], w["up"], w["down"], gelu_tanh)
    x = x + _norm(h, w["post_mlp_norm"], cfg)
    if per_layer is not None:
        h = linear(gelu_tanh(linear(x, w["pl_gate"])) * per_layer, w["pl_proj"])
        x = x + _norm(h, w["pl_norm"], cfg)
    return x * w["scalar"].astype(x.dtype)


def forward(
    params: dict, batch: TreeBatch, cfg: Config, precision: Precision, row_tile: int | None = None
) -> jax.Array:
    """Final hidden states [T, hidden] for every token of the pass (logits come from `logits`)."""
    dtype = precision.activation_dtype
    x, per_layer = by_rows(partial(_embed, params=params, cfg=cfg, dtype=dtype), row_tile, batch.tokens)
    kv = {}  # layer index → its (keys, values), for KV-shared layers (XLA frees what no later layer reads)
    for i, w in enumerate(params["layers"]):
        q, k, v = by_rows(partial(_qkv, w=w, cfg=cfg, i=i), row_tile, x, batch.positions)
        if k is None:
            k, v = kv[cfg.kv_source(i)]
        kv[i] = k, v
        window = cfg.sliding_window if cfg.layer_types[i] == SLIDING else None
        attn = tree_attention(q, k, v, batch, scale=1.0, window=window)
        rows = (x, attn) if per_layer is None else (x, attn, per_layer[:, i])
        x = by_rows(partial(_after_attention, w=w, cfg=cfg), row_tile, *rows)
    return by_rows(lambda x: _norm(x, params["final_norm"], cfg), row_tile, x)


def _head(params: dict):
    return params.get("lm_head", params["embed"])


def logits(params: dict, hidden: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden] → [N, vocab] f32 logits, softcapped, only for the rows asked for."""
    return head_logits(hidden, _head(params), cfg.final_logit_softcapping)


def token_logits(params: dict, hidden: jax.Array, tokens: jax.Array, cfg: Config) -> jax.Array:
    """[N, hidden], [N] token ids → [N] f32: each row's logit for its one token."""
    return head_token_logits(hidden, _head(params), tokens, cfg.final_logit_softcapping)
