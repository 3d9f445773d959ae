"""Model families. Each family module provides Config.from_hf, param_specs, forward and logits."""

from types import ModuleType

from spinf_jax.models import gemma3, gemma4, qwen3

_FAMILIES: dict[str, ModuleType] = {
    "gemma3_text": gemma3,
    "gemma3": gemma3,
    "gemma4_text": gemma4,
    "gemma4": gemma4,
    "qwen3": qwen3,
    "qwen2": qwen3,
    "llama": qwen3,
}


def family_for(hf_config: dict) -> ModuleType:
    model_type = hf_config.get("text_config", hf_config).get("model_type", hf_config.get("model_type"))
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
    return _FAMILIES[model_type]
