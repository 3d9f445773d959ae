"""The moderation pack in the library with trees on 64- and on 16-row boundaries, side by side in one process.

    python3 benchmarks/pack_alignment.py --tokenizer TOKENIZER_JSON --out $OUT [--buckets 4096,16384]
        [--repeats 5]

One model (Gemma 3 12B's shape, made-up weights: common.random_engine) and two engines over it, one per
tree alignment (`Buckets.align`; 64 was the GPUs' until 2026-12-06, when trees took whole attention blocks).
Every message of the pack's synthetic data goes in one request (a server under load packs passes as full),
scored --repeats times per alignment, the two taking turns. Reports, per alignment: the rows its passes take,
messages/s (the median call) and whether each message's pack result is the same bits at both (attention
counts a tree's keys from its own first row: docs/batch-invariance.md). Writes pack_alignment.json and
pack_alignment.md. (Until 2026-12-06 this was pack_block.py, which compared 128- and 64-row blocks.)
"""

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from common import engine_args, random_engine
from http_throughput import PACK, pack_bodies

from spinf_jax.engine import Engine
from spinf_jax.packer import pack
from spinf_jax.packs.compiled import compile_packs
from spinf_jax.scoring import Scorer


def main() -> None:
    args = engine_args(__doc__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = random_engine(args)
    packs = compile_packs(None, first.model.tokenizer)
    bodies = pack_bodies()
    request = {"inputs": [i for body in bodies for i in body["inputs"]], "packs": [{"id": PACK}]}
    engines = {align: Engine(first.model, replace(first.buckets, align=align)) for align in (64, 16)}
    scorers = {align: Scorer(engine, packs=packs) for align, engine in engines.items()}
    answers = {align: scorer.score(request) for align, scorer in scorers.items()}  # compiled, floors cached
    times = {align: [] for align in scorers}
    for _ in range(args.repeats):
        for align, scorer in scorers.items():
            start = time.perf_counter()
            scorer.score(request)
            times[align].append(time.perf_counter() - start)
    messages = len(request["inputs"])
    rows = {}
    for align, scorer in scorers.items():
        passes = pack(scorer.plan(request).trees, engines[align].buckets)
        rows[align] = {
            "passes": [p.size for p in passes],
            "rows": sum(p.size for p in passes),
            "seconds": statistics.median(times[align]),
            "messages_per_second": messages / statistics.median(times[align]),
            "all_seconds": times[align],
        }
    same = [a["packs"] for a in answers[64]["results"]] == [a["packs"] for a in answers[16]["results"]]
    result = {"messages": messages, "buckets": args.buckets, "alignments": rows, "same_bits": same}
    (out / "pack_alignment.json").write_text(json.dumps(result, indent=1))
    ratio = rows[16]["messages_per_second"] / rows[64]["messages_per_second"]
    table = [
        f"moderation pack, {messages} messages in one request, buckets {args.buckets}, "
        f"median of {args.repeats}",
        "",
        "| trees on | passes | rows | seconds | messages/s |",
        "|---|---|---|---|---|",
        *[
            f"| {b} | {len(r['passes'])} | {r['rows']:,} | {r['seconds']:.3f} "
            f"| {r['messages_per_second']:,.0f} |"
            for b, r in rows.items()
        ],
        "",
        f"16 / 64: {ratio:.3f}x messages/s; the same bits at both: {same}",
    ]
    (out / "pack_alignment.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
