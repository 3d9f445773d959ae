"""What the benchmarks share: the seed job, the real model shapes, and a timer."""

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spinf_jax.engine import Engine
from spinf_jax.loader import random_model
from spinf_jax.models.moe import Experts
from spinf_jax.models.params import Kind, params, per_source
from spinf_jax.packer import Buckets, default_sizes, pack
from spinf_jax.scoring import Scorer
from spinf_jax.tokenizer import Tokenizer

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
# A 12B-class dense Gemma 4 text config. No 12B Gemma 4 config was reachable offline: this is our assumption,
# Gemma 3 12B's widths with Gemma 4's layer design (global layers: head_dim 512, 4 kv heads, k_eq_v,
# proportional rope; softcapped logits), the layout spinf/gemma-4-12b-fp8 is expected to have.
GEMMA4_12B = {
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 3840, "intermediate_size": 15360,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
    "sliding_window": 1024, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0, "max_position_embeddings": 131072,
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
}  # fmt: skip
# Qwen3-8B (Qwen/Qwen3-8B config.json).
QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}  # fmt: skip


# Qwen3.5-4B and -9B text configs (the sizes in shared/PEERS-AND-MODELS.md §1.2, read from maxtext's and
# third-party copies of their config.json: no Qwen3.5 config was reachable here): L L L F x 8, head_dim 256,
# 16 GDN key heads of 128 serving 32 value heads.
_QWEN3_5 = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}  # fmt: skip
QWEN3_5_4B = _QWEN3_5 | {"hidden_size": 2560, "intermediate_size": 9216, "tie_word_embeddings": True}
QWEN3_5_9B = _QWEN3_5 | {"hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
# Qwen3.5-35B-A3B: 40 layers (L L L F x 10), hidden 2048, 256 experts (top 8) of 512 and a gated shared one.
QWEN3_5_35B_A3B = _QWEN3_5 | {
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
}  # fmt: skip
# Gemma 4 26B-A4B (maxtext's gemma4-26b.yml, PEERS-AND-MODELS.md §2): 30 layers, hidden 2816, a dense GeGLU
# MLP of 2112 beside 128 experts (top 8) of 704; global layers with head_dim 512, 2 kv heads and k = v.
GEMMA4_26B_A4B = {
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
    "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
    "sliding_window": 1024, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0, "max_position_embeddings": 262144,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
}  # fmt: skip
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, 128 experts (top 8) of 768, renormalised.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 40960, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}  # fmt: skip
# The shapes the engine benchmarks run at (--shape).
SHAPES = {
    "gemma-3-12b": GEMMA3_12B,
    "gemma-4-12b": GEMMA4_12B,
    "gemma-4-26b-a4b": GEMMA4_26B_A4B,
    "qwen3-8b": QWEN3_8B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3.5-4b": QWEN3_5_4B,
    "qwen3.5-9b": QWEN3_5_9B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
}


class FoldedTokenizer(Tokenizer):
    """Gemma 3's tokenizer with ids folded into another vocabulary (no such weights or tokenizer here)."""

    def __init__(self, tok: Tokenizer, vocab: int):
        super().__init__(tok.backend, tok.bos_id, tok.add_bos)
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [i % self.vocab for i in super().encode(text)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[i % self.vocab for i in ids] for ids in super().encode_batch(texts)]


def shape_tokenizer(path: str, config: dict) -> Tokenizer:
    """The Gemma 3 tokenizer file at `path`, its ids folded into the shape's vocabulary when it is smaller:
    with random weights, which ids a text gets does not change the speed."""
    import tokenizers

    tok = Tokenizer(tokenizers.Tokenizer.from_file(path), bos_id=2, add_bos=True)
    return tok if config["vocab_size"] >= 262144 else FoldedTokenizer(tok, config["vocab_size"])


class SyntheticCheckpoint:
    """A checkpoint for an abstract decoder's Params with made-up f32 values, handed over one tensor at a time
    like a real one, so the loader's own path (host → device → quantize) is what gets measured."""

    def __init__(self, decoder, config: dict):
        self.config = config
        self.shapes = {name: a.shape for p in params(decoder) for name, a in per_source(p, p.get_value())}
        self.pattern = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(np.float32)

    def get(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        return np.resize(self.pattern, shape)  # speed and memory do not depend on the values


def engine_args(doc: str, extra=None) -> argparse.Namespace:
    """The command line of the scripts that run the engine at the 12B shape: the Gemma 3 tokenizer file,
    the precision, the bucket sizes, repeats per timing and the output folder; `extra(parser)` adds a
    script's own."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--shape", default="gemma-3-12b", choices=sorted(SHAPES), help="the model shape")
    parser.add_argument("--precision", default="fp8")
    parser.add_argument("--buckets", default="4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


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


def companions_agree(engine, request: dict, response: dict) -> bool:
    """Whether the scores of `response` (the whole job) come back with the same bits when the first article
    is asked every other question and the last one 4 questions in another order, in one request."""
    ids = [q["id"] for q in request["scoring"]["queries"]]
    first, last = request["inputs"][0], request["inputs"][-1]
    fewer = engine.score(
        {
            **request,
            "inputs": [{**first, "query_ids": ids[::2]}, {**last, "query_ids": ids[::-14][:4]}],
        }
    )["results"]
    whole = {r["input_id"]: {q["id"]: q for q in r["queries"]} for r in response["results"]}
    return all(q == whole[r["input_id"]][q["id"]] for r in fewer for q in r["queries"])


def timed(fn, *args, repeats: int = 5) -> float:
    """Median seconds of `fn(*args)` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_rate(m: int, k: int, n: int, dtype, seconds: float = 0.3) -> float:
    """TFLOP/s of `x @ Wᵀ` (x [m, k], W [n, k], bf16 out: the layout cuBLASLt's fp8 path wants) at a steady
    state: calls of eight GEMMs, each its own x and W (no slicing copies, nothing for XLA to merge),
    dispatched back to back for `seconds` after as long a warm-up, so neither the host's dispatch nor the
    clocks' ramp from idle is in the number."""
    loop = 8  # GEMMs per call
    keys = jax.random.split(jax.random.key(1), 2 * loop)
    xs = [jax.random.normal(key, (m, k), jnp.bfloat16).astype(dtype) for key in keys[:loop]]
    ws = [jax.random.normal(key, (n, k), jnp.bfloat16).astype(dtype) for key in keys[loop:]]
    contract = (((1,), (1,)), ((), ()))
    gemms = jax.jit(
        lambda xs, ws: [
            jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.bfloat16)
            for x, w in zip(xs, ws, strict=True)
        ]
    )
    calls = max(1, round(seconds / timed(gemms, xs, ws, repeats=1)))
    for _ in range(2):  # warm up, then measure
        start, last = time.perf_counter(), None
        for _ in range(calls):  # two calls in flight: one queued while the host waits on the other
            out = gemms(xs, ws)
            jax.block_until_ready(last)
            last = out
        jax.block_until_ready(last)
        elapsed = time.perf_counter() - start
    return 2 * m * k * n * loop * calls / elapsed / 1e12


def gemm_peaks(decoder=None, rows: int = 1024) -> dict:
    """The GEMM peaks measured now, as steady rates (gemm_rate): fp8's is the best over 8192³ and, given a
    decoder, its linear layers' own shapes at `rows` rows (what a row tile of the engine multiplies); bf16's
    is 8192³'s. Every shape's rate is kept under "gemm_rates"."""
    shapes = {(8192, 8192, 8192)}
    if decoder is not None:
        shapes |= {(rows, k, n) for n, k in linear_shapes(decoder)}
    rates = {f"fp8 {m}x{k}x{n}": gemm_rate(m, k, n, jnp.float8_e4m3fn) for m, k, n in sorted(shapes)}
    bf16 = gemm_rate(8192, 8192, 8192, jnp.bfloat16)
    return {
        "fp8_gemm_tflops": max(rates.values()),
        "bf16_gemm_tflops": bf16,
        "gemm_rates": rates | {"bf16 8192x8192x8192": bf16},
    }


def linear_shapes(decoder) -> set[tuple[int, int]]:
    """The distinct [out, in] shapes of the decoder layers' linear weights (one layer's, not stacked)."""
    return {tuple(p.get_value().shape[-2:]) for p in params(decoder.stacks) if p.kind is Kind.LINEAR}


def linear_params(decoder) -> int:
    """Parameters of the decoder layers' linear projections a token goes through (what model-FLOPs
    utilisation counts): of a mixture of experts, only the top k of its E experts."""
    total = 0
    for module in decoder.stacks:
        for _, node in nnx.iter_graph(module):
            if isinstance(node, Experts):
                share = node.top_k / node.count
                total -= (1 - share) * sum(math.prod(w.get_value().shape) for w in _expert_params(node))
    return int(
        total + sum(math.prod(p.get_value().shape) for p in params(decoder.stacks) if p.kind is Kind.LINEAR)
    )


def _expert_params(experts) -> list:
    return [w for w in (experts.gate_up, experts.gate, experts.up, experts.down) if w is not None]


def report(questions: int, tokens: int, seconds: float, peak_gib: float, params: int, peaks: dict) -> dict:
    """One engine's line: rates, memory, and 2 × linear parameters × useful tokens over each measured peak."""
    flops = 2 * params * tokens / seconds
    return {
        "questions": questions,
        "tokens": tokens,
        "seconds": seconds,
        "questions_per_second": questions / seconds,
        "tokens_per_second": tokens / seconds,
        "peak_device_gib": peak_gib,
        "mfu_vs_fp8_peak": flops / (peaks["fp8_gemm_tflops"] * 1e12),
        "mfu_vs_bf16_peak": flops / (peaks["bf16_gemm_tflops"] * 1e12),
    }


def random_engine(args, name: str | None = None):
    """An Engine at the shape args.shape (Gemma 3 12B's by default) with made-up weights, the Gemma 3
    tokenizer (args.tokenizer, folded into a smaller vocabulary), args.precision and args.buckets (and
    args.row_tile where a script has it and it is set; else the backend's, loader.default_row_tile)."""
    from spinf_jax.engine import Engine
    from spinf_jax.loader import Model, load_weights
    from spinf_jax.models import abstract_decoder
    from spinf_jax.packer import Buckets
    from spinf_jax.quant import Precision

    shape = getattr(args, "shape", "gemma-3-12b")
    config = SHAPES[shape]
    decoder = abstract_decoder(config, Precision(args.precision))
    load_weights(decoder, SyntheticCheckpoint(decoder, config))
    buckets = tuple(int(b) for b in args.buckets.split(","))
    tok = shape_tokenizer(args.tokenizer, config)
    model = Model(name or f"{shape}-shape-random", decoder, tok, digest="random-0")
    if getattr(args, "row_tile", None):
        model = model.with_row_tile(args.row_tile)
    return Engine(model, Buckets(buckets))


def warm_seed_engine(args):
    """random_engine(args) and the seed job as one request, scored once: every bucket the job uses compiled
    and warm, and its floors cached."""
    engine = random_engine(args)
    request = seed_request(seed_job())
    engine.score(request)
    return engine, request


def serve_in_thread(app):
    """The app on uvicorn on a free port, in this process; returns (uvicorn server, httpx client) once
    /health says the model is ready."""
    import contextlib
    import socket
    import threading

    import httpx
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    health = {"status": "warming_up"}
    while health["status"] == "warming_up":
        time.sleep(0.5)
        with contextlib.suppress(httpx.TransportError):  # not listening yet
            health = client.get("/health").json()
    assert health["status"] == "ok", health
    return server, client, health


def served_shape_arguments(parser) -> None:
    """The flags of the benchmarks that serve made-up weights at a real shape (`serve --random-weights`)."""
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--config", help="a transformers config.json (default: Gemma 3 12B's text config)")
    parser.add_argument("--precision", default="fp8")
    parser.add_argument(
        "--buckets",
        default=",".join(map(str, default_sizes())),
        help="pass sizes, comma-separated (default: the server's on this backend)",
    )


def served_shape_config(config: str | None, out: Path) -> Path:
    """--config, or Gemma 3 12B's text config written into `out`."""
    if config:
        return Path(config)
    written = out / "gemma-3-12b.json"
    written.write_text(json.dumps(GEMMA3_12B))
    return written


def write_articles(job: dict, count: int, path: Path) -> Path:
    """`count` of the seed job's articles, round and round, as the bulk command's JSON Lines input."""
    with path.open("w") as f:
        for k in range(count):
            c = job["contents"][k % len(job["contents"])]
            f.write(json.dumps({"id": f"{c['id']}-{k}", "text": c["text"]}) + "\n")
    return path


def write_cpu_document(benchmark: str, out: str | None, **fields) -> None:
    """A CPU benchmark's result: its name, the date, the machine and the command line, then `fields`;
    printed as one JSON line, and written to `out` where given."""
    document = {
        "benchmark": benchmark,
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, no accelerator)",
        "command": f"python benchmarks/{benchmark}.py " + shlex.join(sys.argv[1:]),
        **fields,
    }
    if out:
        Path(out).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document))


# Qwen3.5-4B's layer pattern and recurrent chunk layout at narrow widths, Gemma 3's vocabulary (the
# tokenizer's): the layers' widths do not change how a pass is laid out.
QWEN3_5_LAYOUT = QWEN3_5_4B | {
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 262144,
}  # fmt: skip


def qwen3_5_seed_passes(tokenizer: str, buckets: str):
    """The seed job planned and packed by the server's own planner for a Qwen3.5-shaped model (bucket sizes
    "4096,16384"): (the scoring plan, its passes)."""
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder, "config.json")
        config.write_text(json.dumps(QWEN3_5_LAYOUT))
        model = random_model(config, tokenizer, "fp32")
    sizes = Buckets(tuple(int(b) for b in buckets.split(",")), block=64, recurrent=True)
    plan = Scorer(Engine(model, sizes)).plan(seed_request(seed_job()))
    return plan, pack(plan.trees, sizes)
