"""Extraction on a GPU at Gemma 3 12B's shape with random weights: decode agrees with scoring, answers are
the same bits alone and packed, and what a searched or generated slot costs next to scoring. One script, one
run; prints a table, ends with one JSON line.

The job: the seed job's 24 articles, 4 extraction slots each (a person, a place, a number, an amount). With
random weights no answer ends early: a {*} answer with a closing quote runs to max_tokens (16) and is then
closed, so the cost here is the upper end of a searched slot's (real models close "September" after 1-3
tokens). Numbers end where a non-number token is likely, which with random weights is at once.

The cost per slot is reported in scoring-token equivalents: the decode time per slot divided by the time
one content or question token takes in the seed job's scoring, measured in the same run.

    python3 benchmarks/gpu_extraction.py --tokenizer gemma3-tokenizer.json --out $OUT
"""

import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import tokenizers
from common import GEMMA3_12B, SyntheticCheckpoint, engine_args, seed_job, seed_request

from spinf_jax.engine import Engine
from spinf_jax.layout import Extract, QuestionKey, build_tree
from spinf_jax.loader import Model, load_weights
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision
from spinf_jax.tokenizer import Tokenizer

SLOTS = [
    {"id": "person", "template": '\n\nQ: Who is the main person named in the article?\nA: "{*}'},
    {"id": "place", "template": '\n\nQ: Where does the story take place?\nA: "{*}'},
    {"id": "number", "template": "\n\nQ: What is the most important number in the article?\nA:{n}"},
    {"id": "amount", "template": "\n\nQ: What amount of money is mentioned?\nA:{$}"},
]


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # compiles what the call needs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    args = engine_args(__doc__)
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every step: a run cut short still leaves what it measured
        (out / "gpu_extraction.json").write_text(json.dumps(results, indent=2))

    results["weights"] = (
        "made-up values (a repeated random pattern), Gemma 3 12B text shape, through the loader"
    )

    decoder = abstract_decoder(GEMMA3_12B, Precision(args.precision))
    load_weights(decoder, SyntheticCheckpoint(decoder, GEMMA3_12B))
    tok = Tokenizer(tokenizers.Tokenizer.from_file(args.tokenizer), bos_id=2, add_bos=True)
    engine = Engine(Model("gemma-3-12b-shape-random", decoder, tok, digest="random-0"),
                    Buckets(tuple(int(b) for b in args.buckets.split(","))))  # fmt: skip
    start = time.perf_counter()
    engine.warmup()
    results["warmup_seconds"] = time.perf_counter() - start
    job = seed_job()

    # 1. Decode agrees with scoring: an article's searched answers, scored as options of the same question.
    article = tok.encode(job["contents"][0]["text"])
    template = tuple(tok.encode('\n\nQ: Who is the main person named in the article?\nA: "'))
    search = QuestionKey(template, extract=Extract(max_answers=8, max_tokens=6))
    [scored] = engine.score_trees([build_tree([2], article, [search])])
    answers = scored.answers[0][:5]
    [check] = engine.score_trees(
        [build_tree([2], article, [QuestionKey(template, tuple(a.tokens for a in answers))])]
    )
    gap = np.abs(check.option_logprobs(0) - np.array([a.logprob for a in answers]))
    results["decode_vs_scoring_max_abs_logprob"] = float(gap.max())
    print(
        "decode vs scoring, max |Δ logprob| over 5 answers of 6 tokens:",
        results["decode_vs_scoring_max_abs_logprob"],
        flush=True,
    )
    save()

    # 2. Throughput: the seed job's scoring, then the extraction job, then the same job with generated slots.
    scoring = seed_request(job, empty_floor=False)
    t_score, scored_job = median_seconds(lambda: engine.score(scoring), args.repeats)
    usage = scored_job["usage"]["prompt_tokens_details"]
    score_tokens = usage["content_tokens"] + usage["query_tokens"]
    per_token = t_score / score_tokens
    inputs = [{"id": c["id"], "messages": [{"role": "user", "content": c["text"]}]} for c in job["contents"]]
    extraction = {"inputs": inputs, "scoring": {"queries": SLOTS, "empty_floor": False}}
    generate = [{**q, "mode": "generate", "max_tokens": 64} for q in SLOTS]
    generated = {"inputs": inputs, "scoring": {"queries": generate, "empty_floor": False}}
    # The same reads without decoding: each slot as a one-option question (its pass costs the same).
    reads_only = {"inputs": inputs, "scoring": {"queries": [
        {"id": q["id"], "template": q["template"].rsplit("{", 1)[0] + "{?}", "options": [" x"]} for q in SLOTS
    ], "empty_floor": False}}  # fmt: skip
    t_reads, _ = median_seconds(lambda: engine.score(reads_only), args.repeats)
    results["scoring"] = {"seconds": t_score, "tokens": score_tokens, "seconds_per_token": per_token}
    results["reads_only_seconds"] = t_reads
    save()
    slots = len(inputs) * len(SLOTS)
    for name, body in (("searched", extraction), ("generated", generated)):
        seconds, response = median_seconds(lambda body=body: engine.score(body), args.repeats)
        decode_seconds = seconds - t_reads
        tokens = response["usage"]["prompt_tokens_details"]["decode_tokens"]
        combos = [c for r in response["results"] for q in r["queries"] for c in q["combinations"]]
        lengths = [len(c["answers"][0]["text"]) for c in combos if c["answers"]]
        results[name] = {
            "slots": slots,
            "seconds": seconds,
            "slots_per_second": slots / seconds,
            "decode_tokens": tokens,
            "decode_seconds_per_slot": decode_seconds / slots,
            "scoring_token_equivalents_per_slot": decode_seconds / slots / per_token,
            "mean_top_answer_chars": float(np.mean(lengths)),
        }
        # 3. Invariance: the first article's slots alone give the same answers as in the whole job.
        alone = engine.score({**body, "inputs": inputs[:1]})
        results[name]["alone_equals_packed"] = alone["results"][0] == response["results"][0]
        print(name, results[name], flush=True)
        save()
    print("\n| job | slots/s | decode tokens | decode s/slot | scoring-token equiv./slot | alone = packed |")
    print("|---|---|---|---|---|---|")
    for name in ("searched", "generated"):
        r = results[name]
        cells = (r["slots_per_second"], r["decode_tokens"], r["decode_seconds_per_slot"])
        print("| {} | {:.1f} | {} | {:.4f} ".format(name, *cells), end="")
        print(f"| {r['scoring_token_equivalents_per_slot']:.0f} | {r['alone_equals_packed']} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
