"""Plant a known bug, run the tests that should catch it, put the code back: does the suite still fail?

Each plant replaces one exact piece of source (a plant that does not match exactly once is refused, so a
plant can never silently not apply), runs its test file in the fast tier's selection with `-x`, and restores
the file whatever happens. Prints a markdown table: area, plant, tests, result, first failure, seconds.

    python benchmarks/planted_bugs.py            # all plants
    python benchmarks/planted_bugs.py auth       # the plants whose area starts with "auth"
"""

import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (area, file, exact source, planted source, what it breaks, test file)
PLANTS = [
    ("server auth", "spinf_jax/server/auth.py", "return any(matches)", "return True",
     "any key accepted", "tests/test_auth.py"),
    ("compiler", "spinf_jax/compiler.py", "if option.lower() in seen:", "if option in seen:",
     "duplicate options compared with case", "tests/test_compiler.py"),
    ("tree layout", "spinf_jax/layout.py", "tree.trunk_tokens = len(tree.tokens)",
     "tree.trunk_tokens = len(tree.tokens) - 1", "a trunk-only tree's trunk one token short",
     "tests/test_layout.py"),
    ("kernel twin", "pallas_kernels/tree_attention.py",
     "ok = (k_idx[None, :] <= q_idx[:, None]) & (q_idx[:, None] < span_end[k_idx][None, :]) & own",
     "ok = (k_idx[None, :] < q_idx[:, None]) & (q_idx[:, None] < span_end[k_idx][None, :]) & own",
     "the blockwise twin: a row no longer sees its own key", "tests/test_tree_attention.py"),
]  # fmt: skip


def plant(path: Path, source: str, planted: str) -> str:
    """Write the plant; returns the original text."""
    text = path.read_text()
    if text.count(source) != 1:
        raise SystemExit(f"{path}: the plant's source occurs {text.count(source)} times, not once")
    path.write_text(text.replace(source, planted))
    return text


def run(tests: str) -> tuple[str, str, float]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", tests, "-x", "-q", "-n", "0", "-m", "not slow",
         "--hypothesis-profile", "dev"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    failed = re.search(r"^FAILED (.+?)(?: - .*)?$", out.stdout, re.MULTILINE)
    result = "fails" if out.returncode == 1 and failed else f"PASSES (exit {out.returncode})"
    return result, failed.group(1).split("::", 1)[1] if failed else "", seconds


def main(only: str = "") -> None:
    print("| area | file | planted | tests | result | first failure | seconds |")
    print("|---|---|---|---|---|---|---|")
    for area, file, source, planted, what, tests in PLANTS:
        if not area.startswith(only):
            continue
        path = REPO / file
        original = plant(path, source, planted)
        try:
            result, first, seconds = run(tests)
        finally:
            path.write_text(original)
        print(f"| {area} | `{file}` | {what} | {tests} | {result} | `{first}` | {seconds:.0f} |", flush=True)
    clean = subprocess.run(["git", "status", "--porcelain", "--", *{p[1] for p in PLANTS}], cwd=REPO,
                           capture_output=True, text=True).stdout  # fmt: skip
    print(f"\nsource files restored: {'yes' if not clean else 'NO: ' + clean}")


if __name__ == "__main__":
    main(*sys.argv[1:])
