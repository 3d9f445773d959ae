"""The rows a batch takes in passes, for several bucket sets: what padding each set costs the request shapes
of http_throughput.py. Counts, not timings: the server's planner lays out the requests (Gemma 3's tokenizer,
floors cached, trees on 16-row boundaries, 64-row attention blocks as on GPUs) and packer.pack cuts them by
rows plus its pass overhead, so any machine gives the same table. A second table counts the rows of the trees
alone at several tree alignments (a tree starts on a multiple of the alignment, so a short tree pays up to
that many rows).

    python3 benchmarks/bucket_rows.py --tokenizer TOKENIZER_FOLDER [--out DIR]

A pass's time follows its rows, padding included, so "useful" (the requests' tokens over the rows of their
passes) is the share of a pass's work that answers something.
"""

import argparse
import json
from pathlib import Path

from common import seed_job, seed_request
from host_costs import SMALL
from http_throughput import PACK, article_bodies, pack_bodies

from spinf_jax.engine import Engine
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets, pack
from spinf_jax.packs.compiled import compile_packs
from spinf_jax.scoring import Scorer

# Tree alignments to count: 16 is the packer's (Buckets.align); 64 was the GPUs' until 2026-12-06.
ALIGNMENTS = (16, 32, 64, 128)
SETS = {
    "4,096 + 16,384 (http runs 1-10)": (4096, 16384),
    "powers of two (the GPU default until 2026-12-05)": (2048, 4096, 8192, 16384),
    "every 2,048 from 2,048 (the GPU default until 2026-12-06)": tuple(range(2048, 16384 + 1, 2048)),
    "every 2,048 from 4,096 (the GPU default now)": tuple(range(4096, 16384 + 1, 2048)),
}


def requests(job: dict) -> dict[str, dict]:
    """The seed job as one request, n one-article requests gathered into one batch (what a pass holds at 8
    clients: the requests that arrived while the last one ran), and three moderation-pack requests."""
    articles = article_bodies(job)
    out = {"seed job (24 articles)": seed_request(job)}
    for n in (2, 3, 4, 5, 6, 8):
        inputs = [i for body in articles[:n] for i in body["inputs"]]
        out[f"{n} one-article requests"] = {"inputs": inputs, "scoring": articles[0]["scoring"]}
    packs = pack_bodies()[:3]
    out["3 pack requests (96 messages)"] = {
        "inputs": [i for b in packs for i in b["inputs"]],
        "packs": [{"id": PACK}],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "small.json").write_text(json.dumps(SMALL))
    model = random_model(out / "small.json", args.tokenizer, "fp32")
    scorer = Scorer(
        Engine(model, Buckets((2048, 4096), block=64)), packs=compile_packs(None, model.tokenizer)
    )
    job = seed_job()
    scorer.score(
        seed_request(job)
    )  # the questions' floors, cached: later plans hold the requests' trees only
    results, lines = {}, ["| batch | tokens | " + " | ".join(SETS) + " |", "|---" * (len(SETS) + 2) + "|"]
    aligned = ["| batch | " + " | ".join(f"on {b} rows" for b in ALIGNMENTS) + " |"]
    aligned.append("|---" * (len(ALIGNMENTS) + 1) + "|")
    for name, request in requests(job).items():
        trees = scorer.plan(request).trees
        tokens = sum(len(t) for t in trees)
        row = {"tokens": tokens}
        # The rows the trees take on their own, each rounded up to whole blocks, before any bucket.
        rows = {b: sum(-(-len(t) // b) * b for t in trees) for b in ALIGNMENTS}
        row["aligned_rows"] = rows
        aligned.append(
            f"| {name} | " + " | ".join(f"{rows[b]:,} ({tokens / rows[b]:.0%})" for b in ALIGNMENTS) + " |"
        )
        for set_name, sizes in SETS.items():
            passes = [p.size for p in pack(trees, Buckets(sizes, block=64))]
            row[set_name] = {"passes": passes, "rows": sum(passes), "useful": tokens / sum(passes)}
        results[name] = row
        cells = [
            f"{'+'.join(map(str, row[s]['passes']))} = {row[s]['rows']:,} ({row[s]['useful']:.0%})"
            for s in SETS
        ]
        lines.append(f"| {name} | {tokens:,} | " + " | ".join(cells) + " |")
    (out / "bucket_rows.json").write_text(json.dumps(results, indent=1) + "\n")
    lines += [
        "",
        "Rows of the trees alone, each rounded up to a multiple of the alignment:",
        "",
        *aligned,
    ]
    (out / "bucket_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
