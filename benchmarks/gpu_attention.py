"""Tree-attention time of one pass: the kernel of this tree and the kernel of an earlier one, side by side.

The pass is the seed job's first 16,384-token pass as the engine packs it (Gemma 3 tokenizer); q, k and v are
random at the Gemma 3 12B attention shape (16 query heads, 8 kv heads, head_dim 256, bf16). A pass of that
model runs the kernel 40 times with the 1,024-token window and 8 times without: the per-pass time is that sum.
Also reports how far the two kernels' outputs are apart (they compute the same attention in another order).
Run on the GPU machine from the repo root, with the earlier tree's pallas_kernels/tree_attention.py:

    python3 benchmarks/gpu_attention.py --tokenizer gemma3-tokenizer.json --before OLD.py --out $OUT
"""

import argparse
import importlib.util
import inspect
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from common import GEMMA3_12B, seed_job, seed_request, timed

from pallas_kernels import tree_attention
from spinf_jax.engine import Engine
from spinf_jax.loader import Model
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets, pack
from spinf_jax.quant import Precision
from spinf_jax.scoring import Scorer
from spinf_jax.tokenizer import Tokenizer

SLIDING_LAYERS, GLOBAL_LAYERS = 40, 8


def seed_pass(tokenizer: str):
    """The first pass of the seed job in a 16,384-token bucket, as the engine lays it out."""
    tok = Tokenizer(tokenizers.Tokenizer.from_file(tokenizer), bos_id=2, add_bos=True)
    # The plan needs the tokenizer and the buckets only: the weights stay abstract.
    model = Model("layout-only", abstract_decoder(GEMMA3_12B, Precision.BF16), tok, digest="none")
    engine = Engine(model, Buckets((16384,)))
    plan = Scorer(engine).plan(seed_request(seed_job(), empty_floor=False))
    first = pack(plan.trees, engine.buckets)[0]
    return first, sum(len(plan.trees[i]) for i in first.tree_ids)


def load_kernel(path: str):
    spec = importlib.util.spec_from_file_location("tree_attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--before", required=True, help="an earlier pallas_kernels/tree_attention.py")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    p, used = seed_pass(args.tokenizer)
    t = p.size
    arrays = {
        name: jnp.asarray(getattr(p, name))
        for name in ("positions", "span_end", "trunk_end", "branch_start", "tree_start_block")
    }
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (t, 16, 256), jnp.bfloat16)
    k = jax.random.normal(keys[1], (t, 8, 256), jnp.bfloat16)
    v = jax.random.normal(keys[2], (t, 8, 256), jnp.bfloat16)
    kernels = {"before": load_kernel(args.before), "after": tree_attention.kernel}
    # The branch part's key-block size, tried at other values (the engine uses BRANCH_BLOCK).
    kernels |= {
        f"after, branch_block={n}": partial(tree_attention.kernel, branch_block=n)
        for n in (16, 32, 64)
        if n != tree_attention.BRANCH_BLOCK
    }
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "pass": {"tokens": t, "tree_tokens": used, "trees": len(p.tree_ids)},
        "shape": "16 q heads, 8 kv heads, head_dim 256, bf16, random values",
    }
    outputs = {}
    for name, fn in kernels.items():
        # Each kernel takes the pass arrays it knows (the earlier one has no trunk_end / branch_start).
        wanted = [a for a in inspect.signature(getattr(fn, "func", fn)).parameters if a in arrays]
        pass_args = [arrays[a] for a in wanted]
        row = {}
        for label, window in (("sliding_ms", 1024), ("global_ms", None)):
            call = partial(fn, scale=256**-0.5, window=window, block=128)
            row[label] = timed(call, q, k, v, *pass_args) * 1e3
            outputs[name, window] = np.asarray(call(q, k, v, *pass_args), np.float32)
        row["per_pass_ms"] = SLIDING_LAYERS * row["sliding_ms"] + GLOBAL_LAYERS * row["global_ms"]
        results[name] = row
        print(name, row, flush=True)
    results["max_abs_before_vs_after"] = {
        str(window): float(np.abs(outputs["before", window] - outputs["after", window]).max())
        for window in (1024, None)
    }
    results["after_over_before"] = results["after"]["per_pass_ms"] / results["before"]["per_pass_ms"]
    Path(args.out, "gpu_attention.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'kernel':<26} {'sliding ms':>11} {'global ms':>10} {'per pass ms':>12}")
    for name in kernels:
        r = results[name]
        print(f"{name:<26} {r['sliding_ms']:>11.3f} {r['global_ms']:>10.3f} {r['per_pass_ms']:>12.1f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
