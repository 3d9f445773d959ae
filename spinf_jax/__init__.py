"""spinf-jax: one read of a content, many closed questions, bit-identical scores.

from spinf_jax import Engine
engine = Engine.load("spinf/gemma-3-270m", precision="bf16")
response = engine.score({"messages": [...], "scoring": {"queries": [...]}})
"""

from spinf_jax.engine import Engine
from spinf_jax.errors import ScoringError
from spinf_jax.loader import load_model
from spinf_jax.models.layers import TreeBatch
from spinf_jax.quant import Precision
from spinf_jax.service import Service

__all__ = ["Engine", "Precision", "ScoringError", "Service", "TreeBatch", "load_model"]
