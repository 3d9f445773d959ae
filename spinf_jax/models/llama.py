"""The Llama-architecture decoders as NNX modules: Llama itself (SmolLM2 among others), Qwen2, Qwen3 and Qwen3
MoE, which differ only in configuration.

Llama: RMSNorm scales by w after casting back; SwiGLU MLP; GQA; no biases. Qwen2: Llama plus biases on q/k/v.
Qwen3: Llama plus a per-head RMSNorm on q and k before rope. Qwen3 MoE: Qwen3 whose MLPs (every
`decoder_sparse_step`-th layer, except `mlp_only_layers`) are mixtures of SwiGLU experts: a router's softmax
picks each token's top `num_experts_per_tok` (renormalised with `norm_topk_prob`), their outputs weighted by
those probabilities (spinf_jax.models.moe).
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.models.decoder import Decoder
from spinf_jax.models.layers import (
    Batch,
    Rope,
    apply_rope,
    attention,
    by_rows,
    gated_mlp,
    rms_norm,
    split_heads,
)
from spinf_jax.models.moe import Experts, route
from spinf_jax.models.params import Kind, layer_weight
from spinf_jax.quant import Precision, linear, stacked_outputs

MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe")


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int
    inner: int  # each expert's intermediate size
    normalize: bool  # renormalise the top-k probabilities to sum to one
    sparse: tuple[bool, ...]  # per layer: experts (True) or a dense MLP


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
    moe: MoE | None = None

    @staticmethod
    def from_hf(c: dict) -> "Config":
        model_type = c["model_type"]
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
        if c.get("use_sliding_window") or c.get("mlp_bias"):
            raise ValueError("sliding-window Qwen layers and MLP biases are not supported")
        rope = c.get("rope_parameters") or {
            **(c.get("rope_scaling") or {}),
            "rope_theta": c.get("rope_theta"),
        }
        layers, moe = c["num_hidden_layers"], None
        experts = c.get("num_experts", c.get("num_local_experts", 0))  # transformers 5 writes the second
        if model_type == "qwen3_moe" and experts > 0:
            dense, step = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step", 1)
            sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
            moe = MoE(experts, c["num_experts_per_tok"], c["moe_intermediate_size"],
                      bool(c.get("norm_topk_prob", False)), sparse)  # fmt: skip
        return Config(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=layers,
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rope=Rope.from_hf({k: v for k, v in rope.items() if v is not None}, 1e4),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias")),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            moe=moe,
        )

    def sparse(self, i: int) -> bool:
        return self.moe is not None and self.moe.sparse[i]


class Layer(nnx.Module):
    """Layers `ids`, their weights stacked (models.decoder.Stack)."""

    def __init__(self, cfg: Config, ids: tuple[int, ...], precision: Precision):
        d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        w = partial(layer_weight, ids, precision)

        self.cfg = cfg
        self.input_norm = w((d,), "input_layernorm.weight", Kind.NORM)
        self.q = w((q_out, d), "self_attn.q_proj.weight", Kind.LINEAR)
        self.k = w((kv_out, d), "self_attn.k_proj.weight", Kind.LINEAR)
        self.v = w((kv_out, d), "self_attn.v_proj.weight", Kind.LINEAR)
        self.o = w((d, q_out), "self_attn.o_proj.weight", Kind.LINEAR)
        self.post_attn_norm = w((d,), "post_attention_layernorm.weight", Kind.NORM)
        sparse = cfg.sparse(ids[0])
        self.gate = w((f, d), "mlp.gate_proj.weight", Kind.LINEAR, not sparse)
        self.up = w((f, d), "mlp.up_proj.weight", Kind.LINEAR, not sparse)
        self.down = w((d, f), "mlp.down_proj.weight", Kind.LINEAR, not sparse)
        moe = cfg.moe
        self.router = w((moe.experts, d), "mlp.gate.weight", Kind.ROUTER) if sparse else None
        self.experts = (
            Experts(
                ids,
                precision,
                "mlp.experts",
                moe.experts,
                moe.top_k,
                d,
                moe.inner,
                fused=False,
                activation=jax.nn.silu,
            )
            if sparse
            else None
        )
        self.q_norm = w((hd,), "self_attn.q_norm.weight", Kind.NORM, cfg.qk_norm)
        self.k_norm = w((hd,), "self_attn.k_norm.weight", Kind.NORM, cfg.qk_norm)
        self.q_bias = w((q_out,), "self_attn.q_proj.bias", Kind.BIAS, cfg.qkv_bias)
        self.k_bias = w((kv_out,), "self_attn.k_proj.bias", Kind.BIAS, cfg.qkv_bias)
        self.v_bias = w((kv_out,), "self_attn.v_proj.bias", Kind.BIAS, cfg.qkv_bias)

    def __call__(self, x: jax.Array, batch: Batch, row_tile: int | None):
        """→ (the residual stream after this layer, the keys and values it attended with)."""
        qkv = stacked_outputs(self.q.get_value(), self.k.get_value(), self.v.get_value())
        bias = None
        if self.cfg.qkv_bias:
            bias = jnp.concatenate([b.get_value() for b in (self.q_bias, self.k_bias, self.v_bias)])
        q, k, v = by_rows(partial(self._qkv, qkv, bias), row_tile, x, batch.positions)
        attn = attention(q, k, v, batch, scale=self.cfg.head_dim**-0.5)
        if self.experts is None:
            return by_rows(self._after_attention, row_tile, x, attn), (k, v)
        x, h, probs = by_rows(self._route, row_tile, x, attn)
        index, weight = route(probs, self.cfg.moe.top_k, self.cfg.moe.normalize)
        return x + self.experts(h, index, weight).astype(x.dtype), (k, v)

    def _qkv(self, qkv, bias, x, positions):
        """Row-local: attention inputs [T, heads, head_dim] from the residual stream [T, hidden], through the
        q, k and v weights stacked (qkv) and their biases stacked (or None)."""
        cfg = self.cfg
        y = linear(_norm(x, self.input_norm, cfg), qkv)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        q, k, v = split_heads(y, (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads), cfg.head_dim)
        if cfg.qk_norm:
            q, k = _norm(q, self.q_norm, cfg), _norm(k, self.k_norm, cfg)
        return apply_rope(q, positions, cfg.rope), apply_rope(k, positions, cfg.rope), v

    def _after_attention(self, x, attn):
        """Row-local: output projection, MLP and residuals."""
        x = x + linear(attn.reshape(x.shape[0], -1), self.o.get_value())
        mlp = (self.gate.get_value(), self.up.get_value(), self.down.get_value())
        return x + gated_mlp(_norm(x, self.post_attn_norm, self.cfg), *mlp, jax.nn.silu)

    def _route(self, x, attn):
        """Row-local, for a layer of experts: the stream after attention, its normed input to the experts,
        and the router's probabilities [T, experts] f32."""
        x = x + linear(attn.reshape(x.shape[0], -1), self.o.get_value())
        h = _norm(x, self.post_attn_norm, self.cfg)
        return x, h, jax.nn.softmax(linear(h, self.router.get_value(), jnp.float32), axis=-1)


class Llama(Decoder):
    Config = Config

    def __init__(self, cfg: Config, precision: Precision):
        make_layer = partial(Layer, cfg, precision=precision)
        signatures = [cfg.sparse(i) for i in range(cfg.num_layers)]  # experts or a dense MLP
        super().__init__(cfg, precision, make_layer, signatures, tied=cfg.tie_embeddings, softcap=None)

    def _final_norm(self, x):
        return _norm(x, self.final_norm, self.config)


def _norm(x, w: nnx.Param, cfg: Config):
    return rms_norm(x, w.get_value(), cfg.rms_norm_eps, style="llama")
