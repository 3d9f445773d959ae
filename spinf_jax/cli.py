"""`spinf-jax` command line."""

import argparse
import os
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


def _serve(args) -> int:
    import uvicorn

    from spinf_jax.engine import use_compilation_cache
    from spinf_jax.loader import DEFAULT_MODEL
    from spinf_jax.server.app import Settings, create_app

    if args.compile_cache != "none":
        use_compilation_cache(Path(args.compile_cache).expanduser())

    settings = Settings(
        model=args.model or DEFAULT_MODEL,
        precision=args.precision,
        buckets=tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None,
        api_key=args.api_key or os.environ.get("SPINF_API_KEY") or None,
        max_queue=args.max_queue,
        max_delay_ms=args.max_delay_ms,
        served_names=tuple(args.served_model_name),
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0


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

    p = sub.add_parser("serve", help="serve the scoring API (/v1/score, /v1/chat/completions, /v1/models)")
    p.add_argument(
        "model", nargs="?", help="built-in name, folder, .gguf file or Hub id (default: Gemma 3 270M)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp8", "int8"])
    p.add_argument("--api-key", help="require this key (Authorization: Bearer); default: $SPINF_API_KEY")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this get 429")
    p.add_argument("--max-delay-ms", type=float, default=5.0, help="longest wait for company in a pass")
    p.add_argument("--buckets", help="pass sizes in tokens, comma-separated (default by backend)")
    p.add_argument(
        "--served-model-name", action="append", default=[], help="another name the model answers to"
    )
    p.add_argument(
        "--compile-cache",
        default="~/.cache/spinf-jax/xla",
        help="folder for compiled bucket programs, reused across restarts ('none' to disable)",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(run=_serve)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
