"""Checkpoints in the engine's stored form (written by `spinf-jax quantize`, spinf_jax.export).

Such a checkpoint is a Hugging Face folder whose tensors are exactly what the loader would make of the source
at one precision (`quant.quantize` of each weight in its `params.stored_as` form), so loading it needs no
quantizing and gives the same bits:
- a quantized linear `<name>.weight` holds the values [out, in] (float8_e4m3fn or int8) and
  `<name>.weight_scale` the f32 scale of each output channel [out]: row r of the real weight is
  values[r] * scale[r];
- every other weight is stored as the engine keeps it: norms and biases f32, the embedding / LM head bf16.

config.json says so in `quantization_config`. Its keys follow compressed-tensors' names (config_groups with
`weights` / `input_activations`, `ignore`) where they mean the same, but `quant_method` is our own: nothing
else has been checked to read these files, and the scale is [out], not compressed-tensors' [out, 1].
"""

import json
from pathlib import Path

from spinf_jax.models.params import Kind, params, sources, stored_as
from spinf_jax.quant import Precision

METHOD = "spinf-jax"
SCALE_SUFFIX = "_scale"  # "<name>.weight" + this: the per-channel scales of a quantized weight

_WEIGHTS = {
    Precision.FP8: {"num_bits": 8, "type": "float", "dtype": "float8_e4m3fn"},
    Precision.INT8: {"num_bits": 8, "type": "int", "dtype": "int8"},
}


def quantization_config(decoder) -> dict:
    """config.json's `quantization_config` for an (abstract) decoder's weights at its precision."""
    precision = decoder.precision
    if precision not in _WEIGHTS:
        raise ValueError(f"{precision} is not a quantized precision: choose fp8 or int8")
    # Absmax per output channel: a scale per row, computed from the weight alone (no calibration data).
    weights = _WEIGHTS[precision] | {"strategy": "channel", "symmetric": True, "dynamic": False}
    activations = None  # int8: weights only, activations bf16
    if precision is Precision.FP8:
        # Each token's row gets its own scale at run time, so a token's result never depends on its batch.
        activations = {
            "num_bits": 8,
            "type": "float",
            "strategy": "token",
            "symmetric": True,
            "dynamic": True,
        }
    return {
        "quant_method": METHOD,
        "precision": precision.value,
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
        "weight_scale": f"<name>.weight{SCALE_SUFFIX}: float32 [out], absmax of the row / the type's max",
        "kept": {kind.value: stored_as(kind, precision).value for kind in Kind if kind is not Kind.LINEAR},
        "ignore": [
            name.removesuffix(".weight")
            for p in params(decoder)
            if p.kind in (Kind.EMBED, Kind.ROUTER)
            for name in sources(p)
        ],  # the embedding tables (and LM head), experts' routers: bf16, see params.stored_as
        "calibration": None,
    }


def folder_precision(spec: str) -> Precision | None:
    """written_precision of a local checkpoint folder, None for anything else (read before loading: serve's
    default precision)."""
    config = Path(spec).expanduser() / "config.json"
    return written_precision(json.loads(config.read_text())) if config.is_file() else None


def written_precision(config: dict) -> Precision | None:
    """The precision a checkpoint was written for by `spinf-jax quantize`, or None for an ordinary one.
    Other quantized checkpoints (GPTQ, block-scaled fp8, ...) are refused: read as plain weights they would
    give wrong scores without an error."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != METHOD:
        raise ValueError(
            f"the checkpoint is quantized with {qc.get('quant_method')!r}, which this engine does not read; "
            "load its unquantized original (the engine quantizes at load) or one written by "
            "`spinf-jax quantize`"
        )
    return Precision(qc["precision"])
