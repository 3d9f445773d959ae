"""What the server's CPU spends per request around a pass, step by step, for the request shapes of
http_throughput.py and decisions_http.py (Kev's: a new ~100-token state and 6 typed questions, through
/v1/systemone, and 16 such states through /v1/systemone/batch): decode the body, plan (compile the request,
lay out its trees, look up floors), pack the trees into passes, turn a pass's outputs into per-tree results,
finish (the response object) and encode it.

    python3 benchmarks/host_costs.py [--tokenizer FOLDER] [--buckets 4096,16384] [--out DIR]

The steps are the server's own calls, timed one at a time on this machine's CPU (median of --repeats). The
device pass itself is not a host cost and is not timed: each shape is scored once to have results to finish.
Host costs depend on the tokenizer, the request and the buckets, not on the model's width or depth, so the
model is a two-layer Gemma 3 with made-up weights (loader.random_model) and Gemma 3's real tokenizer (that of
the default model, or a folder holding its tokenizer.json): the passes run in seconds even on a CPU.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import msgspec
import numpy as np
from common import GEMMA3_12B, seed_job, seed_request
from decisions_http import BATCH, QUESTIONS, state
from http_throughput import article_bodies, pack_bodies, seventy_four

from spinf_jax import api, systemone
from spinf_jax.builtin_models import DEFAULT_MODEL
from spinf_jax.decision_apis import DecisionApis
from spinf_jax.decoding import decode
from spinf_jax.engine import Engine
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets, pack
from spinf_jax.packs.compiled import compile_packs
from spinf_jax.scoring import Scorer

STEPS = ("decode", "plan", "pack", "results", "finish", "encode")
# Gemma 3 12B's vocabulary, rope and attention pattern at two narrow layers.
SMALL = GEMMA3_12B | {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "query_pre_attn_scalar": 64,
}  # fmt: skip


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL, help="a model or a folder with tokenizer.json")
    parser.add_argument("--buckets", default="4096,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=".")
    return parser.parse_args()


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def costs(engine: Engine, route: tuple, body: dict, repeats: int) -> dict:
    """`route`: (the body's type, its plan and its finish, as the server calls them)."""
    kind, plan_of, finish = route
    raw = msgspec.json.encode(body)
    request = decode(raw, kind)
    plan = plan_of(request)  # the first plan scores the floors; they are cached after it, as in serving
    scored = engine.score_trees(plan.trees)
    finish(plan, scored)
    plan = plan_of(request)
    scored = engine.score_trees(plan.trees)
    launched = engine.launch(plan.trees)
    # Each pass's device outputs (its targets' logits and its read chunks), on the host already: the step
    # times the host's work on them, not the wait for the device.
    outputs = [
        (p, np.asarray(picked), [tuple(map(np.asarray, chunk)) for chunk in chunks])
        for p, (picked, chunks), _ in launched.running
    ]
    engine.collect(launched)

    def results():
        for p, picked, chunks in outputs:
            engine._scored(p, launched, *engine._results(p, picked, chunks))

    response = finish(plan, scored)
    ms = {
        "decode": median_ms(lambda: decode(raw, kind), repeats),
        "plan": median_ms(lambda: plan_of(request), repeats),
        "pack": median_ms(lambda: pack(plan.trees, engine.buckets), repeats),
        "results": median_ms(results, repeats),
        "finish": median_ms(lambda: finish(plan, scored), repeats),
        "encode": median_ms(lambda: msgspec.json.encode(response), repeats),
    }
    return {
        "inputs": plan.inputs,
        "questions": plan.questions,
        "trees": len(plan.trees),
        "tokens": sum(len(t) for t in plan.trees),
        "ms": ms,
        "total_ms": sum(ms.values()),
    }


def table(rows: dict) -> str:
    lines = [
        "| request | inputs | questions | tokens | " + " | ".join(f"{s} ms" for s in STEPS) + " | total ms |",
        "|---" * (len(STEPS) + 5) + "|",
    ]
    for name, r in rows.items():
        steps = " | ".join(f"{r['ms'][s]:.2f}" for s in STEPS)
        lines.append(
            f"| {name} | {r['inputs']} | {r['questions']} | {r['tokens']} | {steps} | {r['total_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "gemma3-small.json"
    config.write_text(json.dumps(SMALL))
    model = random_model(config, args.tokenizer, "fp32")
    engine = Engine(model, Buckets(tuple(int(b) for b in args.buckets.split(","))))
    scorer = Scorer(engine, packs=compile_packs(None, model.tokenizer))
    apis = DecisionApis(engine)
    score = (api.ScoreRequest, scorer.plan, scorer.finish)
    one = (systemone.SystemOneRequest, apis.plan_systemone, apis.finish_systemone)
    batch = (systemone.SystemOneBatchRequest, apis.plan_systemone_batch, apis.finish_systemone_batch)
    job = seed_job()
    kev = {"model": "jev-latest", "questions": QUESTIONS}
    shapes = {
        "seed job, one request": (score, seed_request(job)),
        "one article, 56 questions": (score, article_bodies(job)[0]),
        "one article, 74 questions": (score, seventy_four(job)[0]),
        "moderation pack, 32 messages": (score, pack_bodies()[0]),
        "moderation pack, 1 message": (score, pack_bodies(1)[0]),
        "systemone, Kev's shape": (one, kev | {"state": state(0, 0)}),
        f"systemone batch, {BATCH} of Kev's shape": (
            batch,
            kev | {"states": [state(0, i) for i in range(BATCH)]},
        ),
    }
    rows = {name: costs(engine, route, body, args.repeats) for name, (route, body) in shapes.items()}
    text = table(rows)
    (out / "host_costs.json").write_text(json.dumps({"model": model.name, "rows": rows}, indent=1))
    (out / "host_costs.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
