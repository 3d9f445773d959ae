"""Tree-attention time of one pass: this tree's kernels (Triton; Mosaic GPU with one or two trunk tiles in
flight) and, given one, an earlier tree's Triton kernel, side by side.

The pass is the seed job's first 16,384-token pass as the engine packs it (Gemma 3 tokenizer) with trees on
64-row block boundaries, which an earlier kernel needs; q, k and v are random at the Gemma 3 12B attention
shape (16 query heads, 8 kv heads, head_dim 256, bf16). A pass of that model runs the kernel 40 times with the
1,024-token window and 8 times without: the per-pass time is that sum. Also reports how far each kernel's
output is from the Triton kernel's (the same attention in another order), and the Triton kernel on the pass
the engine packs now (trees on 16-row boundaries: more trees, so more tokens, in the same 16,384 rows).
Run on the GPU machine from the repo root (--before: an earlier tree's pallas_kernels/tree_attention.py):

    python3 benchmarks/gpu_attention.py --tokenizer gemma3-tokenizer.json [--before OLD.py] --out $OUT
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

from pallas_kernels import tree_attention, tree_attention_mosaic
from spinf_jax.engine import Engine
from spinf_jax.loader import Model
from spinf_jax.models import abstract_decoder
from spinf_jax.packer import Buckets, pack
from spinf_jax.quant import Precision
from spinf_jax.scoring import Scorer
from spinf_jax.tokenizer import Tokenizer

SLIDING_LAYERS, GLOBAL_LAYERS = 40, 8
BLOCK = 64  # the GPUs' attention block (packer.default_block)


def seed_pass(tokenizer: str, align: int):
    """The first pass of the seed job in a 16,384-token bucket, as the engine lays it out with trees on
    `align`-row boundaries."""
    tok = Tokenizer(tokenizers.Tokenizer.from_file(tokenizer), bos_id=2, add_bos=True)
    # The plan needs the tokenizer and the buckets only: the weights stay abstract.
    model = Model("layout-only", abstract_decoder(GEMMA3_12B, Precision.BF16), tok, digest="none")
    engine = Engine(model, Buckets((16384,), block=BLOCK, align=align))
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
    parser.add_argument("--before", help="an earlier pallas_kernels/tree_attention.py")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    p, used = seed_pass(args.tokenizer, align=BLOCK)
    t = p.size
    fields = ("positions", "span_end", "trunk_end", "branch_start", "tree_start")
    arrays = {name: jnp.asarray(getattr(p, name)) for name in fields}
    # What kernels before per-row tree starts took: each block's tree's first block.
    arrays["tree_start_block"] = arrays["tree_start"][::BLOCK] // BLOCK
    packed, packed_used = seed_pass(args.tokenizer, align=Buckets((16384,)).align)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (t, 16, 256), jnp.bfloat16)
    k = jax.random.normal(keys[1], (t, 8, 256), jnp.bfloat16)
    v = jax.random.normal(keys[2], (t, 8, 256), jnp.bfloat16)
    kernels = {"before": load_kernel(args.before)} if args.before else {}
    kernels |= {
        "triton": tree_attention.kernel,
        "mosaic, 2 slots": partial(tree_attention_mosaic.kernel, slots=2),
        "mosaic, 1 slot": partial(tree_attention_mosaic.kernel, slots=1),
    }
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "pass": {"tokens": t, "tree_tokens": used, "trees": len(p.tree_ids)},
        "pass_packed_now": {"tree_tokens": packed_used, "trees": len(packed.tree_ids)},
        "shape": "16 q heads, 8 kv heads, head_dim 256, bf16, random values",
    }
    outputs = {}
    for name, fn in kernels.items():
        # Each kernel takes the pass arrays it knows (the earlier one has no trunk_end / branch_start).
        wanted = [a for a in inspect.signature(getattr(fn, "func", fn)).parameters if a in arrays]
        pass_args = [arrays[a] for a in wanted]
        row = {}
        for label, window in (("sliding_ms", 1024), ("global_ms", None)):
            call = partial(fn, scale=256**-0.5, window=window, block=BLOCK)
            row[label] = timed(call, q, k, v, *pass_args) * 1e3
            outputs[name, window] = np.asarray(call(q, k, v, *pass_args), np.float32)
        row["per_pass_ms"] = SLIDING_LAYERS * row["sliding_ms"] + GLOBAL_LAYERS * row["global_ms"]
        results[name] = row
        print(name, row, flush=True)
    now = [jnp.asarray(getattr(packed, name)) for name in fields]
    row = {}
    for label, window in (("sliding_ms", 1024), ("global_ms", None)):
        call = partial(tree_attention.kernel, scale=256**-0.5, window=window, block=BLOCK)
        row[label] = timed(call, q, k, v, *now) * 1e3
    row["per_pass_ms"] = SLIDING_LAYERS * row["sliding_ms"] + GLOBAL_LAYERS * row["global_ms"]
    row["per_tree_token_over_triton"] = (row["per_pass_ms"] / packed_used) / (
        results["triton"]["per_pass_ms"] / used
    )
    results["triton, 16-row trees"] = row
    print("triton, 16-row trees", row, flush=True)
    for name in kernels:
        results[name]["max_abs_vs_triton"] = {
            str(window): float(np.abs(outputs[name, window] - outputs["triton", window]).max())
            for window in (1024, None)
        }
        results[name]["over_triton"] = results[name]["per_pass_ms"] / results["triton"]["per_pass_ms"]
    Path(args.out, "gpu_attention.json").write_text(json.dumps(results, indent=1) + "\n")
    header = f"{'kernel':<18} {'sliding ms':>11} {'global ms':>10} {'per pass ms':>12} {'× triton':>9}"
    print(f"{header} {'max |Δ|':>8}")
    for name in kernels:
        r = results[name]
        delta = max(r["max_abs_vs_triton"].values())
        print(
            f"{name:<18} {r['sliding_ms']:>11.3f} {r['global_ms']:>10.3f} {r['per_pass_ms']:>12.1f}"
            f" {r['over_triton']:>9.3f} {delta:>8.4f}"
        )
    r = results["triton, 16-row trees"]
    print(f"triton, 16-row trees: {r['per_pass_ms']:.1f} ms a pass of {packed_used:,} tree tokens against")
    print(f"  {used:,} on 64-row blocks; time per tree token {r['per_tree_token_over_triton']:.3f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
