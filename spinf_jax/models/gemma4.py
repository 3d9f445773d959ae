"""Gemma 4 text decoder (google/gemma-4-*), dense variants, as NNX modules over a packed tree batch.

What differs from Gemma 3: RMSNorm scales by w (not 1 + w) and v gets a weightless RMSNorm; attention scale 1
(q/k norms do the scaling); sliding layers (local rope, head_dim 256 in the real models) and global layers
(their own head_dim, 512, and kv-head count, and "proportional" rope that rotates a quarter of the pairs);
`attention_k_eq_v`: global layers use the k projection as v; the last `num_kv_shared_layers` layers compute
no keys or values and read those of the last earlier layer of their type (in a tree pass: the same rows of
the same pass), and may have a double-width MLP; per-layer input embeddings (E2B/E4B): a second embedding
table plus a projection of the input embedding give every layer a small extra input, gated into the
residual stream after its MLP; a learned scalar per layer; final logit softcapping.

The MoE variant (`enable_moe_block`, 26B-A4B) runs a mixture of experts beside every layer's dense MLP: the
router reads the stream before the MLP (a weightless RMSNorm, × its own scale and hidden^-0.5), picks each
token's top `top_k_experts` of `num_experts`, renormalises their probabilities and multiplies them by a
learned scale per expert; the experts (GeGLU, fused gate_up tensors) read the stream through their own norm;
the dense MLP's and the experts' outputs are each normed, summed, and normed again (spinf_jax.models.moe).
"""

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.models.decoder import Decoder, with_media
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
from spinf_jax.models.moe import Experts, route
from spinf_jax.models.params import Kind, layer_weight, weight
from spinf_jax.quant import Precision, embed, linear, stacked_outputs


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
    per_layer_vocab: int  # 0 without per-layer inputs (configs still carry a vocabulary size for them)
    tie_embeddings: bool
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    # An image's rows see the whole image (both ways) on sliding layers; global layers stay causal
    # (use_bidirectional_attention "vision"; transformers' create_masks_for_vision_model).
    images_both_ways: bool = False
    pad_id: int = 0  # an image row's per-layer input is the pad token's
    experts: int = 0  # the MoE variant: experts beside every layer's MLP (0: none)
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @staticmethod
    def from_hf(c: dict) -> "Config":
        tied = c.get("tie_word_embeddings", True)
        c = c.get("text_config", c)
        moe = bool(c.get("enable_moe_block"))
        bidirectional = c.get("use_bidirectional_attention")
        if bidirectional == "all" or c.get("attention_bias"):
            raise ValueError("bidirectional Gemma 4 text attention and attention biases are not supported")
        n, per_layer = c["num_hidden_layers"], c.get("hidden_size_per_layer_input") or 0
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
            per_layer_size=per_layer,
            per_layer_vocab=(c.get("vocab_size_per_layer_input") or c["vocab_size"]) if per_layer else 0,
            tie_embeddings=bool(c.get("tie_word_embeddings", tied)),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=c.get("final_logit_softcapping"),
            images_both_ways=bidirectional == "vision",
            pad_id=c.get("pad_token_id") or 0,
            experts=c["num_experts"] if moe else 0,
            top_k_experts=c["top_k_experts"] if moe else 0,
            moe_intermediate_size=c["moe_intermediate_size"] if moe else 0,
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


class Layer(nnx.Module):
    """Layers `ids` (of one signature: Gemma4.signature), their weights stacked (models.decoder.Stack)."""

    def __init__(self, cfg: Config, ids: tuple[int, ...], precision: Precision):
        i = ids[0]
        d, hd, kv = cfg.hidden_size, cfg.head_dims[i], cfg.kv_heads[i]
        self.cfg, self.head_dim, self.kv_heads = cfg, hd, kv
        self.sliding = cfg.layer_types[i] == SLIDING
        shared = cfg.kv_source(i) != i
        f = cfg.intermediate_size * (2 if shared and cfg.double_wide_mlp else 1)
        w = partial(layer_weight, ids, precision)

        self.input_norm = w((d,), "input_layernorm.weight", Kind.NORM)
        self.q = w((cfg.num_heads * hd, d), "self_attn.q_proj.weight", Kind.LINEAR)
        self.q_norm = w((hd,), "self_attn.q_norm.weight", Kind.NORM)
        self.o = w((d, cfg.num_heads * hd), "self_attn.o_proj.weight", Kind.LINEAR)
        self.post_attn_norm = w((d,), "post_attention_layernorm.weight", Kind.NORM)
        self.pre_mlp_norm = w((d,), "pre_feedforward_layernorm.weight", Kind.NORM)
        self.gate = w((f, d), "mlp.gate_proj.weight", Kind.LINEAR)
        self.up = w((f, d), "mlp.up_proj.weight", Kind.LINEAR)
        self.down = w((d, f), "mlp.down_proj.weight", Kind.LINEAR)
        self.post_mlp_norm = w((d,), "post_feedforward_layernorm.weight", Kind.NORM)
        self.scalar = w((1,), "layer_scalar", Kind.NORM)
        # A KV-shared layer has no k/v projections; a k_eq_v global layer has no v projection.
        self.k = w((kv * hd, d), "self_attn.k_proj.weight", Kind.LINEAR, not shared)
        self.k_norm = w((hd,), "self_attn.k_norm.weight", Kind.NORM, not shared)
        self.v = w((kv * hd, d), "self_attn.v_proj.weight", Kind.LINEAR, not shared and not cfg.v_is_k(i))
        pl = cfg.per_layer_size
        self.pl_gate = w((pl, d), "per_layer_input_gate.weight", Kind.LINEAR, pl > 0)
        self.pl_proj = w((d, pl), "per_layer_projection.weight", Kind.LINEAR, pl > 0)
        self.pl_norm = w((d,), "post_per_layer_input_norm.weight", Kind.NORM, pl > 0)
        e = cfg.experts
        self.router = w((e, d), "router.proj.weight", Kind.ROUTER, e > 0)
        self.router_scale = w((d,), "router.scale", Kind.NORM, e > 0)
        self.expert_scale = w((e,), "router.per_expert_scale", Kind.NORM, e > 0)
        self.mlp_out_norm = w((d,), "post_feedforward_layernorm_1.weight", Kind.NORM, e > 0)
        self.experts_in_norm = w((d,), "pre_feedforward_layernorm_2.weight", Kind.NORM, e > 0)
        self.experts_out_norm = w((d,), "post_feedforward_layernorm_2.weight", Kind.NORM, e > 0)
        inner = cfg.moe_intermediate_size
        self.experts = (
            Experts(
                ids, precision, "experts", e, cfg.top_k_experts, d, inner, fused=True, activation=gelu_tanh
            )
            if e
            else None
        )

    def __call__(self, x, batch: Batch, row_tile: int | None, per_layer, shared_kv):
        """→ (the residual stream after this layer, the keys and values it computed, or None for a KV-shared
        layer). shared_kv: for a KV-shared layer, its source layer's (keys, values), else None; per_layer:
        its [T, P] input or None."""
        projections = [w.get_value() for w in (self.q, self.k, self.v) if w is not None]
        q, k, v = by_rows(partial(self._qkv, stacked_outputs(*projections)), row_tile, x, batch.positions)
        own = k is not None
        if not own:
            k, v = shared_kv
        window = self.cfg.sliding_window if self.sliding else None
        both_ways = self.sliding and self.cfg.images_both_ways
        attn = attention(q, k, v, batch, scale=1.0, window=window, media_both_ways=both_ways)
        extra = () if per_layer is None else (per_layer,)
        if self.experts is None:
            return by_rows(self._after_attention, row_tile, x, attn, *extra), (k, v) if own else None
        x, mlp, h, probs = by_rows(self._before_experts, row_tile, x, attn)
        index, weight = route(probs, self.cfg.top_k_experts, normalize=True)
        weight = weight * self.expert_scale.get_value()[index]
        experts = self.experts(h, index, weight).astype(x.dtype)
        return by_rows(self._after_experts, row_tile, x, mlp, experts, *extra), (k, v) if own else None

    def _qkv(self, qkv, x, positions):
        """Row-local: queries [T, H, hd] and, unless this layer reads another layer's, keys and values,
        through its projections stacked (qkv: q, and k and v where it has them)."""
        cfg, hd = self.cfg, self.head_dim
        rope = cfg.rope_local if self.sliding else cfg.rope_global
        h = _norm(x, self.input_norm, cfg)
        kv_counts = [] if self.k is None else [self.kv_heads] * (1 if self.v is None else 2)
        q, *kv = split_heads(linear(h, qkv), (cfg.num_heads, *kv_counts), hd)
        q = apply_rope(_norm(q, self.q_norm, cfg), positions, rope)
        if self.k is None:
            return q, None, None
        k, v = kv if self.v is not None else (kv[0], kv[0])
        k = apply_rope(_norm(k, self.k_norm, cfg), positions, rope)
        return q, k, _norm(v, None, cfg)

    def _after_attention(self, x, attn, per_layer=None):
        """Row-local: output projection, MLP, the per-layer input, residuals and the layer scalar."""
        x = self._attention_out(x, attn)
        return self._finish(x, self._mlp(x), per_layer)

    def _attention_out(self, x, attn):
        return x + _norm(
            linear(attn.reshape(x.shape[0], -1), self.o.get_value()), self.post_attn_norm, self.cfg
        )

    def _mlp(self, x):
        mlp = (self.gate.get_value(), self.up.get_value(), self.down.get_value())
        return gated_mlp(_norm(x, self.pre_mlp_norm, self.cfg), *mlp, gelu_tanh)

    def _before_experts(self, x, attn):
        """Row-local, MoE variant: the stream after attention, the dense MLP's normed output, the experts'
        input and the router's probabilities [T, experts] f32."""
        cfg = self.cfg
        x = self._attention_out(x, attn)
        routed = _norm(x, None, cfg) * self.router_scale.get_value().astype(x.dtype) * cfg.hidden_size**-0.5
        probs = jax.nn.softmax(linear(routed.astype(x.dtype), self.router.get_value(), jnp.float32), axis=-1)
        return x, _norm(self._mlp(x), self.mlp_out_norm, cfg), _norm(x, self.experts_in_norm, cfg), probs

    def _after_experts(self, x, mlp, experts, per_layer=None):
        """Row-local, MoE variant: the experts' output normed and added to the MLP's, then as _finish."""
        return self._finish(x, mlp + _norm(experts, self.experts_out_norm, self.cfg), per_layer)

    def _finish(self, x, h, per_layer):
        """Row-local: the feed-forward output h normed into the residual stream, the per-layer input, and
        the layer scalar."""
        cfg = self.cfg
        x = x + _norm(h, self.post_mlp_norm, cfg)
        if per_layer is not None:
            h = linear(gelu_tanh(linear(x, self.pl_gate.get_value())) * per_layer, self.pl_proj.get_value())
            x = x + _norm(h, self.pl_norm, cfg)
        return x * self.scalar.get_value().astype(x.dtype)


class Gemma4(Decoder):
    Config = Config

    def __init__(self, cfg: Config, precision: Precision):
        make_layer = partial(Layer, cfg, precision=precision)
        signatures = [self.signature(cfg, i) for i in range(cfg.num_layers)]
        tied, softcap = cfg.tie_embeddings, cfg.final_logit_softcapping
        super().__init__(cfg, precision, make_layer, signatures, tied=tied, softcap=softcap)
        pl, width = cfg.per_layer_size, cfg.num_layers * cfg.per_layer_size

        def w(shape, name, kind):  # the per-layer input weights, in E2B/E4B only
            return weight(shape, "model." + name, kind, precision, present=pl > 0)

        self.pl_embed = w((cfg.per_layer_vocab, width), "embed_tokens_per_layer.weight", Kind.EMBED)
        self.pl_model_proj = w((width, cfg.hidden_size), "per_layer_model_projection.weight", Kind.LINEAR)
        self.pl_proj_norm = w((pl,), "per_layer_projection_norm.weight", Kind.NORM)

    @staticmethod
    def signature(cfg: Config, i: int) -> tuple:
        """What layer i's program depends on: its type, shapes, and the layer whose keys it reads."""
        source = cfg.kv_source(i)
        return cfg.layer_types[i], cfg.head_dims[i], cfg.kv_heads[i], None if source == i else source

    @staticmethod
    def _call_layer(layer, x, batch, row_tile, per_layer, shared_kv):
        return layer(x, batch, row_tile, per_layer, shared_kv)

    def kv_source(self, i: int) -> int:
        return self.config.kv_source(i)

    def _inputs(self, tokens, soft=None, is_media=None):
        """Row-local: the input embedding [T, hidden] (media rows': their soft tokens) and, with per-layer
        inputs, every layer's [T, L, P]: from the input embedding, and the token's own table (the pad
        token's at a media row, as transformers reads them)."""
        cfg, dtype = self.config, self.precision.activation_dtype
        x = embed(tokens, self.embed.get_value(), dtype) * embedding_scale(cfg.hidden_size, dtype)
        x = with_media(x, soft, is_media)
        if not cfg.per_layer_size:
            return x, None
        if is_media is not None:
            tokens = jnp.where(is_media, cfg.pad_id, tokens)
        shape = (tokens.shape[0], cfg.num_layers, cfg.per_layer_size)
        projected = linear(x, self.pl_model_proj.get_value()) * cfg.hidden_size**-0.5
        projected = _norm(projected.reshape(shape), self.pl_proj_norm, cfg)
        identity = embed(tokens, self.pl_embed.get_value(), dtype)
        identity = identity * embedding_scale(cfg.per_layer_size, dtype)
        return x, (projected + identity.reshape(shape)) * math.sqrt(0.5)

    def _final_norm(self, x):
        return _norm(x, self.final_norm, self.config)


def _norm(x, w: nnx.Param | None, cfg: Config):
    return rms_norm(x, None if w is None else w.get_value(), cfg.rms_norm_eps, style="gemma4")
