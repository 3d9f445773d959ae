"""How many steps one Gated DeltaNet layer's recurrence runs one after another for the seed job's passes:
the loop over the chunk table that ran until fce9901 (`Buckets.max_chunks` steps a pass, padding included)
against the waves of `gated_delta.tree_chunked` (`_waves`) at several widths. Counts, not timings: the passes
are laid out by the server's own planner for a Qwen3.5-4B-shaped model (its recurrent chunk layout; the
layers' widths do not change the layout), on any machine.

    python3 benchmarks/recurrent_waves.py --tokenizer FOLDER_WITH_GEMMA3_TOKENIZER_JSON [--out DIR]
"""

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
from common import qwen3_5_seed_passes

from pallas_kernels.gated_delta import _sources, _waves

WIDTHS = (1, 4, 32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--buckets", default="4096,16384")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    plan, passes = qwen3_5_seed_passes(args.tokenizer, args.buckets)
    rows = []
    for p in passes:
        chunks = jnp.asarray(p.chunks)
        source = _sources(chunks)
        waves = {w: int(_waves(chunks, source, p.size, w)[1]) for w in WIDTHS}
        real = int((p.chunks[:, 0] < p.size).sum())
        rows.append({"rows": p.size, "loop_steps": len(p.chunks), "chunks": real, "waves": waves})
    widths = " | ".join(f"waves, width {w}" for w in WIDTHS)
    lines = [
        f"| pass rows | loop steps (before) | chunks | {widths} |",
        "|---" * (3 + len(WIDTHS)) + "|",
    ]
    for r in rows:
        waves = " | ".join(str(r["waves"][w]) for w in WIDTHS)
        lines.append(f"| {r['rows']} | {r['loop_steps']} | {r['chunks']} | {waves} |")
    table = "\n".join(lines)
    print(table)
    Path(args.out, "recurrent_waves.md").write_text(table + "\n")
    print(json.dumps({"passes": rows, "questions": plan.questions, "trees": len(plan.trees)}))


if __name__ == "__main__":
    main()
