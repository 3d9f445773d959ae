"""`spinf-jax` command line."""

import argparse
import sys
from pathlib import Path


def _parity(args) -> int:
    from spinf_jax import parity

    if args.all:
        results = []
        for result in parity.run_all(passes=args.passes, only=args.only):
            print(result.line(), flush=True)
            results.append(result)
        failed = [r.name for r in results if not r.ok]
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed or not results else 0
    if not (args.fixture and args.reference):
        print("parity: give --fixture and --reference, or --all", file=sys.stderr)
        return 2
    result = parity.run(
        args.fixture,
        Path(args.reference),
        precision=args.precision,
        tolerance=args.tolerance,
        mean_tolerance=args.mean_tolerance,
        min_top1=args.min_top1,
        passes=args.passes,
    )
    print(result.line())
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spinf-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("parity", help="compare our log-probabilities with recorded transformers references")
    p.add_argument("--fixture", help="model: a built-in name, a checkpoint folder, a .gguf file or a Hub id")
    p.add_argument("--reference", help="reference .json.gz recorded by fixtures/record_references.py")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp8", "int8"])
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |Δ log-prob|")
    p.add_argument("--mean-tolerance", type=float, default=None, help="largest allowed mean |Δ log-prob|")
    p.add_argument("--min-top1", type=float, default=None, help="smallest allowed top-1 agreement")
    p.add_argument("--passes", type=int, default=1, help="score N times and require bit-identical results")
    p.add_argument("--all", action="store_true", help="every fixture in fixtures/manifest.json")
    p.add_argument("--only", help="with --all: only manifest entries whose name contains this")
    p.set_defaults(run=_parity)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
