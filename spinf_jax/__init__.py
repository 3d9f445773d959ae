"""spinf-jax: one read of a content, many closed questions, bit-identical scores.

from spinf_jax import Engine
engine = Engine.load("spinf/gemma-3-270m", precision="bf16")
response = engine.score({"messages": [...], "scoring": {"queries": [...]}})

The names below are imported on first use: `import spinf_jax.client` (an HTTP client) does not start JAX.
"""

import importlib

_WHERE = {
    "Engine": "spinf_jax.engine",
    "ScoringError": "spinf_jax.errors",
    "load_model": "spinf_jax.loader",
    "TreeBatch": "spinf_jax.models.layers",
    "Precision": "spinf_jax.quant",
    "Service": "spinf_jax.service",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'spinf_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
