"""Device memory a bucket program needs beyond its weights (XLA's buffer assignment), without any weights:
the program is compiled against abstract parameters. Compares row tiles side by side, for a few depths, so
that memory growing with the layer count (buffers of every layer alive at once) shows as a slope.

    python3 benchmarks/program_memory.py --layers 2,4,8 --bucket 4096 --out benchmarks/results/...json
"""

import argparse
import json
import time
from pathlib import Path

import jax
from common import GEMMA3_12B

from spinf_jax.engine import Engine
from spinf_jax.loader import Model
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision


def temp_gib(layers: int, bucket: int, precision: Precision, tile: int | None) -> tuple[float, float]:
    decoder = abstract_decoder({**GEMMA3_12B, "num_hidden_layers": layers}, precision)
    model = Model("abstract", decoder, None, digest="abstract", row_tile=tile)
    start = time.perf_counter()
    memory = Engine(model, Buckets((bucket,))).lowered(bucket).compile().memory_analysis()
    return memory.temp_size_in_bytes / 2**30, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="2,4,8")
    parser.add_argument("--bucket", type=int, default=4096)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--tiles", default="none,1024")
    parser.add_argument("--out", default="program_memory.json")
    args = parser.parse_args()
    precision = Precision(args.precision)
    tiles = [None if t == "none" else int(t) for t in args.tiles.split(",")]
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        for tile in tiles:
            gib, seconds = temp_gib(layers, args.bucket, precision, tile)
            rows.append({"layers": layers, "row_tile": tile, "temp_gib": gib, "compile_seconds": seconds})
            print(f"layers {layers:>3}  row tile {tile!s:>5}  temporaries {gib:6.2f} GiB", flush=True)
    results = {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "config": "gemma-3-12b text widths, first N layers",
        "bucket": args.bucket,
        "precision": precision.value,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
