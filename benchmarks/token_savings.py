"""Tokens the engine processes vs a one-request-per-question server, on the seed job.

The job (fixtures/jobs/seed_job.json): 24 articles of ~470 tokens, 56 two-option questions each. The engine
reads each article once and branches every question off it; a one-request-per-question server reads
BOS + article + question once per question. Scores are checked against plain full forwards of sampled
questions. Prints a table and ends with one JSON line; --out writes the JSON too.

    uv run python benchmarks/token_savings.py --model spinf/gemma-3-270m --precision fp32 --out FILE
"""

import argparse
import json
import os
import random
import time
from datetime import date
from pathlib import Path

import jax
import numpy as np
from common import seed_job, seed_request

from spinf_jax.engine import Engine
from spinf_jax.models.layers import TreeBatch
from spinf_jax.packer import Buckets, pack
from spinf_jax.scoring import Scorer


def plain_logprob(model, ids: list[int], option: list[int]) -> float:
    seq = ids + option
    hidden = model.hidden(TreeBatch.sequence(seq))
    rows = np.arange(len(ids) - 1, len(seq) - 1)
    lp, _ = model.logprobs(hidden[rows], np.asarray(option, np.int32)[:, None])
    return float(np.sum(np.asarray(lp, np.float64)))


def machine() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    devices = jax.devices()
    return f"{jax.default_backend()}: {devices[0].device_kind} x{len(devices)}; {cpu}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="spinf/gemma-3-270m")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--check", type=int, default=12, help="questions checked against plain forwards")
    parser.add_argument("--out")
    args = parser.parse_args()

    job = seed_job()
    engine = Engine.load(args.model, args.precision, buckets=Buckets((4096, 8192, 16384)))
    tok = engine.model.tokenizer
    request = seed_request(job)

    plan = Scorer(engine).plan(request)  # what the first call runs: content trees, then floor trees
    passes = pack(plan.trees, engine.buckets)
    start = time.perf_counter()
    response = engine.score(request)
    first_call = time.perf_counter() - start
    start = time.perf_counter()
    again = engine.score(request)  # compiled programs and floors cached now
    second_call = time.perf_counter() - start
    assert again["results"] == response["results"], "two calls must give the same scores"

    # What the engine actually ran, padding included.
    contents = [tok.prefix() + tok.encode(c["text"]) for c in job["contents"]]
    templates = [tok.encode(q["template"].replace("{?}", "")) for q in job["questions"]]
    usage = response["usage"]["prompt_tokens_details"]
    padded = sum(p.size for p in passes)
    per_question = sum(len(c) + len(t) for c in contents for t in templates)  # options are 1 token
    engine_tokens = usage["content_tokens"] + usage["query_tokens"]

    rng = random.Random(0)
    diffs = []
    for _ in range(args.check):
        ci, qi = rng.randrange(len(contents)), rng.randrange(len(templates))
        options = response["results"][ci]["queries"][qi]["combinations"][0]["options"]
        for option in options:
            expected = plain_logprob(engine.model, contents[ci] + templates[qi], tok.encode(option["text"]))
            diffs.append(abs(expected - option["logprob"]))

    result = {
        "benchmark": "token_savings",
        "date": date.today().isoformat(),
        "machine": machine(),
        "model": args.model,
        "precision": args.precision,
        "contents": len(contents),
        "questions_per_content": len(templates),
        "mean_content_tokens": float(np.mean([len(c) for c in contents])),
        "mean_question_tokens": float(np.mean([len(t) for t in templates])),
        "one_request_per_question_tokens": per_question,
        "engine_tokens": engine_tokens,
        "engine_floor_tokens": usage["floor_tokens"],
        "engine_tokens_padded": padded,
        "ratio": per_question / engine_tokens,
        "passes": [p.size for p in passes],
        "ratio_first_call_as_run": per_question / padded,
        "checked_questions": args.check,
        "max_abs_logprob_diff_vs_plain_forward": max(diffs),
        "first_call_seconds": first_call,
        "second_call_seconds": second_call,
    }
    rows = [
        ("one request per question (BOS + article + question)", per_question),
        ("engine: trunk + branches", engine_tokens),
        ("engine: floor trees (first call only; cached after)", usage["floor_tokens"]),
        ("engine: first call's passes as run (padding included)", padded),
    ]
    for name, n in rows:
        print(f"{name:<55} {n:>10,}")
    print(f"{'saving: one-per-question tokens / engine tokens':<55} {result['ratio']:>10.2f}x")
    first = result["ratio_first_call_as_run"]
    print(f"{'saving on the first call as run (floors, padding)':<55} {first:>10.2f}x")
    print(
        f"{'max |Δ logprob| vs plain forwards':<55} {result['max_abs_logprob_diff_vs_plain_forward']:>10.2e}"
    )
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
