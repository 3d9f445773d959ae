"""Checkpoint readers: a Hugging Face folder of safetensors, or a GGUF file. Both hand out one tensor at a
time, by its Hugging Face name, so the loader never holds more than one full-precision tensor on the host.
"""

import json
import math
import struct
from pathlib import Path

import gguf
import ml_dtypes
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
        stored = next((alias for alias in _aliases(name) if alias in self.weight_map), None)
        if stored is None:
            others = " or ".join(map(repr, _aliases(name)[1:]))
            raise KeyError(f"tensor {name!r} (or {others}) not found in {self.folder}")
        file, name = self.weight_map[stored], stored
        with safe_open(self.folder / file, "numpy") as f:
            if f.get_slice(name).get_dtype() == "F8_E4M3":
                return _read_float8(self.folder / file, name)
            return f.get_tensor(name)


def _aliases(name: str) -> list[str]:
    """Where a checkpoint may keep the tensor we call `name` (transformers' name in a text-only model, or for
    a media tower in its current multimodal class). Multimodal checkpoints nest the text decoder one level
    down (transformers 5: model.language_model.; the released Gemma 3 files and what transformers 5 writes:
    language_model.model.) and keep the vision tower and projector at the top (vision_tower.[vision_model.],
    multi_modal_projector.)."""
    if not name.startswith("model."):
        return [name]
    rest = name.removeprefix("model.")
    towers = [rest, rest.replace("vision_tower.", "vision_tower.vision_model.", 1)]
    return list(
        dict.fromkeys([name, f"model.language_model.{rest}", f"language_model.model.{rest}", *towers])
    )


def _read_float8(path: Path, name: str) -> np.ndarray:
    """One float8_e4m3fn tensor, memory-mapped. safetensors' numpy reader cannot hand these out (it looks for
    `numpy.float8_e4m3fn`, which lives in ml_dtypes), so we read the format directly: an 8-byte little-endian
    header size, the JSON header with each tensor's byte range, then the data."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(size))[name]
    start, end = info["data_offsets"]
    data = np.memmap(path, np.uint8, mode="r", offset=8 + size + start, shape=(end - start,))
    return data.view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])


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


# GGUF metadata value types: struct formats of the scalars, numpy dtypes for arrays of them; 8 is a string,
# 9 an array. Tensor types stored as plain numbers are handed to the dequantizer typed, the rest as bytes.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_ARRAYS = {k: np.dtype(f) for k, f in _SCALARS.items()}
_PLAIN_TENSORS = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
}


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.scalar(_SCALARS[kind])
        elem, count = self.scalar("<I"), self.scalar("<Q")
        if elem in _ARRAYS:
            values = np.frombuffer(self.buf, _ARRAYS[elem], count, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(elem) for _ in range(count)]


def _read_gguf(path: Path) -> tuple[dict, dict]:
    """Metadata and memory-mapped tensors of a GGUF file (format v3).

    We parse the header ourselves: `gguf.GGUFReader` indexes every string of a 262k-token vocabulary as its
    own array and takes ~9 s on Gemma 3 270M; this takes ~0.5 s and gives the same fields and bytes
    (tests/test_loading.py compares the two). Dequantization stays with the `gguf` package."""
    # A plain array over the mapped file: slices of an np.memmap are memmaps, each set up in Python, and a
    # Gemma 3 load made ~0.66 M of them (header strings, the dequantizer's row groups): 1.2 s of its 7.5 s.
    buf = np.memmap(path, np.uint8, mode="r").view(np.ndarray)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cursor = _Cursor(buf)
    cursor.pos = 4
    version, n_tensors, n_fields = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]  # innermost first (ggml order)
        infos.append((name, dims, gguf.GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
    alignment = fields.get("general.alignment", 32)
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, row_bytes = math.prod(dims[1:]), dims[0] // block * size
        data = buf[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = (qtype, dims, data.view(_PLAIN_TENSORS[qtype]) if qtype in _PLAIN_TENSORS else data)
    return fields, tensors


class GGUFFile:
    """A llama.cpp GGUF file, dequantized tensor by tensor to f32 (via the `gguf` package).

    llama.cpp's converter changes two things that we undo: for Llama it permutes the rows of q/k so that
    rope pairs adjacent elements, and for Gemma it stores norm weights as (1 + w).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fields, self.tensors = _read_gguf(self.path)
        self.arch = self.field("general.architecture")
        self.config = self._hf_config()

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def _hf_config(self) -> dict:
        a = self.arch
        hidden = self.field(f"{a}.embedding_length")
        heads = self.field(f"{a}.attention.head_count")
        c = {
            "vocab_size": len(self.fields["tokenizer.ggml.tokens"]),
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
        qtype, dims, data = self.tensors[gname]
        w = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
        w = w.reshape(tuple(reversed(dims)))
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
