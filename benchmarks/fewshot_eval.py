"""Few-shot examples in a closed question: where they go, what the floor then means, and how much the choice
of examples moves the scores. Not run in CI.

The review sentences of benchmarks/data/review_sentiment.jsonl (made by make_eval_sets.py), asked through a
running server as "Review: <sentence>" + "\nSentiment:" + " positive" / " negative", four ways:
- `zero_shot`: the review alone;
- `content_a`, `content_b`: four labelled example reviews written before the review, in the content (two
  sets of four, the same labels in the same order, different sentences);
- `template_a`: set A in the template, after the review.
Per way it measures accuracy choosing by `p`, by log-lift over the API's floor (`log p - log floor_p`: the
question on empty content), and by log-lift over the same text with an empty review (the examples and
"Review: " without a sentence, which is what a prompt pack's floor is when its presentation has examples),
with 95% bootstrap intervals; and between content_a and content_b, the mean |Δ p(positive)| over the rows and
how often their choices differ.

    uv run --extra server --extra models spinf-jax serve --precision fp32 &
    uv run --extra server --extra models python benchmarks/fewshot_eval.py --out FILE
"""

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import httpx
import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "review_sentiment.jsonl"
OPTIONS = [" positive", " negative"]
QUESTION = "\nSentiment:{?}"
# Written for this benchmark, not taken from the set: same labels, same order, different sentences.
EXAMPLES = {
    "a": [
        ("The blender is quiet and crushes ice in seconds.", "positive"),
        ("The hinge snapped after a week of normal use.", "negative"),
        ("Our waiter was attentive and the soup was superb.", "positive"),
        ("The second half of the film drags and the ending is silly.", "negative"),
    ],
    "b": [
        ("These headphones sound great and the battery lasts for days.", "positive"),
        ("The soles came apart the first time it rained.", "negative"),
        ("A warm little cafe with the best croissants in town.", "positive"),
        ("The actors look bored and the jokes never land.", "negative"),
    ],
}


def examples(name: str) -> str:
    return "".join(f"Review: {text}\nSentiment: {label}\n\n" for text, label in EXAMPLES[name])


def ways() -> dict[str, tuple]:
    """name → (content prefix, template)."""
    after = "\n\nFor reference, other reviews and their sentiment:\n\n" + examples("a")
    return {
        "zero_shot": ("Review: ", QUESTION),
        "content_a": (examples("a") + "Review: ", QUESTION),
        "content_b": (examples("b") + "Review: ", QUESTION),
        "template_a": ("Review: ", after + "The first review's sentiment:{?}"),
    }


def ask(url: str, texts: list[str], template: str, batch: int) -> list[dict]:
    """Per content: p and floor_p of each option."""
    out = []
    query = {"id": "sentiment", "template": template, "options": OPTIONS}
    for start in range(0, len(texts), batch):
        inputs = [{"messages": [{"content": text}]} for text in texts[start : start + batch]]
        response = httpx.post(
            f"{url}/v1/score", json={"inputs": inputs, "scoring": {"queries": [query]}}, timeout=1200
        )
        response.raise_for_status()
        for result in response.json()["results"]:
            options = result["queries"][0]["combinations"][0]["options"]
            out.append({"p": [o["p"] for o in options], "floor_p": [o["floor_p"] for o in options]})
    return out


def interval(right: np.ndarray, draws: int = 2000) -> list[float]:
    rng = np.random.default_rng(0)
    means = [float(np.mean(right[rng.integers(0, len(right), len(right))])) for _ in range(draws)]
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--limit", type=int, help="only the first N rows")
    parser.add_argument("--batch", type=int, default=25, help="rows per request")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()][: args.limit]
    labels = np.array([OPTIONS.index(" " + row["label"]) for row in rows])
    health = httpx.get(f"{args.url}/health", timeout=60).json()
    results, replies = {}, {}
    for name, (prefix, template) in ways().items():
        replies[name] = reply = ask(args.url, [prefix + row["state"] for row in rows], template, args.batch)
        [empty] = ask(args.url, [prefix], template, 1)  # the same text with an empty review
        p = np.array([r["p"] for r in reply])
        floor = np.array([r["floor_p"] for r in reply])
        chosen = {
            "p": np.argmax(p, 1),
            "lift": np.argmax(np.log(p) - np.log(floor), 1),
            "lift_empty_review": np.argmax(np.log(p) - np.log(empty["p"]), 1),
        }
        results[name] = {"floor_p": floor[0].tolist(), "empty_review_p": empty["p"]}
        line = f"{name:<11}"
        for rule, choice in chosen.items():
            right = (choice == labels).astype(float)
            results[name][f"accuracy_{rule}"] = float(right.mean())
            results[name][f"accuracy_{rule}_ci95"] = interval(right)
            results[name][f"chose_positive_{rule}"] = float(np.mean(choice == 0))
            line += f" {rule} {right.mean():.3f} {interval(right)}"
        print(line + f"  floor p(positive) {floor[0][0]:.3f}, empty review {empty['p'][0]:.3f}", flush=True)
    a = np.array([r["p"][0] for r in replies["content_a"]])
    b = np.array([r["p"][0] for r in replies["content_b"]])
    swap = {
        "mean_abs_delta_p_positive": float(np.mean(np.abs(a - b))),
        "max_abs_delta_p_positive": float(np.max(np.abs(a - b))),
        "choices_differ": float(np.mean((a > 0.5) != (b > 0.5))),
    }
    print("content_a against content_b:", swap)
    document = {
        "date": date.today().isoformat(),
        "machine": platform.node(),
        "model": health.get("model"),
        "system_fingerprint": health.get("system_fingerprint"),
        "rows": len(rows),
        "question": QUESTION,
        "options": OPTIONS,
        "examples": EXAMPLES,
        "ways": results,
        "swapping_examples": swap,
    }
    print(json.dumps(document))
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
