"""Three engines, one job, the same weights: spinf-jax against Hugging Face transformers on the seed job,
plus parity against transformers at a real model shape. One script, one run, on the GPU machine.

- Weights: a Gemma-3-12B-shaped model with transformers' own random initialisation (seed 0), handed to our
  loader tensor by tensor (no checkpoint on disk), so every engine reads the same weights.
- Baseline A: transformers (bf16, SDPA), each question a full request: BOS + article + question.
- Baseline B: transformers reading each article once and scoring its 56 questions as one padded batch over
  the copied prefix cache (the shared-prefix mode of the SemIf decision service).
- spinf-jax: fp8 (and bf16 where asked), the whole job as one request.
- Parity: the first `--parity-layers` layers of the same shape (5 sliding + 1 global covers both layer
  types), transformers fp32 (eager) against ours at fp32 / bf16 / fp8, on the seed job's first articles.

    python3 benchmarks/gpu_baselines.py --tokenizer gemma3-tokenizer.json --out $OUT
"""

import argparse
import gc
import json
import os
import re
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import tokenizers
import torch
from common import (
    GEMMA3_12B,
    GEMMA4_12B,
    GEMMA4_26B_A4B,
    QWEN3_5_9B,
    QWEN3_5_35B_A3B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    FoldedTokenizer,
    companions_agree,
    gemm_peaks,
    linear_params,
    report,
    seed_job,
    seed_request,
)
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from spinf_jax.engine import Engine
from spinf_jax.loader import Model, load_weights
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets
from spinf_jax.tokenizer import Tokenizer

FAMILIES = {
    "gemma3_text": (Gemma3ForCausalLM, Gemma3TextConfig),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),
    "gemma4_text": (Gemma4ForCausalLM, Gemma4TextConfig),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig),
    "qwen3_5_text": (Qwen3_5ForCausalLM, Qwen3_5TextConfig),
    "qwen3_5_moe_text": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig),
}
# Parity at real widths: the config, how many of its first layers (enough to cover every layer type: Qwen3.5's
# L L L F, Gemma's 5 sliding + 1 global).
PARITY = {
    "gemma3": (GEMMA3_12B, 6),
    "qwen3": (QWEN3_8B, 4),
    "gemma4": (GEMMA4_12B, 6),
    "gemma4_moe": (GEMMA4_26B_A4B, 6),
    "qwen3_moe": (QWEN3_30B_A3B, 2),
    "qwen3_5": (QWEN3_5_9B, 4),
    "qwen3_5_moe": (QWEN3_5_35B_A3B, 4),
}


class TorchWeights:
    """A loaded transformers model as a checkpoint for our loader: one tensor at a time, as f32 numpy."""

    def __init__(self, model: torch.nn.Module, config: dict):
        self.config = config
        self.state = model.state_dict()

    def get(self, name: str) -> np.ndarray:
        if name in self.state:
            return self.state[name].float().cpu().numpy()
        # One expert of a Qwen MoE: checkpoints keep it per expert, transformers 5 holds them fused in memory
        # (gate_up_proj [experts, 2 · inner, hidden], gate rows first; down_proj [experts, hidden, inner]).
        layer, expert, proj = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight", name).groups()
        fused = self.state[f"{layer}.down_proj" if proj == "down" else f"{layer}.gate_up_proj"][int(expert)]
        if proj != "down":
            fused = fused.chunk(2)[proj == "up"]
        return fused.float().cpu().numpy()


def hf_model(config: dict, dtype, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    hf_class, config_class = FAMILIES[config["model_type"]]
    cfg = config_class(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = hf_class._from_config(cfg, dtype=dtype, attn_implementation=attn)
    if config["model_type"] == "gemma4_text":
        # Gemma 4 attends with scale 1 and leaves the scale to its q/k norm weights; transformers initialises
        # them at one, which gives attention logits a std of ~sqrt(head_dim) (16-22 here): so peaked that
        # rounding alone decides a comparison. Centre them on head_dim^-1/4 (a 1/sqrt(head_dim) scale), as the
        # tiny fixtures do.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.fill_(p.shape[0] ** -0.25)
    return model.eval()


def our_engine(hf: torch.nn.Module, config: dict, precision: str, tok: Tokenizer, buckets: Buckets) -> Engine:
    decoder = abstract_decoder(config, precision)
    load_weights(decoder, TorchWeights(hf, config))
    name = f"{config['model_type']}-real-shape-{precision}"
    return Engine(Model(name, decoder, tok, digest="seed0"), buckets)


def release() -> None:
    """Free what was just dropped: Python cycles, then torch's cached blocks (JAX reuses its own pool)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def in_use() -> str:
    """Device memory held now by JAX's live arrays and torch's tensors (blank on the CPU)."""
    if not torch.cuda.is_available():
        return ""
    stats = jax.devices()[0].memory_stats() or {}
    return (
        f" [jax {stats.get('bytes_in_use', 0) / 2**30:.1f} GiB, "
        f"torch {torch.cuda.memory_allocated() / 2**30:.1f} GiB]"
    )


def parity(
    config: dict,
    layers: int,
    tok,
    request: dict,
    articles,
    questions,
    options,
    precisions=("fp32", "bf16", "fp8"),
) -> dict:
    """The first `layers` layers at the real width: transformers fp32 (eager) against ours. One precision's
    model at a time on the device: the reference moves to the host once its log-probs are taken (it is then
    only the weights our loader reads), and each of our engines is dropped before the next is built."""
    start = time.perf_counter()
    small = config | {"num_hidden_layers": layers}
    hf32 = hf_model(small, torch.float32, "eager")
    # Copying a hybrid model's recurrent states into a batch is not what its cache was made for: each question
    # as a whole sequence there.
    hybrid = config["model_type"].startswith("qwen3_5")
    _, ref = (baseline_a if hybrid else baseline_b)(hf32, articles, questions, options)
    hf32.to("cpu")  # the same f32 values, read by TorchWeights as before, off the device
    release()
    print(config["model_type"], "reference", f"{time.perf_counter() - start:.0f} s{in_use()}", flush=True)
    out = {"layers": layers, "articles": len(articles), "reference": "transformers fp32 eager"}
    for precision in precisions:
        start = time.perf_counter()
        engine = our_engine(hf32, small, precision, tok, Buckets((4096,)))
        out[precision] = agreement(ours_scores(engine.score(request), len(articles)), ref)
        del engine
        release()
        print(
            config["model_type"],
            "parity",
            precision,
            out[precision],
            f"{time.perf_counter() - start:.0f} s{in_use()}",
            flush=True,
        )
    del hf32
    release()
    return out


def job_ids(tok: Tokenizer, job: dict):
    articles = [tok.prefix() + tok.encode(c["text"]) for c in job["contents"]]
    questions = [tok.encode(q["template"].replace("{?}", "")) for q in job["questions"]]
    options = [tok.encode(o)[0] for o in job["questions"][0]["options"]]  # " yes", " no": one token each
    return articles, questions, options


@torch.inference_mode()
def baseline_a(hf, articles, questions, options) -> tuple[float, np.ndarray]:
    """Each question as its own request; returns seconds and log-probs [articles, questions, options]."""
    device = next(hf.parameters()).device
    out = np.zeros((len(articles), len(questions), len(options)))
    start = time.perf_counter()
    for a, article in enumerate(articles):
        for q, question in enumerate(questions):
            ids = torch.tensor([article + question], device=device)
            logits = hf(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
            out[a, q] = torch.log_softmax(logits, -1)[options].cpu().numpy()
    return time.perf_counter() - start, out


@torch.inference_mode()
def baseline_b(hf, articles, questions, options) -> tuple[float, np.ndarray]:
    """Each article read once; its questions as one right-padded batch over copies of its prefix cache."""
    device = next(hf.parameters()).device
    out = np.zeros((len(articles), len(questions), len(options)))
    longest = max(len(q) for q in questions)
    batch = torch.zeros((len(questions), longest), dtype=torch.long, device=device)
    mask = torch.zeros((len(questions), longest), dtype=torch.long, device=device)
    for i, q in enumerate(questions):
        batch[i, : len(q)] = torch.tensor(q)
        mask[i, : len(q)] = 1
    last = torch.tensor([len(q) - 1 for q in questions], device=device)
    start = time.perf_counter()
    for a, article in enumerate(articles):
        prefix = hf(input_ids=torch.tensor([article], device=device), use_cache=True, logits_to_keep=1)
        cache = prefix.past_key_values
        cache.batch_repeat_interleave(len(questions))
        n = len(article)
        attention = torch.cat([torch.ones((len(questions), n), dtype=torch.long, device=device), mask], dim=1)
        positions = (n + torch.arange(longest, device=device))[None].expand(len(questions), -1)
        logits = hf(
            input_ids=batch, attention_mask=attention, position_ids=positions, past_key_values=cache
        ).logits
        picked = logits[torch.arange(len(questions), device=device), last].float()
        out[a] = torch.log_softmax(picked, -1)[:, options].cpu().numpy()
    return time.perf_counter() - start, out


def ours_scores(response: dict, n_articles: int) -> np.ndarray:
    return np.array(
        [
            [[o["logprob"] for o in q["combinations"][0]["options"]] for q in r["queries"]]
            for r in response["results"][:n_articles]
        ]
    )


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """How far two engines' option log-probs are apart, and how often they pick the same option."""
    d = np.abs(a - b)
    return {
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "same_choice": float(np.mean(a.argmax(-1) == b.argmax(-1))),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--a-articles", type=int, default=6, help="articles for baseline A (it is slow)")
    parser.add_argument("--parity-layers", type=int, default=6, help="0: no parity check in this run")
    parser.add_argument("--parity-articles", type=int, default=4)
    parser.add_argument("--parity-only", action="store_true", help="only the parity checks")
    parser.add_argument(
        "--parity-models", default="gemma3,qwen3,gemma4", help=f"with --parity-only: of {list(PARITY)}"
    )
    parser.add_argument(
        "--parity-precisions", default="fp32,bf16,fp8", help="ours against the fp32 reference, in this order"
    )
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    config = dict(GEMMA3_12B)
    tok = Tokenizer(tokenizers.Tokenizer.from_file(args.tokenizer), bos_id=2, add_bos=True)
    job = seed_job()
    articles, questions, options = job_ids(tok, job)
    request = seed_request(job, empty_floor=False)
    results = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "jax": jax.__version__,
        "weights": "transformers random init, seed 0",
    }
    n_q = len(articles) * len(questions)

    # Parity at the real width, on the first layers (fp32 reference, eager attention).
    sub = {**request, "inputs": request["inputs"][: args.parity_articles]}
    precisions = tuple(args.parity_precisions.split(","))
    if args.parity_only:
        for name in args.parity_models.split(","):
            model_config, layers = PARITY[name]
            vocab = model_config["vocab_size"]
            # Token ids come from Gemma 3's tokenizer, folded into the model's vocabulary where it is smaller:
            # parity compares two implementations on the same ids, whatever text they spell.
            folded = FoldedTokenizer(tok, vocab) if vocab < config["vocab_size"] else tok
            p_articles, p_questions, p_options = job_ids(folded, job)
            results[f"parity_{name}"] = parity(
                model_config,
                layers,
                folded,
                sub,
                p_articles[: args.parity_articles],
                p_questions,
                [o % vocab for o in p_options],
                precisions,
            )
            # Each model as it ends: what a run that is cut short measured still comes back.
            Path(args.out, "gpu_parity.json").write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(results))
        return

    # Throughput: the whole model, the same weights in every engine, one run.
    decoder = abstract_decoder(config, "bf16")
    peaks = gemm_peaks(decoder)
    results["gemm_peaks"] = peaks
    params = linear_params(decoder)
    useful = [len(a) + len(q) for a in articles for q in questions]  # tokens a question needs read
    hf = hf_model(config, torch.bfloat16, "sdpa")
    baseline_b(hf, articles, questions, options)  # warm-up
    torch.cuda.reset_peak_memory_stats()
    seconds_b, scores_b = baseline_b(hf, articles, questions, options)
    tokens_b = sum(len(a) for a in articles) + len(articles) * sum(len(q) for q in questions)
    results["baseline_b"] = report(
        n_q, tokens_b, seconds_b, torch.cuda.max_memory_allocated() / 2**30, params, peaks
    )
    torch.cuda.reset_peak_memory_stats()
    seconds_a, scores_a = baseline_a(hf, articles[: args.a_articles], questions, options)
    n_a = args.a_articles * len(questions)
    tokens_a = sum(useful[:n_a])
    results["baseline_a"] = report(
        n_a, tokens_a, seconds_a, torch.cuda.max_memory_allocated() / 2**30, params, peaks
    )
    print("baselines", results["baseline_a"], results["baseline_b"], flush=True)
    save(results, args.out)  # each stage as it ends: what a run that is cut short measured still comes back
    engine = our_engine(hf, config, "fp8", tok, Buckets((16384,)))
    del hf
    torch.cuda.empty_cache()
    start = time.perf_counter()
    engine.warmup()
    results["spinf_compile_seconds"] = time.perf_counter() - start
    results["spinf_row_tile"] = engine.model.row_tile
    response = engine.score(request)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        engine.score(request)
        times.append(time.perf_counter() - start)
    usage = response["usage"]["prompt_tokens_details"]
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
    tokens = usage["content_tokens"] + usage["query_tokens"]
    results["spinf_fp8"] = report(n_q, tokens, statistics.median(times), peak, params, peaks)
    # Batch invariance at this shape: the same bits when articles are asked fewer questions, in another order.
    results["spinf_fp8_companions_equal"] = companions_agree(engine, request, response)
    ours = ours_scores(response, len(articles))
    results["spinf_fp8_vs_baseline_b"] = agreement(ours, scores_b)
    results["spinf_fp8_vs_baseline_a"] = agreement(ours[: args.a_articles], scores_a)
    results["baseline_b_vs_a"] = agreement(scores_b[: args.a_articles], scores_a)
    for key in ("baseline_a", "baseline_b", "spinf_fp8"):
        r = results[key]
        print(
            f"{key:<12} {r['questions_per_second']:>9.1f} q/s {r['tokens_per_second']:>10.0f} tok/s "
            f"{r['peak_device_gib']:>6.1f} GiB  MFU(fp8 peak) {r['mfu_vs_fp8_peak']:.1%}"
        )
    save(results, args.out)
    del engine, response
    release()
    # Parity last, so that the JAX memory peak above is the fp8 engine's alone.
    if args.parity_layers:
        results["parity"] = parity(
            config,
            args.parity_layers,
            tok,
            sub,
            articles[: args.parity_articles],
            questions,
            options,
            precisions,
        )
        save(results, args.out)
    print(json.dumps(results))


def save(results: dict, out: str) -> None:
    Path(out, "gpu_baselines.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    # transformers and JAX share the GPU: JAX must not take 75% of it up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
