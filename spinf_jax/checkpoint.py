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

from spinf_jax.gguf_families import FAMILIES


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


_REQUIRED = object()
# Q8_0 blocks: an f16 scale, then 32 int8 values; a value is scale × int8. Dequantized _Q8_0_CHUNK blocks at
# a time, so that the temporaries stay in the caches.
_Q8_0_SCALE, _Q8_0_BLOCK, _Q8_0_CHUNK = 2, 34, 4096


def _q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 bytes [rows, row_bytes] dequantized to f32 [blocks, 32], the same values as the gguf package's.
    Ours because that one works 16 rows at a time: Gemma 3 270M's embedding table (262,144 rows) took 3.8 s
    there, about 1 s here."""
    blocks = data.reshape(-1, _Q8_0_BLOCK)
    out = np.empty((blocks.shape[0], _Q8_0_BLOCK - _Q8_0_SCALE), np.float32)
    for start in range(0, blocks.shape[0], _Q8_0_CHUNK):
        part, into = blocks[start : start + _Q8_0_CHUNK], out[start : start + _Q8_0_CHUNK]
        scales = part[:, :_Q8_0_SCALE].copy().view(np.float16)  # [n, 1]
        np.multiply(part[:, _Q8_0_SCALE:].view(np.int8), scales, out=into, dtype=np.float32)
    return out


class GGUFFile:
    """A llama.cpp GGUF file, dequantized tensor by tensor to f32 (via the `gguf` package), under Hugging
    Face's names and values: what llama.cpp's converter changed is undone per family
    (spinf_jax.gguf_families). An expert's tensor is read alone from its layer's stack, so a layer's experts
    are not all dequantized at once.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fields, self.tensors = _read_gguf(self.path)
        self.arch = self.field("general.architecture")
        if self.arch not in FAMILIES:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        self.family = FAMILIES[self.arch]
        self._refuse_fused_tensors()
        self.config = self.family.config(self)

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def meta(self, key: str, default=_REQUIRED):
        """The architecture's metadata value `key` (`{arch}.{key}`); without a default, it must be there."""
        value = self.fields.get(f"{self.arch}.{key}", default)
        if value is _REQUIRED:
            raise ValueError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    def shape(self, gguf_name: str) -> tuple[int, ...]:
        """A tensor's shape in numpy's order (GGUF lists dimensions innermost first)."""
        return tuple(reversed(self.tensors[gguf_name][1]))

    def dequantized(self, gguf_name: str, expert: int | None = None) -> np.ndarray:
        """A GGUF tensor as f32, or one expert's [.., ..] of a stacked [experts, .., ..] tensor (its rows are
        contiguous in the file)."""
        qtype, _, data = self.tensors[gguf_name]
        shape = self.shape(gguf_name)
        if expert is not None:
            rows = data.shape[0] // shape[0]
            data, shape = data[expert * rows : (expert + 1) * rows], shape[1:]
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            return _q8_0(data).reshape(shape)
        return gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False).reshape(shape)

    def get(self, name: str) -> np.ndarray:
        gguf_name, expert = self.family.gguf_name(name)
        if gguf_name not in self.tensors:
            raise KeyError(f"tensor {gguf_name!r} ({name}) not found in {self.path}")
        return self.family.undo(name, self.dequantized(gguf_name, expert), self.config)

    def _refuse_fused_tensors(self) -> None:
        """Refuse what the converter's --fuse-qkv and --fuse-gate-up-exps join, which Hugging Face keeps apart
        (Qwen3.5 linear attention's own attn_qkv, with ssm_a beside it, and Gemma 4's fused experts are not
        these)."""
        for name in self.tensors:
            layer = name.split(".")[1] if name.startswith("blk.") else None
            if name.endswith("attn_qkv.weight") and f"blk.{layer}.ssm_a" not in self.tensors:
                raise ValueError(f"{self.path}: fused q/k/v ({name}, --fuse-qkv) are not supported")
            if name.endswith("ffn_gate_up_exps.weight") and self.arch != "gemma4":
                raise ValueError(
                    f"{self.path}: fused expert gate/up ({name}, --fuse-gate-up-exps) are not supported"
                )
