"""`spinf-jax` command line."""

import argparse
import os
import sys
from contextlib import nullcontext
from importlib.metadata import version
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

    from spinf_jax.server.protocol import port_problem

    if problem := port_problem(launch.host, launch.port):
        print(f"spinf-jax serve: {problem}", file=sys.stderr)
        return 2
    if launch.devices is not None:
        return _serve_replicas(args, launch)

    from spinf_jax.replicas import outlive_no_front, pin_this_process
    from spinf_jax.server.memory import cap_device_memory

    if launch.settings.device_memory_cap_gib is not None:
        cap_device_memory(launch.settings.device_memory_cap_gib)  # before JAX starts its backend
    pin_this_process(os.environ)
    outlive_no_front(os.environ)

    from spinf_jax.engine import use_compilation_cache
    from spinf_jax.server.app import create_app
    from spinf_jax.server.protocol import Server, uvicorn_config

    if launch.compile_cache is not None:
        use_compilation_cache(launch.compile_cache)
    app = create_app(launch.settings, url=launch.url)
    Server(uvicorn_config(app, launch.host, launch.port, launch.log_level)).run()
    engine = app.state.server.engine
    if engine is not None and engine.compiling:
        # A bucket still compiling on its thread (the start's background half): Python's exit would tear the
        # interpreter down under XLA's compiler, which crashes the process (SIGSEGV) after a clean shutdown.
        # The server has answered everything and closed; nothing is left to keep.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _devices(asked: str, command: str):
    """(the devices there are, how many of them `--devices` asks for), or None once the problem is said."""
    from spinf_jax import replicas

    try:
        devices = replicas.probe(os.environ)
        return devices, replicas.how_many(asked, devices)
    except (RuntimeError, ValueError) as e:
        print(f"spinf-jax {command}: {e}", file=sys.stderr)
        return None


def _serve_replicas(args, launch) -> int:
    """`serve --devices`: a replica process per device behind the front (spinf_jax.server.front)."""
    from spinf_jax import replicas
    from spinf_jax.server.front import create_front
    from spinf_jax.server.protocol import Server, uvicorn_config

    if (found := _devices(launch.devices, "serve")) is None:
        return 2
    devices, count = found
    keys = launch.settings.api_keys
    pool = replicas.Replicas.spawn(
        replicas.serve_args(args.argv[1:]),
        devices,
        count,
        os.environ,
        headers={"authorization": f"Bearer {keys[0]}"} if keys else None,
        stagger=launch.compile_cache is not None,
    )
    app = create_front(launch.settings, pool, devices.platform)
    Server(uvicorn_config(app, launch.host, launch.port, launch.log_level)).run()
    return 0


def _packs(args) -> int:
    """`spinf-jax packs list | show ID | validate PATH... | schema | calibrate ID --traffic F`."""
    import msgspec

    from spinf_jax.packs.format import SUFFIXES, PackError, read_pack
    from spinf_jax.packs.loader import describe, load_packs, pack_files

    if args.action == "schema":
        print(msgspec.json.format(msgspec.json.encode(pack_schema()), indent=2).decode())
        return 0
    try:
        if args.action == "validate":
            # A folder is its pack files, as --packs reads it.
            asked, args.paths = args.paths, []
            for path in map(Path, asked):
                files = pack_files(path) if path.is_dir() else [path]
                if not files:
                    raise PackError(path, "", f"no pack files ({', '.join(SUFFIXES)}) in it")
                args.paths += files
            packs = [read_pack(path) for path in args.paths]
            if not args.no_model:
                from spinf_jax.loader import load_model
                from spinf_jax.packs.compiled import compile_pack
                from spinf_jax.packs.loader import LoadedPack

                tokenizer = load_model(args.model, "fp32").tokenizer
                for path, pack in zip(args.paths, packs, strict=True):
                    compile_pack(LoadedPack(pack, Path(path), "file"), tokenizer)
            for path, pack in zip(args.paths, packs, strict=True):
                print(f"{path}: {pack.id} {pack.version}: valid ({len(pack.questions)} questions)")
            return 0
        loaded = load_packs(args.packs, official=not args.no_official_packs)
    except PackError as e:
        print(f"spinf-jax packs: {e}", file=sys.stderr)
        return 2
    if args.action == "list":
        for item in loaded.values():
            info = describe(item)
            where = info.source + (f"@{info.commit[:12]}" if info.commit else "")
            print(f"{info.id:<28}{info.version:<10}{info.questions:>4} questions {len(info.categories):>3} "
                  f"categories  {where}")  # fmt: skip
        return 0
    if args.id not in loaded:
        print(
            f"spinf-jax packs: no pack {args.id!r} (loaded: {', '.join(loaded) or 'none'})", file=sys.stderr
        )
        return 2
    item = loaded[args.id]
    if args.action == "show":
        print(f"# {item.path}")
        print(msgspec.yaml.encode(msgspec.to_builtins(item.pack)).decode())
        return 0
    return _calibrate(args, item)


def pack_schema() -> dict:
    """packs/schema.json: the pack file's JSON Schema."""
    import msgspec

    from spinf_jax.packs.format import Pack

    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **msgspec.json.schema(Pack)}


def _calibrate(args, item) -> int:
    import json

    from tqdm import tqdm

    from spinf_jax.packs import calibrate
    from spinf_jax.service import Service

    normal = calibrate.read_rows(args.traffic)
    labelled = calibrate.read_rows(args.labelled, labelled=True) if args.labelled else []
    targets = calibrate.default_targets(item.pack)
    for target in args.target:
        label, _, value = target.partition("=")
        if label not in targets:
            print(f"spinf-jax packs: --target: {label!r} is not a label of {item.pack.id}", file=sys.stderr)
            return 2
        targets[label] = float(value)
    scorer = Service.load(args.model, args.precision, packs={item.pack.id: item}).scorer
    with tqdm(total=len(normal) + len(labelled), desc=f"scoring {item.pack.id}", unit="row") as bar:
        pack, report = calibrate.calibrate_pack(scorer, item.pack, normal, labelled, targets, bar)
    out = Path(args.out) if args.out else item.path
    calibrate.write_pack(pack, out)
    print(calibrate.report_table(report))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _calibration(args) -> int:
    """`spinf-jax calibrate ROWS --out FILE`: one temperature per workload (and, from typed rows, per question
    type or by option count), with its report and plots."""
    import datetime
    import json

    from tqdm import tqdm

    from spinf_jax import calibration
    from spinf_jax.labelled import RowError, fit_by_options, fit_workload, read_rows, score_rows
    from spinf_jax.service import Service

    try:
        rows = read_rows(args.rows, args.workload, args.orderings)
    except (OSError, RowError) as e:
        print(f"spinf-jax calibrate: {e}", file=sys.stderr)
        return 2
    service = Service.load(args.model, args.precision)
    engine = service.engine
    try:
        with tqdm(total=len(rows), desc="scoring", unit="row") as bar:
            scored = list(score_rows(service.decider, service.scorer, rows, bar, service.apis))
    except RowError as e:
        print(f"spinf-jax calibrate: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "version": 1,
        "model": engine.model.name,
        "precision": engine.model.precision.value,
        "system_fingerprint": engine.fingerprint,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rows": str(args.rows),
    }
    fits = {"workloads": {}, "typed": {}}
    for (name, typed), mine in _by_workload(rows, scored).items():
        try:
            summary, raw, fitted = fit_workload(mine, args.orderings, args.target_precision, args.bootstrap)
        except calibration.CalibrationError as e:
            print(f"spinf-jax calibrate: {'type' if typed else 'workload'} {name!r}: {e}", file=sys.stderr)
            return 2
        plot = out.with_name(f"{out.stem}.{'type-' if typed else ''}{name}.png")
        labels = [row.label for *_, row in mine]
        calibration.reliability_plot(
            {"raw": (raw, labels), f"T = {summary['temperature']:.3g}, out of fold": (fitted, labels)},
            plot,
            f"{name}: {len(labels)} rows, {engine.model.name}",
        )
        summary["plot"] = plot.name
        fits["typed" if typed else "workloads"][name] = summary
        print(calibration.table(f"{'type' if typed else 'workload'} {name}", summary))
    if fits["workloads"]:
        document["workloads"] = fits["workloads"]
    if fits["typed"]:
        document["prompt_version"] = service.apis.reader.version
        document["temperature_by_type"] = {k: v["temperature"] for k, v in fits["typed"].items()}
        document["typed"] = fits["typed"]
        if args.by_options:
            typed_rows = [entry for entry in _scored_rows(rows, scored) if entry[2].kind == "typed"]
            try:
                entry, per_count = fit_by_options(typed_rows)
            except calibration.CalibrationError as e:
                print(f"spinf-jax calibrate: --by-options: {e}", file=sys.stderr)
                return 2
            document["temperature_by_options"] = entry
            document["typed_by_options"] = per_count
            a, b, least = entry["a"], entry["b"], entry["min"]
            print(f"temperature by option count: T(n) = max({least}, {a:.3f} + {b:.3f}·ln n)")
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _scored_rows(rows, scored) -> list[tuple]:
    """(log-probabilities, floor, row) per row."""
    return [(lp, floor, row) for (lp, floor), row in zip(scored, rows, strict=True)]


def _by_workload(rows, scored) -> dict[tuple[str, bool], list[tuple]]:
    """The rows of each workload, and of each question type (typed rows), in first-seen order."""
    out: dict[tuple[str, bool], list[tuple]] = {}
    for entry in _scored_rows(rows, scored):
        row = entry[2]
        out.setdefault((row.workload, row.kind == "typed"), []).append(entry)
    return out


def _score(args) -> int:
    """`spinf-jax score INPUT --out OUT (--queries FILE | --pack ID | --systemone FILE)`: a JSON Lines (or
    CSV) file through the engine or a server (spinf_jax.bulk)."""
    import json

    from tqdm import tqdm

    from spinf_jax import bulk

    if args.systemone and (args.queries or args.pack):
        print(
            "spinf-jax score: --systemone asks its own questions: not with --queries or --pack",
            file=sys.stderr,
        )
        return 2
    if not args.queries and not args.pack and not args.systemone:
        print("spinf-jax score: give --queries FILE, --pack ID or --systemone FILE", file=sys.stderr)
        return 2
    template, kind = {}, bulk.SCORING
    for flag, path in (("--queries", args.queries), ("--systemone", args.systemone)):
        if path:
            try:
                asked = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError) as e:
                print(f"spinf-jax score: {flag}: {e}", file=sys.stderr)
                return 2
    if args.queries:
        template["scoring"] = {"queries": asked} if isinstance(asked, list) else asked
    if args.systemone:
        if not isinstance(asked, dict):
            print("spinf-jax score: --systemone: expected a JSON object of questions", file=sys.stderr)
            return 2
        template, kind = (asked if "questions" in asked else {"questions": asked}), bulk.SYSTEMONE
    if args.pack:
        template["packs"] = [{"id": pack} for pack in args.pack]
    source, out = Path(args.input), Path(args.out)
    if not source.is_file():
        print(f"spinf-jax score: {source}: no such file", file=sys.stderr)
        return 2
    if problem := _asked_problem(template, kind):  # before a model loads or a server is asked
        flag = "--systemone" if kind is bulk.SYSTEMONE else "--queries" if args.queries else "--pack"
        print(f"spinf-jax score: {flag}: {problem}", file=sys.stderr)
        return 2
    if args.buckets is not None:
        from spinf_jax.server.settings import SettingsError, read_buckets

        try:
            args.buckets = read_buckets(args.buckets)
        except SettingsError as e:
            print(f"spinf-jax score: {e}", file=sys.stderr)
            return 2
    if sum(map(bool, (args.url, args.devices and not args.ray, args.ray))) > 1:
        print("spinf-jax score: one of --url, --devices and --ray (--devices N with --ray: N actors)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.ray:
        return _score_on_ray(args, source, out, template, kind)
    if args.devices:
        return _score_on_replicas(args, source, out, template, kind)
    if args.url:
        from spinf_jax.client import Client

        if problem := _unreachable(args.url):
            print(f"spinf-jax score: --url {args.url}: {problem}", file=sys.stderr)
            return 2
        if args.model:
            template["model"] = args.model
        client = Client(args.url, args.api_key)
        # One batch in flight unless told: the server gathers what its other clients send.
        ask = client.systemone_batch if kind is bulk.SYSTEMONE else client.score
        backend, in_flight = nullcontext(ask), args.in_flight or 1
    else:
        from spinf_jax.decision_apis import SystemOneBatches
        from spinf_jax.packs.loader import load_packs
        from spinf_jax.service import Service

        packs = load_packs(args.packs, official=not args.no_official_packs)
        service = Service.load(args.model, args.precision, buckets=args.buckets, packs=packs)
        # Two batches in flight: one planned while the other's passes run (bulk.pipelined).
        asker = SystemOneBatches(service.apis) if kind is bulk.SYSTEMONE else service.scorer
        backend, in_flight = bulk.pipelined(asker), args.in_flight or 2
    try:
        with backend as score, tqdm(total=bulk.count_lines(source), desc="scoring", unit="item") as bar:
            summary = bulk.run(source, out, template, score, args.batch, bar, in_flight, kind)
    except Exception as e:  # noqa: BLE001 - a refusal of the whole request, or the server gone mid-run
        print(f"spinf-jax score: {_one_line(e)}; what was scored is in {out}, and a rerun goes on from there",
              file=sys.stderr)  # fmt: skip
        return 1
    bulk.report(summary)
    return 1 if summary.bad else 0


def _asked_problem(template: dict, kind) -> str | None:
    """What is wrong with the questions of a `score` run, found before any model loads: the request each
    batch will send, over a stand-in content, checked as the server checks it (field names, types, counts)."""
    from spinf_jax import api, bulk, systemone
    from spinf_jax.decision_apis import systemone_questions
    from spinf_jax.decoding import convert
    from spinf_jax.errors import ScoringError

    try:
        if kind is bulk.SYSTEMONE:
            systemone_questions(convert({"state": "x"} | template, systemone.SystemOneRequest).questions)
        else:
            convert({"messages": [{"content": "x"}]} | template, api.ScoreRequest)
    except ScoringError as e:  # a message that names the place already is not prefixed with it again
        parent = (e.param or "").rsplit(".", 1)[0]
        named = not e.param or e.param in e.message or e.message.startswith((parent, "the body"))
        return e.message if named else f"{e.param}: {e.message}"
    return None


def _unreachable(url: str) -> str | None:
    """Why a server cannot be asked (one line), or None."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=10)
    except httpx.HTTPError as e:
        return f"cannot reach the server ({_one_line(e)}); is `spinf-jax serve` running there?"
    return None


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:300] + "…"


def _score_on_ray(args, source: Path, out: Path, template: dict, kind) -> int:
    """`score --ray ADDRESS|local`: Ray Data actors (spinf_jax.ray.Scores), one device each: every GPU of the
    cluster, or --devices N of them (on a cluster without GPUs, N actors of a CPU each; default 1)."""
    from tqdm import tqdm

    from spinf_jax import bulk
    from spinf_jax import ray as spinf_ray

    asked = args.devices or "all"
    if args.ray == "local":
        spinf_ray.start_local(1 if asked == "all" else int(asked))
    import ray  # after start_local, whose setting ray reads when first imported

    if args.ray != "local":
        ray.init(address=args.ray, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = (gpus or 1) if asked == "all" else int(asked)
    scores = {"model": args.model, "precision": args.precision, "scoring": template.get("scoring"),
              "packs": args.pack, "pack_sources": args.packs, "official_packs": not args.no_official_packs,
              "buckets": args.buckets}  # fmt: skip
    if kind is bulk.SYSTEMONE:
        scores["systemone"] = template
    try:
        with tqdm(total=bulk.count_lines(source), desc="scoring", unit="item") as bar:
            summary = spinf_ray.score_file(source, out, scores, actors, 1 if gpus else 0, args.batch, bar)
    finally:
        ray.shutdown()
    bulk.report(summary)
    return 0


def _score_on_replicas(args, source: Path, out: Path, template: dict, kind) -> int:
    """`score --devices`: the replicas of `serve --devices`, and their front on a thread of this process;
    batches go through it as through --url, two in flight per replica unless --in-flight says."""
    from tqdm import tqdm

    from spinf_jax import bulk, replicas
    from spinf_jax.builtin_models import DEFAULT_MODEL
    from spinf_jax.client import Client
    from spinf_jax.server.front import create_front
    from spinf_jax.server.protocol import in_thread
    from spinf_jax.server.settings import Settings

    if (found := _devices(args.devices, "score")) is None:
        return 2
    devices, count = found
    model = args.model or DEFAULT_MODEL
    serve = [model, "--log-level", "warning"] + (["--precision", args.precision] if args.precision else [])
    serve += [flag for source in args.packs for flag in ("--packs", source)]
    serve += ["--no-official-packs"] if args.no_official_packs else []
    serve += ["--buckets", ",".join(map(str, args.buckets))] if args.buckets else []
    pool = replicas.Replicas.spawn(serve, devices, count, os.environ)
    settings = Settings(model, args.precision or "bf16")
    with in_thread(create_front(settings, pool, devices.platform)) as url:
        try:
            pool.wait_ready(timeout=3600)
        except RuntimeError as e:
            print(f"spinf-jax score: {e}", file=sys.stderr)
            return 1
        with Client(url) as client, tqdm(total=bulk.count_lines(source), desc="scoring", unit="item") as bar:
            in_flight = args.in_flight or 2 * count
            ask = client.systemone_batch if kind is bulk.SYSTEMONE else client.score
            summary = bulk.run(source, out, template, ask, args.batch, bar, in_flight, kind)
    bulk.report(summary)
    return 0


def _quantize(args) -> int:
    """`spinf-jax quantize MODEL --precision fp8|int8 --out DIR`: a checkpoint in the engine's stored form,
    with its model card and parity report (spinf_jax.export)."""
    import shlex

    from spinf_jax import export

    command = ["spinf-jax", "quantize", args.model, "--precision", args.precision, "--out", args.out]
    if args.shard_gb != export.SHARD_BYTES / 1e9:
        command += ["--shard-gb", f"{args.shard_gb:g}"]
    command += ["--no-parity"] if args.no_parity else []
    try:
        report = export.quantize(
            args.model,
            args.precision,
            Path(args.out),
            shard_bytes=int(args.shard_gb * 1e9),
            measure=not args.no_parity,
            command=shlex.join(command),
        )
    except (FileExistsError, ValueError) as e:
        print(f"spinf-jax quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {report['weights_bytes']:,} bytes of weights")
    if args.no_parity:
        return 0
    print((Path(args.out) / "parity.md").read_text())
    return 0 if report["written_vs_quantized_at_load"]["bit_identical"] else 1


def _pack_sources(parser) -> None:
    """The flags that say which packs load: `serve`'s and the `packs` commands'."""
    parser.add_argument(
        "--packs",
        action="append",
        default=[],
        metavar="SOURCE",
        help="also load the prompt packs of this folder or git repository (URL[@ref]); repeatable",
    )
    parser.add_argument("--no-official-packs", action="store_true", help="skip the project's own packs")


PRECISION_DEFAULT = "default: what a `spinf-jax quantize` folder was written for, else bf16"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spinf-jax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"spinf-jax {version('spinf-jax')}")
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
        allow_abbrev=False,  # --devices passes the flags on to each replica as given, less its own
    )
    # Numbers and choices are read as text and checked by server.settings: it reports every problem at once.
    p.add_argument(
        "model", nargs="?", help="built-in name, folder, .gguf file or Hub id (default: Gemma 3 270M)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8000")
    p.add_argument(
        "--precision",
        metavar="{bf16,fp8,int8,fp32}",
        help=PRECISION_DEFAULT,
    )
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
    p.add_argument(
        "--request-deadline",
        default="600",
        metavar="SECONDS",
        help="answer a request not done this long after it arrived with 504 deadline_exceeded and drop its "
        "work not yet started (0: none)",
    )
    p.add_argument(
        "--no-hold-back",
        dest="hold_back",
        action="store_false",
        help="launch every request gathered for a pass at once, however much padding that costs",
    )
    p.add_argument("--buckets", help="pass sizes in tokens, comma-separated (default by backend)")
    p.add_argument(
        "--row-tile",
        metavar="ROWS",
        help="rows per tile of the GEMMs (default by backend: 2,048 on GPUs, 128 on the CPU); buckets hold "
        "two tiles at least, so a smaller tile allows smaller buckets for short requests "
        "(docs/configuration.md)",
    )
    p.add_argument(
        "--device-memory-cap", metavar="GIB", help="the most device memory to use (docs/configuration.md)"
    )
    p.add_argument(
        "--served-model-name", action="append", default=[], help="another name the model answers to"
    )
    p.add_argument(
        "--compile-cache",
        help="folder for compiled bucket programs, reused across restarts and shared by replicas ('none' to "
        "disable; default $JAX_COMPILATION_CACHE_DIR, else ~/.cache/spinf-jax/xla)",
    )
    _pack_sources(p)
    p.add_argument(
        "--calibration", metavar="FILE", help="per-workload temperatures from `spinf-jax calibrate` (/decide)"
    )
    p.add_argument(
        "--random-weights",
        metavar="CONFIG",
        help="for benchmarks: made-up weights at the shape of this transformers config.json, with MODEL's "
        "tokenizer (scores mean nothing)",
    )
    p.add_argument(
        "--warm-extraction",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile what a small request's {*}, {n}, {$} slots run before reporting ready (default); "
        "--no-warm-extraction: the first request with a slot compiles it",
    )
    p.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch https:// image URLs in contents (off: only data: URLs); the server then reaches any "
        "address a request names (docs/media.md)",
    )
    p.add_argument(
        "--remote-media-timeout",
        metavar="SECONDS",
        help="with --allow-remote-media: the longest one image may take to fetch (default 10)",
    )
    p.add_argument(
        "--profile-dir",
        metavar="DIR",
        help="let POST /v1/admin/profile write traces of the served traffic (device kernels, host threads) "
        "under DIR (docs/api.md)",
    )
    p.add_argument(
        "--devices",
        metavar="all|N",
        help="a replica process per device (all, or the first N), behind one front on --port; each scores as "
        "one device does (docs/scale-out.md)",
    )
    p.add_argument("--log-level", default="info", metavar="{critical,error,warning,info,debug,trace}")
    p.add_argument("--check", action="store_true", help="check the settings, then exit: 0 if valid, else 2")
    p.set_defaults(run=_serve)

    from spinf_jax.builtin_models import DEFAULT_MODEL

    p = sub.add_parser(
        "score",
        help="score a JSON Lines file of contents into a JSON Lines file of results (docs/bulk.md)",
        description="Streams any number of contents through the engine in this process (or a server with "
        "--url), in batches written and flushed as they finish; a restart skips what OUT already holds for "
        "the same request; bad lines are reported with their line number and skipped.",
    )
    p.add_argument(
        "input",
        help='JSON Lines: {"id", "text"} or {"id", "messages"} a line (with --systemone: {"id", "state"}); '
        "or CSV, a row a content",
    )
    p.add_argument("--out", required=True, help="JSON Lines of results, appended to")
    p.add_argument("--queries", help='a JSON file: a list of queries, or a scoring block {"queries": [...]}')
    p.add_argument(
        "--systemone",
        metavar="FILE",
        help='a JSON file: a System One question set {"id": {"type", ...}} (or {"questions": ..., "x_...": '
        "...}), asked of every line's state (docs/bulk.md)",
    )
    p.add_argument("--pack", action="append", default=[], metavar="ID", help="ask a prompt pack; repeatable")
    p.add_argument("--url", help="score through this server instead of in this process")
    p.add_argument("--api-key", help="with --url: the key (default $SPINF_API_KEY)")
    p.add_argument(
        "--model", help="in process: the model to load (default Gemma 3 270M); with --url: its name"
    )
    p.add_argument("--precision", choices=["fp32", "bf16", "fp8", "int8"], help=PRECISION_DEFAULT)
    p.add_argument("--batch", type=int, default=64, help="contents per request (and per flush)")
    p.add_argument(
        "--devices",
        metavar="all|N",
        help="score on a replica per device (all, or the first N), as `serve --devices` (docs/scale-out.md)",
    )
    p.add_argument("--buckets", help="pass sizes in tokens, comma-separated (default by backend)")
    p.add_argument(
        "--ray",
        metavar="ADDRESS|local",
        help="score on a Ray cluster (the `ray` extra), an actor per device; the input may be Parquet "
        "(docs/scale-out.md)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        metavar="N",
        help="batches asked at once, written in input order (default: 2 in process, one planned while the "
        "other runs; 1 with --url; 2 per device with --devices)",
    )
    _pack_sources(p)
    p.set_defaults(run=_score)

    p = sub.add_parser(
        "calibrate",
        help="fit one temperature per workload on labelled rows (docs/calibration.md)",
        description="Scores labelled decisions, questions or typed (System One) questions, fits a "
        "temperature per workload (typed rows: per question type) by NLL, reports "
        "accuracy, balanced accuracy, NLL, Brier and ECE before and after (out of fold, with bootstrap 95% "
        "intervals), draws a reliability plot per workload, and writes the file `serve --calibration` reads.",
    )
    p.add_argument(
        "rows", help="JSON Lines: decisions or questions, each with its label (docs/calibration.md)"
    )
    p.add_argument("--out", required=True, help="the calibration file to write (plots go beside it)")
    p.add_argument("--workload", default="default", help="the workload of rows that name none")
    p.add_argument("--orderings", choices=["rotations", "all"], help="score decisions over these orderings")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp8", "int8"], help=PRECISION_DEFAULT)
    p.add_argument("--bootstrap", type=int, default=1000, help="draws for the 95%% intervals")
    p.add_argument(
        "--by-options",
        action="store_true",
        help="typed rows: also fit T(n) = a + b·ln n over their option counts (temperature_by_options)",
    )
    p.add_argument(
        "--target-precision",
        type=float,
        default=0.9,
        help="questions: the precision each option's threshold must reach",
    )
    p.set_defaults(run=_calibration)

    p = sub.add_parser(
        "quantize",
        help="write a checkpoint in the engine's fp8 or int8 stored form, with its model card and parity "
        "report (docs/quantize.md)",
        description="Writes the weights exactly as the engine keeps them at that precision (loading the "
        "folder quantizes nothing and gives the same scores), config.json with its quantization_config, the "
        "tokenizer, README.md (the model card), and parity.json / parity.md: the folder's scores against "
        "quantizing at load (bit-identical, else exit status 1) and against the source at fp32.",
    )
    p.add_argument("model", help="built-in name, folder, .gguf file or Hub id")
    p.add_argument("--precision", required=True, choices=["fp8", "int8"])
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--shard-gb", type=float, default=2.0, help="largest weights file, in GB (10^9 bytes)")
    p.add_argument(
        "--no-parity", action="store_true", help="skip the parity report (it loads the model 3 times)"
    )
    p.set_defaults(run=_quantize)

    p = sub.add_parser(
        "packs", help="prompt packs: list, show, validate, schema, calibrate (docs/prompt-packs.md)"
    )
    actions = p.add_subparsers(dest="action", required=True)

    _pack_sources(actions.add_parser("list", help="the packs loaded by default (and from --packs)"))
    q = actions.add_parser("show", help="one pack, as loaded")
    q.add_argument("id")
    _pack_sources(q)
    q = actions.add_parser("validate", help="check pack files, with a model's tokenizer unless --no-model")
    q.add_argument("paths", nargs="+")
    q.add_argument("--model", default=DEFAULT_MODEL)
    q.add_argument("--no-model", action="store_true", help="check the format only")
    actions.add_parser("schema", help="print the pack file's JSON Schema (packs/schema.json)")
    q = actions.add_parser("calibrate", help="baselines from normal traffic, thresholds from labelled rows")
    q.add_argument("id")
    q.add_argument("--traffic", required=True, help="normal traffic: JSON Lines with text (or messages)")
    q.add_argument("--labelled", help='labelled rows: JSON Lines with text and "categories": [...]')
    q.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="LABEL=PRECISION",
        help="precision a label's rules must reach (default 0.9 for the gravest, 0.7 others)",
    )
    q.add_argument("--model", default=DEFAULT_MODEL)
    q.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp8", "int8"])
    q.add_argument("--out", help="where to write the calibrated pack (default: over the pack's file)")
    q.add_argument("--report", help="also write the report as JSON here")
    _pack_sources(q)
    for q in actions.choices.values():
        q.set_defaults(run=_packs)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: `serve --devices` passes it on
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C: the command stops where it is, with a line rather than a traceback
        print(f"\nspinf-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`spinf-jax packs schema | head`): nothing more to say
        # Python flushes stdout once more on its way out, which would raise again: point it at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
