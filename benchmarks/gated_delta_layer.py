"""One Gated DeltaNet layer's recurrence over the seed job's passes, two versions of `tree_chunked` side by
side: --before FILE (an older pallas_kernels/gated_delta.py) against this checkout's, each at the wave width
this backend uses (or --width), and with --kernel this checkout's with each wave as the Triton wave kernel
(`tree_chunked(kernel=True)`, GPU only: on the CPU it runs only in interpret mode), each with the waves
--groups to a step of the loop. The passes are laid out by
the server's own planner for a Qwen3.5-4B-shaped model; q, k, v, g, beta are made up at the layer's shape (32
value heads of 128, keys of 128: --heads, --dk, --dv), normalised as the layer hands them over. First each
version's outputs against the before's (max |difference|, outputs and exported states, and whether every bit
agrees), then the median seconds of --repeats calls.

    python3 benchmarks/gated_delta_layer.py --tokenizer FOLDER --before OLD_gated_delta.py [--out DIR]
"""

import argparse
import importlib.util
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import qwen3_5_seed_passes, timed

from pallas_kernels import gated_delta


def layer_inputs(rows: int, heads: int, dk: int, dv: int, seed: int = 0):
    """q, k, v, g, beta as Qwen3.5's layer hands them to the recurrence: q and k L2-normalised (q scaled),
    g ≤ 0 (a softplus), β in (0, 1) (a sigmoid)."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k = (jax.random.normal(key, (rows, heads, dk)) for key in keys[:2])
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (rows, heads, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (rows, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (rows, heads)))
    return q, k, v, g, beta


def module_from(path: str):
    spec = importlib.util.spec_from_file_location("gated_delta_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--before", required=True, help="an older pallas_kernels/gated_delta.py")
    parser.add_argument("--buckets", default="4096,16384")
    parser.add_argument("--width", type=int, default=gated_delta.wave_width())
    parser.add_argument("--kernel", action="store_true", help="also the waves as the Triton wave kernel")
    parser.add_argument("--groups", default="1", help="waves a loop step (tree_chunked's group), comma-sep.")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    before = module_from(args.before)
    _, passes = qwen3_5_seed_passes(args.tokenizer, args.buckets)
    firsts = {}
    for p in sorted(passes, key=lambda p: -int((p.chunks[:, 0] < p.size).sum())):  # the most chunks a size
        firsts.setdefault(p.size, p)
    rows = []
    for size, p in sorted(firsts.items()):
        inputs = layer_inputs(size, args.heads, args.dk, args.dv)
        table = (jnp.asarray(p.span_end), jnp.asarray(p.chunks))
        common = {"exports": len(p.export_rows), "width": args.width}
        versions = {"before": partial(before.tree_chunked, *inputs, *table, **common)}
        after = partial(gated_delta.tree_chunked, *inputs, *table, **common)
        for group in (int(g) for g in args.groups.split(",")):
            grouped = f", {group} waves a step" if group > 1 else ""
            versions[f"after{grouped}"] = partial(after, group=group)
            if args.kernel:
                versions[f"after, wave kernel{grouped}"] = partial(after, group=group, kernel=True)
        want_o, want_states = versions["before"]()
        real = int((p.chunks[:, 0] < p.size).sum())
        for name, run in versions.items():
            o, states = run()
            rows.append({
                "rows": size, "chunks": real, "version": name,
                "max_diff_o": float(jnp.max(jnp.abs(o - want_o))),
                "max_diff_states": float(jnp.max(jnp.abs(states - want_states))) if states.size else 0.0,
                "bitwise_equal": bool(np.array_equal(o, want_o) and np.array_equal(states, want_states)),
                "seconds": timed(run, repeats=args.repeats),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        "| pass rows | chunks | version | seconds | max diff o | bit-equal |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['rows']} | {r['chunks']} | {r['version']} | {r['seconds'] * 1e3:.2f} ms "
        f"| {r['max_diff_o']:.2e} | {r['bitwise_equal']} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    device = jax.devices()[0].device_kind
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gated_delta_layer.md").write_text(f"{device}, width {args.width}\n\n{table}\n")
    Path(args.out, "gated_delta_layer.json").write_text(
        json.dumps({"device": device, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
