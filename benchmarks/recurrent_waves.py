"""How many steps one Gated DeltaNet layer's recurrence runs one after another for the seed job's passes:
the loop over the chunk table that ran until fce9901 (`Buckets.max_chunks` steps a pass, padding included)
against the waves of `gated_delta.tree_chunked` (`_waves`) at several widths. Counts, not timings: the passes
are laid out by the server's own planner for a Qwen3.5-4B-shaped model (its recurrent chunk layout; the
layers' widths do not change the layout), on any machine.

    python3 benchmarks/recurrent_waves.py --tokenizer FOLDER_WITH_GEMMA3_TOKENIZER_JSON [--out DIR]
"""

import argparse
import json
import tempfile
from pathlib import Path

import jax.numpy as jnp
from common import QWEN3_5_4B, seed_job, seed_request

from pallas_kernels.gated_delta import _sources, _waves
from spinf_jax.engine import Engine
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets, pack
from spinf_jax.scoring import Scorer

WIDTHS = (1, 4, 32)
# Qwen3.5-4B's layer pattern and chunk layout at narrow widths, Gemma 3's vocabulary (the tokenizer's).
SMALL = QWEN3_5_4B | {
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 262144,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--buckets", default="4096,16384")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder, "config.json")
        config.write_text(json.dumps(SMALL))
        model = random_model(config, args.tokenizer, "fp32")
    buckets = Buckets(tuple(int(b) for b in args.buckets.split(",")), block=64, recurrent=True)
    plan = Scorer(Engine(model, buckets)).plan(seed_request(seed_job()))
    rows = []
    for p in pack(plan.trees, buckets):
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
