"""What the benchmarks share: the seed job, the real model shapes, and a timer."""

import json
import statistics
import time
from pathlib import Path

import jax

JOB = Path(__file__).resolve().parent.parent / "fixtures" / "jobs" / "seed_job.json"

# Gemma 3 12B's text config (google/gemma-3-12b-pt), as transformers 5 writes it.
GEMMA3_12B = {
    "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 1024, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
}  # fmt: skip
# Qwen3-8B (Qwen/Qwen3-8B config.json).
QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}  # fmt: skip


def seed_job() -> dict:
    return json.loads(JOB.read_text())


def seed_request(job: dict, empty_floor: bool = True) -> dict:
    """The whole job as one scoring request: every article, every question."""
    return {
        "inputs": [
            {"id": c["id"], "messages": [{"role": "user", "content": c["text"]}]} for c in job["contents"]
        ],
        "scoring": {"queries": job["questions"], "empty_floor": empty_floor},
    }


def timed(fn, *args, repeats: int = 5) -> float:
    """Median seconds of `fn(*args)` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
