"""Typed decisions over HTTP on a GPU at Gemma 3 12B's shape (random weights): what reading a state once for
many decisions saves, and what option-order averaging costs. One script, one run; prints a table, ends with
one JSON line.

The job: the seed job's 24 articles (fixtures/jobs/seed_job.json, ~474 tokens each) × the 8 four-option
decisions below. Each way of asking sends the same 192 decisions through `spinf-jax serve`'s app:
- sequential: one /decide call at a time, as a client that loops over rows does;
- concurrent: /decide calls, --clients in flight (the server gathers them into shared passes);
- shared: one /decide/shared call per article (every decision a branch of one read), --clients in flight;
- shared + rotations: the same with `orderings: "rotations"` (4 orderings per decision).
Also checked, over HTTP: every decision's result in a shared call equals its /decide result, bit for bit.
Random weights give meaningless answers; the cost does not depend on the values.

    python3 benchmarks/gpu_decisions.py --tokenizer gemma3-tokenizer.json --out $OUT
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
from common import engine_args, random_engine, seed_job, serve_in_thread

from spinf_jax.server.app import create_app
from spinf_jax.server.settings import Settings


def _options(*descriptions: str) -> list[dict]:
    return [{"id": "abcd"[j], "description": d} for j, d in enumerate(descriptions)]


DECISIONS = [
    {"id": "topic", "question": "What is the article mainly about?",
     "options": _options("Politics or government", "Business or the economy", "Science or technology",
                         "Culture, sport or daily life")},
    {"id": "tone", "question": "What is the article's tone?",
     "options": _options("Neutral reporting", "Positive or celebratory", "Critical or alarmed", "Mixed")},
    {"id": "audience", "question": "Who is the article written for?",
     "options": _options("General readers", "Specialists", "Local residents", "Investors")},
    {"id": "scope", "question": "How wide is the story's reach?",
     "options": _options("Local", "National", "International", "Unclear")},
    {"id": "time", "question": "When do the events happen?",
     "options": _options("Already happened", "Happening now", "Planned or expected", "Not stated")},
    {"id": "sources", "question": "Whom does the article quote?",
     "options": _options("Officials", "Experts", "Ordinary people", "Nobody")},
    {"id": "numbers", "question": "How much does the article rely on figures?",
     "options": _options("Heavily", "Somewhat", "Barely", "Not at all")},
    {"id": "action", "question": "What should a reader do after reading it?",
     "options": _options("Nothing in particular", "Take precautions", "Take part or attend", "Buy or sell")},
]  # fmt: skip


def options(parser) -> None:
    parser.add_argument("--clients", type=int, default=8, help="requests in flight at once")


def main() -> None:
    args = engine_args(__doc__, options)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "weights": "made-up values (a repeated random pattern), Gemma 3 12B text shape",
               "precision": args.precision, "buckets": args.buckets}  # fmt: skip
    start = time.perf_counter()
    server, client, _ = serve_in_thread(create_app(Settings("gemma-3-12b-shape-random"), random_engine(args)))
    results["ready_seconds"] = time.perf_counter() - start
    articles = [c["text"] for c in seed_job()["contents"]]

    def post(path: str, body: dict) -> dict:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def alone(item: tuple[str, dict]) -> dict:
        return post("/decide", {"state": item[0], **item[1]})

    def shared(state: str, orderings: str | None = None) -> dict:
        decisions = [d | {"orderings": orderings} if orderings else d for d in DECISIONS]
        return post("/decide/shared", {"state": state, "decisions": decisions})

    pairs = [(a, d) for a in articles for d in DECISIONS]
    shared(articles[0], "rotations")  # first calls compile nothing (warm-up did), but warm the HTTP path
    alone(pairs[0])
    timings, replies = {}, {}

    def timed(name: str, run) -> None:
        start = time.perf_counter()
        replies[name] = run()
        timings[name] = time.perf_counter() - start

    timed("sequential", lambda: [alone(p) for p in pairs])
    with ThreadPoolExecutor(args.clients) as pool:
        timed("concurrent", lambda: list(pool.map(alone, pairs)))
        timed("shared", lambda: list(pool.map(shared, articles)))
        timed("shared + rotations", lambda: list(pool.map(lambda a: shared(a, "rotations"), articles)))
    server.should_exit = True

    flat = [r for reply in replies["shared"] for r in reply["results"]]
    results["shared_equals_alone"] = flat == replies["sequential"]
    results["concurrent_equals_sequential"] = replies["concurrent"] == replies["sequential"]
    rotated = [r for reply in replies["shared + rotations"] for r in reply["results"]]
    results["rotations_listed_equals_alone"] = all(
        r["orderings"][0]["probabilities"] == a["probabilities"]
        for r, a in zip(rotated, replies["sequential"], strict=True)
    )
    results["decisions"] = len(pairs)
    results["prompt_tokens_alone"] = sum(r["input_tokens"] for r in replies["sequential"])
    results["processed_tokens_shared"] = sum(reply["processed_tokens"] for reply in replies["shared"])
    results["processed_tokens_shared_rotations"] = sum(
        r["processed_tokens"] for r in replies["shared + rotations"]
    )
    results["ways"] = {
        name: {"seconds": s, "decisions_per_second": len(pairs) / s, "speedup_over_sequential":
               timings["sequential"] / s}
        for name, s in timings.items()
    }  # fmt: skip
    (out / "gpu_decisions.json").write_text(json.dumps(results, indent=2))
    print(f"\n{len(pairs)} decisions ({len(articles)} articles × {len(DECISIONS)} decisions of 4 options)")
    print("| way | seconds | decisions/s | × sequential |")
    print("|---|---|---|---|")
    for name, w in results["ways"].items():
        print(f"| {name} | {w['seconds']:.2f} | {w['decisions_per_second']:.1f} | "
              f"{w['speedup_over_sequential']:.2f} |")  # fmt: skip
    print(
        f"prompt tokens one by one {results['prompt_tokens_alone']:,}; processed shared "
        f"{results['processed_tokens_shared']:,}, "
        f"with rotations {results['processed_tokens_shared_rotations']:,}"
    )
    print(f"shared = alone: {results['shared_equals_alone']}; concurrent = sequential: "
          f"{results['concurrent_equals_sequential']}; rotations' listed order = alone: "
          f"{results['rotations_listed_equals_alone']}")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
