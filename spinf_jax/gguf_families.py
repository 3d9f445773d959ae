"""What llama.cpp's converter (`convert_hf_to_gguf.py`) does to each family we run, undone: the metadata read
back into a transformers config, each Hugging Face tensor name mapped to the GGUF tensor that holds it (or one
expert's slice of a stacked one), and the converter's value transforms inverted. `checkpoint.GGUFFile` reads
the file; this module knows the families.

What the converter changes (checked against its own output on our tiny fixtures: fixtures/gguf/README.md):
- `llama`: q/k rows permuted per head so that rope pairs adjacent elements.
- `gemma3`: every norm stored as 1 + w. (`gemma4` norms are stored as they are: Gemma 4 scales by w.)
- `qwen35`, `qwen35moe`: every norm but the gated one of linear attention stored as 1 + w; `A_log` stored as
  -exp(A_log); `conv1d` squeezed to [channels, kernel]; and linear attention's value heads reordered where a
  key head serves several: Hugging Face groups them by key head (head g·r + j is key head g's j-th), llama.cpp
  tiles them (head j·nk + g), in the v part of `in_proj_qkv` and of the convolution, in `in_proj_z`,
  `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias` and the columns of `out_proj`.
- experts (`qwen3moe`, `qwen35moe`): the per-expert tensors of a layer stacked into one [experts, ...] tensor
  per projection; Gemma 4's fused `gate_up_proj` is kept fused.
"""

import re

import numpy as np

from spinf_jax.models.layers import GLOBAL, SLIDING
from spinf_jax.models.qwen3_5 import FULL, LINEAR

# Hugging Face names within a layer (model.layers.{i}.…) → llama.cpp's: by module, the suffix (weight / bias)
# kept; per-expert names (mlp.experts.{e}.…) ask for expert e of the stacked tensor named here.
_LAYER_MODULES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # Gemma 3 and 4 norm the MLP's input and output; llama.cpp reuses "ffn_norm" for the norm before it.
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    # Qwen's experts, and Qwen3.5 MoE's shared expert
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    # Qwen3.5's Gated DeltaNet
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    # Gemma 4: the MoE block's norms and router, the per-layer inputs (E2B/E4B)
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "router.proj": "ffn_gate_inp",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
# Names without a weight / bias suffix, or renamed whole by the converter.
_LAYER_WHOLE = {
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "layer_scalar": "layer_output_scale.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.embed_tokens_per_layer": "per_layer_token_embd",
    "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
}
_EXPERT = re.compile(r"(mlp\.experts)\.(\d+)\.(.+)")


def _decimal(value: float | None) -> float | None:
    """A float32 metadata value as the decimal the config had (1e-06, not 9.99999997e-07): the shortest
    decimal that rounds to the same float32."""
    return None if value is None else float(str(np.float32(value)))


class Family:
    """One GGUF architecture as the converter writes it: the config, the names and the transforms undone."""

    # llama.cpp's name for Hugging Face's post_attention_layernorm: the norm before the MLP in Llama and Qwen
    # ("ffn_norm"), a norm of the attention output in Gemma ("post_attention_norm", as in Qwen3.5's GGUFs).
    post_attention_norm = "ffn_norm"

    def config(self, f) -> dict:
        """The transformers config of GGUFFile f."""
        raise NotImplementedError

    def undo(self, name: str, w: np.ndarray, config: dict) -> np.ndarray:
        """Tensor `name` as Hugging Face stores it, from what the converter wrote (`w`, dequantized)."""
        return w

    def gguf_name(self, name: str) -> tuple[str, int | None]:
        """Hugging Face tensor name → (the GGUF tensor holding it, the expert of that stack, or None)."""
        if not name.startswith("model.layers."):
            base, _, suffix = name.rpartition(".")
            return f"{_GLOBAL[base]}.{suffix}", None
        _, _, layer, rest = name.split(".", 3)
        expert = _EXPERT.fullmatch(rest)
        if expert:
            rest = f"{expert[1]}.{expert[3]}"
        if rest in _LAYER_WHOLE:
            short = _LAYER_WHOLE[rest]
        else:
            module, _, suffix = rest.rpartition(".")
            if module == "post_attention_layernorm":
                short = f"{self.post_attention_norm}.{suffix}"
            else:
                short = f"{_LAYER_MODULES[module]}.{suffix}"
        return f"blk.{layer}.{short}", int(expert[2]) if expert else None


def _common(f) -> dict:
    """The config keys every family's metadata gives the same way."""
    heads = f.meta("attention.head_count")
    return {
        "vocab_size": f.shape("token_embd.weight")[0],
        "hidden_size": f.meta("embedding_length"),
        "num_hidden_layers": f.meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.meta("attention.head_count_kv", heads),
        "head_dim": f.meta("attention.key_length", f.meta("embedding_length") // heads),
        "rms_norm_eps": _decimal(f.meta("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }


def _rope(f) -> dict:
    """One theta and optional scaling, as Llama's and Gemma 3's configs give them."""
    c = {"rope_theta": _decimal(f.meta("rope.freq_base", 1e4))}
    scaling = f.meta("rope.scaling.type", "none")
    if scaling != "none":
        c["rope_scaling"] = {"rope_type": scaling, "factor": _decimal(f.meta("rope.scaling.factor"))}
    return c


def _refuse_rope_scaling(f) -> None:
    """Gemma 4 and Qwen3.5 run no rope scaling here (their configs have none)."""
    scaling = f.meta("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{f.path}: rope scaling {scaling!r} in a {f.arch} GGUF is not supported")


class Llama(Family):
    """`llama`, `qwen2`, `qwen3`: the Llama architecture and the Qwen families that differ from it only by
    configuration."""

    def config(self, f) -> dict:
        return (
            _common(f) | _rope(f) | {"model_type": f.arch, "intermediate_size": f.meta("feed_forward_length")}
        )

    def undo(self, name: str, w: np.ndarray, config: dict) -> np.ndarray:
        # The converter permutes Llama's q/k rows only; Qwen's are stored as they are.
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            return _unpermute_rope_rows(w, heads)
        return w


class Qwen3Moe(Llama):
    """`qwen3moe`: every layer's MLP is experts; llama.cpp has no dense layers (`mlp_only_layers`) for it."""

    def config(self, f) -> dict:
        dense = [i for i in range(f.meta("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]
        if dense:
            raise ValueError(
                f"{f.path}: layers {dense} have no experts, which llama.cpp's qwen3moe cannot hold"
            )
        # The metadata has no norm_topk_prob: llama.cpp's qwen3moe graph always renormalises the top k (as
        # every published Qwen3 MoE config asks).
        return super().config(f) | {
            "model_type": "qwen3_moe",
            "num_experts": f.meta("expert_count"),
            "num_experts_per_tok": f.meta("expert_used_count"),
            "moe_intermediate_size": f.meta("expert_feed_forward_length"),
            "norm_topk_prob": True,
        }


class Gemma3(Family):
    """`gemma3`: norms stored as 1 + w."""

    post_attention_norm = "post_attention_norm"

    def config(self, f) -> dict:
        head_dim = f.meta("attention.key_length")
        # GGUF does not record query_pre_attn_scalar; llama.cpp scales by head_dim^-0.5, which equals it for
        # every Gemma 3 size but 27B.
        return (
            _common(f)
            | _rope(f)
            | {
                "model_type": "gemma3_text",
                "intermediate_size": f.meta("feed_forward_length"),
                "query_pre_attn_scalar": head_dim,
                "sliding_window": f.meta("attention.sliding_window"),
                "rope_local_base_freq": 1e4,
            }
        )

    def undo(self, name: str, w: np.ndarray, config: dict) -> np.ndarray:
        return w - 1.0 if name.endswith("norm.weight") else w


class Gemma4(Family):
    """`gemma4`, dense and MoE: renamed only. Layer shapes come from per-layer metadata (which layers slide,
    kv heads, MLP widths) and from which tensors each layer has (no attn_v: k = v)."""

    post_attention_norm = "post_attention_norm"

    def config(self, f) -> dict:
        _refuse_rope_scaling(f)
        n, shared = f.meta("block_count"), f.meta("attention.shared_kv_layers", 0)
        c = _common(f) | _gemma4_layers(f, n, shared) | _mlp_widths(f, n, n - shared) | _gemma4_experts(f)
        c |= {
            "model_type": "gemma4_text",
            "sliding_window": f.meta("attention.sliding_window"),
            "num_kv_shared_layers": shared,
            "hidden_size_per_layer_input": f.meta("embedding_length_per_layer_input", 0),
            "final_logit_softcapping": _decimal(f.meta("final_logit_softcapping", None)),
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": _decimal(f.meta("rope.freq_base_swa"))},
                GLOBAL: {
                    "rope_type": "proportional",
                    "rope_theta": _decimal(f.meta("rope.freq_base")),
                    "partial_rotary_factor": _rotated_fraction(f),
                },
            },
        }
        if "per_layer_token_embd.weight" in f.tensors:
            c["vocab_size_per_layer_input"] = f.shape("per_layer_token_embd.weight")[0]
        return c


def _gemma4_layers(f, n: int, shared: int) -> dict:
    """Each layer's type, head_dim and kv heads, and whether global layers use k as v (they have no attn_v;
    KV-shared layers, the last `shared`, have no k or v of their own)."""
    types = [SLIDING if s else GLOBAL for s in f.meta("attention.sliding_window_pattern")]
    kv = _per_layer(f.meta("attention.head_count_kv"), n)
    dims = {SLIDING: f.meta("attention.key_length_swa"), GLOBAL: f.meta("attention.key_length")}
    if f.meta("rope.dimension_count_swa") != dims[SLIDING]:
        raise ValueError(f"{f.path}: partial rope on Gemma 4's sliding layers is not supported")
    k_is_v = [types[i] == GLOBAL and f"blk.{i}.attn_v.weight" not in f.tensors for i in range(n - shared)]
    return {
        "layer_types": types,
        "head_dim": dims[SLIDING],
        "per_layer_config": {
            i: {"head_dim": dims[t], "num_key_value_heads": kv[i]} for i, t in enumerate(types)
        },
        "attention_k_eq_v": any(k_is_v),
    }


def _gemma4_experts(f) -> dict:
    experts = f.meta("expert_count", 0)
    if not experts:
        return {"enable_moe_block": False}
    return {
        "enable_moe_block": True,
        "num_experts": experts,
        "top_k_experts": f.meta("expert_used_count"),
        "moe_intermediate_size": f.meta("expert_feed_forward_length"),
    }


def _per_layer(value, n: int) -> list:
    """A metadata value that is one number for every layer, or a list of one per layer."""
    return list(value) if isinstance(value, list) else [value] * n


def _mlp_widths(f, n: int, first_shared: int) -> dict:
    """Gemma 4's MLP width, and whether KV-shared layers have twice it (`use_double_wide_mlp`, which the
    converter writes as a width per layer)."""
    widths = _per_layer(f.meta("feed_forward_length"), n)
    base = widths[0]
    double = [base if i < first_shared else 2 * base for i in range(n)]
    if widths not in ([base] * n, double):
        raise ValueError(
            f"{f.path}: MLP widths {widths} are neither one width nor double-wide KV-shared layers"
        )
    return {"intermediate_size": base, "use_double_wide_mlp": widths != [base] * n}


def _rotated_fraction(f) -> float:
    """The share of global layers' rope pairs that rotate. The converter writes Gemma 4's "proportional" rope
    as frequency factors (`rope_freqs`): 1 for a rotated pair, 1e30 (frequency ~0) for the rest."""
    factors = f.dequantized("rope_freqs.weight")
    rotated = int(np.sum(factors == 1.0))
    if not (np.all(factors[:rotated] == 1.0) and np.all(factors[rotated:] >= 1e30)):
        raise ValueError(f"{f.path}: rope_freqs is not a proportional rope's mask of leading pairs")
    return rotated / factors.size


class Qwen35(Family):
    """`qwen35` (dense) and `qwen35moe`: norms, A_log, the convolution's shape and the value heads' order
    undone (module docstring). Multi-token-prediction layers (`nextn_predict_layers`, after the decoder's own)
    are not read."""

    post_attention_norm = "post_attention_norm"

    def config(self, f) -> dict:
        _refuse_rope_scaling(f)
        moe = f.arch == "qwen35moe"
        layers = f.meta("block_count") - f.meta("nextn_predict_layers", 0)
        value_heads = f.meta("ssm.time_step_rank")
        # Text positions are the same on mrope's three axes (rope.dimension_sections), where it is plain rope.
        rotary = f.meta("rope.dimension_count") / f.meta("attention.key_length")
        c = _common(f) | {
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            "num_hidden_layers": layers,
            "layer_types": [LINEAR if r else FULL for r in f.meta("attention.recurrent_layers")[:layers]],
            "rope_parameters": {
                "rope_theta": _decimal(f.meta("rope.freq_base")),
                "partial_rotary_factor": rotary,
            },
            "linear_num_key_heads": f.meta("ssm.group_count"),
            "linear_num_value_heads": value_heads,
            "linear_key_head_dim": f.meta("ssm.state_size"),
            "linear_value_head_dim": f.meta("ssm.inner_size") // value_heads,
            "linear_conv_kernel_dim": f.meta("ssm.conv_kernel"),
        }
        if moe:
            c |= {
                "num_experts": f.meta("expert_count"),
                "num_experts_per_tok": f.meta("expert_used_count"),
                "moe_intermediate_size": f.meta("expert_feed_forward_length"),
                "shared_expert_intermediate_size": f.meta("expert_shared_feed_forward_length"),
            }
        else:
            c["intermediate_size"] = f.meta("feed_forward_length")
        return c

    def undo(self, name: str, w: np.ndarray, config: dict) -> np.ndarray:
        _, linear, part = name.partition(".linear_attn.")
        if not linear:
            return w - 1.0 if name.endswith("norm.weight") else w
        if part == "A_log":
            w = np.log(-w)
        elif part == "conv1d.weight":
            w = w[:, None, :]  # [channels, 1, kernel], as Hugging Face's depthwise Conv1d keeps it
        layout = _value_head_layout(part, config)
        return w if layout is None else _heads_by_key_head(w, *layout, config["linear_num_key_heads"])


def _value_head_layout(part: str, config: dict) -> tuple[int, int, int] | None:
    """Where a linear-attention tensor holds value heads: (axis, the index they start at, the width of one),
    or None."""
    qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    head = config["linear_value_head_dim"]
    return {
        "in_proj_qkv.weight": (0, qk, head),
        "conv1d.weight": (0, qk, head),
        "in_proj_z.weight": (0, 0, head),
        "in_proj_a.weight": (0, 0, 1),
        "in_proj_b.weight": (0, 0, 1),
        "A_log": (0, 0, 1),
        "dt_bias": (0, 0, 1),
        "out_proj.weight": (1, 0, head),
    }.get(part)


def _heads_by_key_head(w: np.ndarray, axis: int, start: int, width: int, key_heads: int) -> np.ndarray:
    """Value heads along `axis` from `start` (each `width` wide) from llama.cpp's tiled order back to Hugging
    Face's order grouped by key head: HF head g·r + j is llama.cpp's head j·key_heads + g."""
    w = np.moveaxis(w, axis, 0)
    heads = w[start:]
    per_key = heads.shape[0] // (key_heads * width)
    regrouped = heads.reshape(per_key, key_heads, width, *heads.shape[1:]).swapaxes(0, 1).reshape(heads.shape)
    return np.moveaxis(np.concatenate([w[:start], regrouped]), 0, axis)


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head it interleaved the two rotate-half halves."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


FAMILIES: dict[str, Family] = {
    "llama": Llama(),
    "qwen2": Llama(),
    "qwen3": Llama(),
    "qwen3moe": Qwen3Moe(),
    "gemma3": Gemma3(),
    "gemma4": Gemma4(),
    "qwen35": Qwen35(),
    "qwen35moe": Qwen35(),
}
