"""Checkpoint readers: a Hugging Face folder of safetensors, or a GGUF file. Both hand out one tensor at a
time, by its Hugging Face name, so the loader never holds more than one full-precision tensor on the host.
"""

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open


class SafetensorsFolder:
    """config.json + model.safetensors, or shards listed in model.safetensors.index.json."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.config = json.loads((self.folder / "config.json").read_text())
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {self.folder}")
            weight_map = {}
            for file in files:
                with safe_open(file, "numpy") as f:
                    weight_map.update(dict.fromkeys(f.keys(), file.name))
        self.weight_map: dict[str, str] = weight_map

    def get(self, name: str) -> np.ndarray:
        # Multimodal checkpoints (Gemma3ForConditionalGeneration) nest the text decoder one level down.
        file = self.weight_map.get(name)
        if file is None:
            alt = name.replace("model.", "model.language_model.", 1)
            file, name = self.weight_map.get(alt), alt
        if file is None:
            raise KeyError(f"tensor {name!r} not found in {self.folder}")
        with safe_open(self.folder / file, "numpy") as f:
            return f.get_tensor(name)


# Hugging Face tensor names → GGUF names (llama.cpp's convention). Gemma 3 has four norms per layer where
# Llama has two, and llama.cpp reuses "ffn_norm" for the norm before the MLP in both.
_GGUF_LAYER_NAMES = {
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
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


class GGUFFile:
    """A llama.cpp GGUF file, dequantized tensor by tensor to f32 (via the `gguf` package).

    llama.cpp's converter changes two things that we undo: for Llama it permutes the rows of q/k so that
    rope pairs adjacent elements, and for Gemma it stores norm weights as (1 + w).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        self.arch = self.field("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._hf_config()

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _hf_config(self) -> dict:
        a = self.arch
        hidden = self.field(f"{a}.embedding_length")
        heads = self.field(f"{a}.attention.head_count")
        c = {
            "vocab_size": len(self.reader.fields["tokenizer.ggml.tokens"].data),
            "hidden_size": hidden,
            "intermediate_size": self.field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.field(f"{a}.attention.head_count_kv", heads),
            "rms_norm_eps": self.field(f"{a}.attention.layer_norm_rms_epsilon"),
            "rope_theta": self.field(f"{a}.rope.freq_base", 1e4),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling and scaling != "none":
            c["rope_scaling"] = {"rope_type": scaling, "factor": self.field(f"{a}.rope.scaling.factor")}
        if a == "gemma3":
            head_dim = self.field(f"{a}.attention.key_length")
            # GGUF does not record query_pre_attn_scalar; llama.cpp scales by head_dim^-0.5, which equals
            # it for every Gemma 3 size but 27B.
            c |= {
                "model_type": "gemma3_text",
                "head_dim": head_dim,
                "query_pre_attn_scalar": head_dim,
                "sliding_window": self.field(f"{a}.attention.sliding_window"),
                "rope_local_base_freq": 1e4,
            }
        elif a in ("llama", "qwen2", "qwen3"):
            c |= {"model_type": a, "head_dim": self.field(f"{a}.attention.key_length", hidden // heads)}
        else:
            raise ValueError(f"GGUF architecture {a!r} is not supported")
        return c

    def _gguf_name(self, name: str) -> str:
        base, _, suffix = name.rpartition(".")  # suffix: weight / bias
        if base.startswith("model.layers."):
            _, _, idx, rest = base.split(".", 3)
            if rest == "post_attention_layernorm":
                # Gemma 3: a norm after attention; Llama/Qwen: the norm before the MLP.
                short = "post_attention_norm" if self.arch == "gemma3" else "ffn_norm"
            else:
                short = _GGUF_LAYER_NAMES[rest]
            return f"blk.{idx}.{short}.{suffix}"
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"

    def get(self, name: str) -> np.ndarray:
        gname = self._gguf_name(name)
        if gname not in self.tensors:
            raise KeyError(f"tensor {gname!r} ({name}) not found in {self.path}")
        t = self.tensors[gname]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        if self.arch == "llama" and ("attn_q." in gname or "attn_k." in gname):
            heads = self.config["num_attention_heads" if "attn_q." in gname else "num_key_value_heads"]
            w = _unpermute_rope_rows(w, heads)
        if self.arch == "gemma3" and gname.endswith("norm.weight"):
            w = w - 1.0
        return w


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head it interleaved the two rotate-half halves."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
