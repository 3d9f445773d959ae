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
    from spinf_jax.server.settings import SettingsError, read_flags

    try:
        launch = read_flags(args, os.environ)
    except SettingsError as exc:
        print("\n".join(f"spinf-jax serve: {problem}" for problem in exc.problems), file=sys.stderr)
        return 2
    if args.check:
        print(f"spinf-jax serve: the settings are valid: {launch.summary()}")
        return 0

    from spinf_jax.server.memory import cap_device_memory

    if launch.settings.device_memory_cap_gib is not None:
        cap_device_memory(launch.settings.device_memory_cap_gib)  # before JAX starts its backend

    import uvicorn

    from spinf_jax.engine import use_compilation_cache
    from spinf_jax.server.app import create_app
    from spinf_jax.server.protocol import uvicorn_config

    if launch.compile_cache is not None:
        use_compilation_cache(launch.compile_cache)
    app = create_app(launch.settings)
    uvicorn.Server(uvicorn_config(app, launch.host, launch.port, launch.log_level)).run()
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

    p = sub.add_parser(
        "serve",
        help="serve the scoring API (/v1/score, /v1/chat/completions, /v1/models)",
        description="Every flag is checked before the model loads; any problem stops the start, with exit "
        "status 2 (docs/configuration.md).",
    )
    # Numbers and choices are read as text and checked by server.settings: it reports every problem at once.
    p.add_argument(
        "model", nargs="?", help="built-in name, folder, .gguf file or Hub id (default: Gemma 3 270M)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8000")
    p.add_argument("--precision", default="bf16", metavar="{bf16,fp8,int8,fp32}")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this key (Authorization: Bearer, or x-api-key); repeat for several; "
        "default: $SPINF_API_KEY",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="require one of the keys in this file: one a line, blank lines and # comments skipped",
    )
    p.add_argument("--metrics-auth", action="store_true", help="/metrics asks for a key too")
    p.add_argument("--max-queue", default="64", help="requests waiting beyond this get 429")
    p.add_argument("--max-delay-ms", default="5", help="longest wait for company in a pass")
    p.add_argument("--buckets", help="pass sizes in tokens, comma-separated (default by backend)")
    p.add_argument(
        "--device-memory-cap", metavar="GIB", help="the most device memory to use (docs/configuration.md)"
    )
    p.add_argument(
        "--served-model-name", action="append", default=[], help="another name the model answers to"
    )
    p.add_argument(
        "--compile-cache",
        default="~/.cache/spinf-jax/xla",
        help="folder for compiled bucket programs, reused across restarts ('none' to disable)",
    )
    p.add_argument(
        "--packs",
        action="append",
        default=[],
        metavar="SOURCE",
        help="also load the prompt packs of this folder or git repository (URL[@ref]); repeatable",
    )
    p.add_argument("--no-official-packs", action="store_true", help="do not load the project's own packs")
    p.add_argument("--log-level", default="info", metavar="{critical,error,warning,info,debug,trace}")
    p.add_argument("--check", action="store_true", help="check the settings, then exit: 0 if valid, else 2")
    p.set_defaults(run=_serve)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
