"""Model families, one file each, as Flax NNX modules: a family's `Decoder` subclass declares its weights
(nnx.Params named after the Hugging Face tensors) and its forward pass; its `Config.from_hf` reads a
transformers config."""

from flax import nnx

from spinf_jax.models import gemma4_audio, gemma4_vision, siglip
from spinf_jax.models.decoder import Decoder
from spinf_jax.models.gemma3 import Gemma3
from spinf_jax.models.gemma4 import Gemma4
from spinf_jax.models.llama import Llama
from spinf_jax.models.qwen3_5 import Qwen3_5
from spinf_jax.quant import Precision

_FAMILIES: dict[str, type[Decoder]] = {
    "gemma3_text": Gemma3,
    "gemma3": Gemma3,
    "gemma4_text": Gemma4,
    "gemma4": Gemma4,
    "qwen3_5_text": Qwen3_5,
    "qwen3_5": Qwen3_5,
    "qwen3_5_moe_text": Qwen3_5,
    "qwen3_5_moe": Qwen3_5,
    "qwen3": Llama,
    "qwen3_moe": Llama,
    "qwen2": Llama,
    "llama": Llama,
}


def family_for(hf_config: dict) -> type[Decoder]:
    model_type = hf_config.get("text_config", hf_config).get("model_type", hf_config.get("model_type"))
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
    return _FAMILIES[model_type]


def abstract_decoder(hf_config: dict, precision: Precision | str) -> Decoder:
    """The model a transformers config describes, with every weight abstract (shapes and dtypes, no memory):
    for a loader to fill, or to compile and inspect programs without weights."""
    family = family_for(hf_config)
    config = family.Config.from_hf(hf_config)
    return nnx.eval_shape(lambda: family(config, Precision(precision)))


# The vision towers we build, by the checkpoint's model_type.
_TOWERS = {"gemma3": siglip, "gemma4": gemma4_vision}


def abstract_tower(hf_config: dict, precision: Precision | str) -> nnx.Module | None:
    """The vision tower of a checkpoint whose images we read (Gemma 3's SigLIP, Gemma 4's), abstract as
    abstract_decoder's model; None for every other checkpoint: text-only models, and multimodal families
    whose towers are not built yet (Qwen3.5's), which then read text only."""
    family = _TOWERS.get(hf_config.get("model_type"))
    if family is None or hf_config.get("vision_config") is None:
        return None
    config = family.Config.from_hf(hf_config)
    return nnx.eval_shape(lambda: family.VisionTower(config, Precision(precision)))


def abstract_audio_tower(hf_config: dict, precision: Precision | str, mel_bins: int) -> nnx.Module | None:
    """Gemma 4's audio tower (E2B, E4B), abstract as abstract_tower's; None for every other checkpoint.
    mel_bins: the feature extractor's (spinf_jax.audio.AudioFormat)."""
    if hf_config.get("model_type") != "gemma4" or hf_config.get("audio_config") is None:
        return None
    config = gemma4_audio.Config.from_hf(hf_config, mel_bins)
    return nnx.eval_shape(lambda: gemma4_audio.AudioTower(config, Precision(precision)))
