"""Seconds per pass of each bucket when its reads are few and when they fill the read capacity.

    python benchmarks/sparse_reads.py [--models spinf/gemma-3-270m ...] [--out FILE]

A pass holds a fixed number of read rows (Buckets.max_reads), and each read is a full-vocabulary
log-softmax. "few": one content of half the bucket's tokens with four two-option questions (4 reads, the
shape of classification traffic); "full": a sequence read at every row up to the capacity. Run it on two
checkouts (PYTHONPATH=<checkout>) to compare them: it uses only the packer and Engine._run_pass. The median
of `--repeats` runs after one untimed run (which also compiles)."""

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from spinf_jax.engine import Engine
from spinf_jax.layout import QuestionKey, build_tree, read_tree
from spinf_jax.loader import load_model
from spinf_jax.packer import Buckets, pack

RNG = np.random.default_rng(25)


def trees(kind: str, size: int, buckets: Buckets) -> list:
    if kind == "few":
        content = RNG.integers(1000, 20000, size // 2).tolist()
        questions = [
            QuestionKey(tuple(RNG.integers(1000, 20000, 8).tolist()), ((300,), (400,))) for _ in "abcd"
        ]
        return [build_tree([2], content, questions)]
    reads = min(buckets.max_reads(size), size - buckets.block)
    ids = RNG.integers(1000, 20000, reads + 1).tolist()
    return [read_tree(ids, {row: [ids[row + 1]] for row in range(reads)})]


def seconds(engine: Engine, p, repeats: int) -> float:
    engine._run_pass(p)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine._run_pass(p)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["spinf/gemma-3-270m", "spinf/smollm2-135m-instruct"])
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--sizes", default="256,512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    buckets = Buckets(tuple(int(s) for s in args.sizes.split(",")), 64)
    rows = []
    for spec in args.models:
        engine = Engine(load_model(spec, args.precision), buckets)
        for size in buckets.sizes:
            for kind in ("few", "full"):
                laid = trees(kind, size, buckets)
                [p] = pack(laid, Buckets((size,), buckets.block))
                reads = sum(len(t.read_rows) for t in laid)
                row = {"model": spec, "bucket": size, "reads": kind, "read_rows": reads,
                       "seconds": round(seconds(engine, p, args.repeats), 4)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {jax.default_backend()}",
        "jax": jax.__version__,
        "precision": args.precision,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
