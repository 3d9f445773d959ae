"""The moderation pack in the library at attention blocks of 128 and 64 rows, side by side in one process.

    python3 benchmarks/pack_block.py --tokenizer TOKENIZER_JSON --out $OUT [--buckets 4096,16384]
        [--repeats 5]

One model (Gemma 3 12B's shape, made-up weights: common.random_engine) and two engines over it, one per
block. Every message of the pack's synthetic data goes in one request (a server under load packs passes as
full), scored --repeats times per block, the blocks taking turns. Reports, per block: the rows its passes
take, messages/s (the median call) and whether each message's pack result is the same bits at both blocks
(packer.default_block says why they should be on GPUs). Writes pack_block.json and pack_block.md.
"""

import json
import statistics
import time
from pathlib import Path

from common import engine_args, random_engine
from http_throughput import PACK, pack_bodies

from spinf_jax.engine import Engine
from spinf_jax.packer import Buckets, pack
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
    engines = {block: Engine(first.model, Buckets(first.buckets.sizes, block=block)) for block in (128, 64)}
    scorers = {block: Scorer(engine, packs=packs) for block, engine in engines.items()}
    answers = {block: scorer.score(request) for block, scorer in scorers.items()}  # compiled, floors cached
    times = {block: [] for block in scorers}
    for _ in range(args.repeats):
        for block, scorer in scorers.items():
            start = time.perf_counter()
            scorer.score(request)
            times[block].append(time.perf_counter() - start)
    messages = len(request["inputs"])
    rows = {}
    for block, scorer in scorers.items():
        passes = pack(scorer.plan(request).trees, engines[block].buckets)
        rows[block] = {
            "passes": [p.size for p in passes],
            "rows": sum(p.size for p in passes),
            "seconds": statistics.median(times[block]),
            "messages_per_second": messages / statistics.median(times[block]),
            "all_seconds": times[block],
        }
    same = [a["packs"] for a in answers[128]["results"]] == [a["packs"] for a in answers[64]["results"]]
    result = {"messages": messages, "buckets": args.buckets, "blocks": rows, "same_bits": same}
    (out / "pack_block.json").write_text(json.dumps(result, indent=1))
    ratio = rows[64]["messages_per_second"] / rows[128]["messages_per_second"]
    table = [
        f"moderation pack, {messages} messages in one request, buckets {args.buckets}, "
        f"median of {args.repeats}",
        "",
        "| block | passes | rows | seconds | messages/s |",
        "|---|---|---|---|---|",
        *[
            f"| {b} | {len(r['passes'])} | {r['rows']:,} | {r['seconds']:.3f} "
            f"| {r['messages_per_second']:,.0f} |"
            for b, r in rows.items()
        ],
        "",
        f"64 / 128: {ratio:.3f}x messages/s; the same bits at both blocks: {same}",
    ]
    (out / "pack_block.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
