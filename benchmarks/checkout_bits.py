"""Do two checkouts give the same bits? Scores, top tokens and decoded answers of the tiny fixtures, for a
change that should not move the engine's arithmetic (or to measure that it does: then ENGINE_VERSION moves).

    python benchmarks/checkout_bits.py --old DIR [--new DIR] [--out FILE]

Each checkout runs in its own process (PYTHONPATH=<checkout>): per tiny family (random weights) and precision,
one engine per bucket size, a dense read_tree (every row read, 3 targets each) and a tree of four option
questions and two extraction slots (a beam search and a greedy one). It writes the raw bytes' digests
side by side and the entries that differ."""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = ("gemma3", "qwen3", "gemma4-e2b")
PRECISIONS = ("fp32", "bf16", "fp8")


def digests(sizes: list[int]) -> dict[str, str]:
    """In the checkout on sys.path: every entry's sha256 over its log-prob bytes, top tokens and answers."""
    import numpy as np

    from spinf_jax.engine import Engine
    from spinf_jax.layout import Extract, QuestionKey, build_tree, read_tree
    from spinf_jax.loader import load_model
    from spinf_jax.packer import Buckets

    rng = np.random.default_rng(26)
    ids = rng.integers(3, 500, 1001).tolist()
    content = rng.integers(3, 500, 300).tolist()
    questions = [QuestionKey(tuple(rng.integers(3, 500, 6).tolist()), ((5,), (6, 7))) for _ in range(4)]
    questions += [
        QuestionKey(tuple(rng.integers(3, 500, 5).tolist()), extract=Extract(max_answers=6, max_tokens=5)),
        QuestionKey(tuple(rng.integers(3, 500, 3).tolist()), extract=Extract(max_tokens=6, generate=True)),
    ]
    trees = {
        "dense": read_tree(ids, {r: [ids[r + 1], 7, 9] for r in range(1000)}),
        "questions": build_tree([2], content, questions),
    }
    root = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
    out = {}
    for family in FAMILIES:
        for precision in PRECISIONS:
            model = load_model(str(root / family), precision)
            for size in sizes:
                engine = Engine(model, Buckets((size,), block=64))
                for name, tree in trees.items():
                    [scored] = engine.score_trees([tree])
                    h = hashlib.sha256(np.asarray(scored.logprobs).tobytes())
                    h.update(np.asarray(scored.top_tokens).tobytes())
                    for answers in scored.answers:
                        for a in answers:
                            h.update(np.asarray(a.tokens, np.int32).tobytes())
                            h.update(np.float64(a.logprob).tobytes())
                    out[f"{family} {precision} {size} {name}"] = h.hexdigest()
    return out


def run(checkout: Path, sizes: str) -> dict[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = {**os.environ, "PYTHONPATH": f"{checkout}:{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, __file__, "--emit", f.name, "--sizes", sizes]
        subprocess.run(cmd, env=env, check=True, cwd=checkout)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--sizes", default="4096,8192")
    parser.add_argument("--out")
    parser.add_argument("--emit", help=argparse.SUPPRESS)  # the child process: write this checkout's digests
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.emit:
        Path(args.emit).write_text(json.dumps(digests(sizes)))
        return
    old, new = run(Path(args.old), args.sizes), run(Path(args.new), args.sizes)
    differ = [key for key in new if old.get(key) != new[key]]
    lines = [f"{key}: {'same' if key not in differ else 'DIFFERS'}" for key in new]
    lines.append(f"{len(new)} entries compared; {len(differ)} differ: {differ}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
