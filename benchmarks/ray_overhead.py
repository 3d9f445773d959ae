"""What Ray Data adds per batch, without a model: the map_batches stage of spinf_jax.ray with its engine
swapped for a scorer that answers at once, over rows the size of a news article, on a local cluster. The
time per batch is then all Ray's (blocks, actor calls, ordering, the driver's iteration) plus our row
handling; set against a GPU's time per batch it gives the overhead of a Ray job (docs/scale-out.md).

    python3 benchmarks/ray_overhead.py --rows 20000 --batch 64 --actors 2 --out benchmarks/results
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

from spinf_jax import api
from spinf_jax.ray import Scores, start_local, template

ARTICLE = "word " * 400  # ~2 KB, about the seed job's articles


def answered(body: dict) -> api.ScoreResponse:
    """The API's response shape for every input, with no model behind it."""
    results = [api.InputResult(input_id=entry["id"], queries=[]) for entry in body["inputs"]]
    details = api.TokenDetails(content_tokens=0, query_tokens=0, floor_tokens=0)
    usage = api.Usage(prompt_tokens=0, prompt_tokens_details=details)
    return api.ScoreResponse(
        id="score-x",
        created=0,
        model="none",
        system_fingerprint="fp_x",
        results=results,
        warnings=[],
        usage=usage,
    )


class Instant(Scores):
    def __init__(self):  # noqa: D107 - no model
        self.backend, self.template = answered, template({"queries": []}, [])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    start_local(args.actors)
    import ray.data  # after start_local, whose setting ray reads when first imported

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    rows = [{"id": str(i), "text": ARTICLE} for i in range(args.rows)]
    dataset = ray.data.from_items(rows).repartition(target_num_rows_per_block=args.batch)
    scored = dataset.map_batches(Instant, batch_size=args.batch, concurrency=args.actors, num_cpus=1)
    start = time.perf_counter()
    n = sum(1 for _ in scored.iter_rows())
    seconds = time.perf_counter() - start
    ray.shutdown()
    batches = -(-args.rows // args.batch)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "ray": ray.__version__, "rows": n, "batch": args.batch, "actors": args.actors,
        "seconds": round(seconds, 2), "rows_per_s": round(n / seconds, 1),
        "ms_per_batch_per_actor": round(seconds / batches * args.actors * 1e3, 2),
    }  # fmt: skip
    Path(args.out, "ray_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
