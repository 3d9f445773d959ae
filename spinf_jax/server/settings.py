"""The server's settings, and `spinf-jax serve`'s flags read into them with every check that can run before a
model is loaded (docs/configuration.md).

The server fails closed: read_flags reports every problem at once, one line each naming the flag and what is
wrong, and `serve` starts nothing while there is one; `serve --check` stops after the checks. create_app takes
a Settings as it is given: tests build edge cases (a queue of 0) on purpose.
"""

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spinf_jax.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL
from spinf_jax.calibration import Calibration, CalibrationError, load_calibration
from spinf_jax.compiler import Limits
from spinf_jax.loader import default_row_tile, has_tokenizer_files
from spinf_jax.packer import Buckets, default_sizes
from spinf_jax.packs.format import PackError
from spinf_jax.packs.loader import LoadedPack, load_packs
from spinf_jax.quant import Precision
from spinf_jax.quantized import folder_precision

PRECISIONS = ("bf16", "fp8", "int8", "fp32")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
KEY_VARIABLE = "SPINF_API_KEY"
COMPILE_CACHE = (
    "~/.cache/spinf-jax/xla"  # --compile-cache's default, unless $JAX_COMPILATION_CACHE_DIR is set
)
REMOTE_MEDIA_TIMEOUT = "10"  # seconds one remote image may take: --remote-media-timeout's default


@dataclass(frozen=True)
class Settings:
    model: str
    precision: str = "bf16"
    buckets: tuple[int, ...] | None = None  # None: by backend (packer.default_sizes)
    # Rows of row-local work (the GEMMs) per tile (models.layers.by_rows); None: by backend
    # (loader.default_row_tile). Smaller tiles allow smaller buckets: short requests answer sooner, large
    # passes take longer (docs/configuration.md).
    row_tile: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: no key asked; never in a repr (logs)
    metrics_auth: bool = False  # /metrics asks for a key too
    max_queue: int = 64
    max_delay_ms: float = 5.0
    # From a request's arrival (its body read) to its answer: past this it is answered deadline_exceeded (504)
    # and its work not yet launched is dropped. 0: no deadline.
    request_deadline_s: float = 600.0
    # A batch gathered while the device was busy may leave its last requests to the next (spinf_jax.runner):
    # fewer padding rows, up to one pass more for those requests.
    hold_back: bool = True
    served_names: tuple[str, ...] = ()  # extra names the model answers to (e.g. the hosted service's)
    # The weights and the largest pass must fit in this (checked once compiled: the server refuses to serve
    # otherwise); on GPUs the allocator is held to it too.
    device_memory_cap_gib: float | None = None
    # The prompt packs requests may name, read and checked (spinf_jax.packs.loader); None: the official ones.
    packs: dict[str, LoadedPack] | None = field(default=None, compare=False, repr=False)
    # Per-workload temperatures for decisions (spinf_jax.calibration), read and checked; None: no workloads.
    calibration: Calibration | None = field(default=None, compare=False, repr=False)
    # Report loading and compiling (spinf_jax.progress): `serve` does; tests and notebooks stay quiet.
    progress: bool = False
    # A transformers config.json: serve made-up weights at its shape with the model's tokenizer (for
    # benchmarks; loader.random_model). None: the model's own weights.
    random_weights: Path | None = None
    # Compile what a small request's {*}, {n} or {$} slots run before ready (Engine.warmup); any other
    # extraction program compiles on the first request that needs it. False: that for all of them.
    warm_extraction: bool = True
    # Fetch https:// image URLs within this many seconds each (--allow-remote-media); None: refuse them.
    remote_media_timeout_s: float | None = None
    # POST /v1/admin/profile writes device and host traces of the served traffic under this folder
    # (--profile-dir); None: the route answers profiling_off.
    profile_dir: Path | None = None

    def limits(self) -> Limits:
        """What requests may ask of this server (compiler.Limits)."""
        if self.remote_media_timeout_s is None:
            return Limits()
        return Limits(allow_remote_media=True, remote_media_timeout_s=self.remote_media_timeout_s)


@dataclass(frozen=True)
class Launch:
    """The settings, and what the process needs besides to serve them."""

    settings: Settings
    host: str
    port: int
    log_level: str
    compile_cache: Path | None  # None: compiled programs are not kept across restarts
    devices: str | None = None  # "all" or a count: a replica per device behind a front (spinf_jax.replicas)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def summary(self) -> str:
        """What will be served, in one line; it tells how many keys there are, never what they are."""
        s, cap = self.settings, self.settings.device_memory_cap_gib
        keys = f"{len(s.api_keys)} API key(s)" if s.api_keys else "no API key"
        model = (
            f"made-up weights at {s.random_weights}, {s.model}'s tokenizer" if s.random_weights else s.model
        )
        replicas = f", a replica on each of {self.devices} device(s)" if self.devices else ""
        return (
            f"{model} ({s.precision}) on {self.host}:{self.port}{replicas}; {keys}, /metrics "
            f"{'behind the key' if s.metrics_auth else 'open'}; buckets {s.buckets or 'by backend'}"
            f"{f' in row tiles of {s.row_tile}' if s.row_tile else ''}; "
            f"queue {s.max_queue}, delay {s.max_delay_ms:g} ms; device memory "
            f"{f'at most {cap:g} GiB' if cap else 'uncapped'}; packs {', '.join(s.packs or {}) or 'none'}; "
            f"workloads {', '.join(s.calibration.workloads) if s.calibration else 'none'}; remote images "
            f"{'off' if s.remote_media_timeout_s is None else f'on ({s.remote_media_timeout_s:g} s)'}"
        )


class SettingsError(Exception):
    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def read_flags(args: argparse.Namespace, environ: Mapping[str, str]) -> Launch:
    """`serve`'s flags (as strings: a number that is not one is a problem to report with the others) and the
    environment → a Launch, or SettingsError with every problem found."""
    problems: list[str] = []
    model = args.model or DEFAULT_MODEL
    tokenizer_files = args.random_weights is not None and has_tokenizer_files(Path(model).expanduser())
    if not tokenizer_files and (problem := _model_problem(model)):
        problems.append(f"MODEL {model!r}: {problem}")
    precision = args.precision
    if precision is None:
        try:
            precision = (folder_precision(model) or Precision.BF16).value
        except (ValueError, OSError) as e:
            problems.append(f"MODEL {model!r}: {e}")
    elif args.precision not in PRECISIONS:
        problems.append(f"--precision: {args.precision!r} is not one of {', '.join(PRECISIONS)}")
    keys = _api_keys(args, environ, problems)
    if args.metrics_auth and not keys:
        problems.append(
            f"--metrics-auth: there is no key to ask for (--api-key, --api-key-file, ${KEY_VARIABLE})"
        )
    max_queue = _whole("--max-queue", args.max_queue, problems, low=1)
    max_delay_ms = _number("--max-delay-ms", args.max_delay_ms, problems, "milliseconds", zero=True)
    deadline_s = _number("--request-deadline", args.request_deadline, problems, "seconds", zero=True)
    cap = args.device_memory_cap
    cap_gib = None if cap is None else _number("--device-memory-cap", cap, problems, "GiB", zero=False)
    row_tile = None if args.row_tile is None else _whole("--row-tile", args.row_tile, problems, low=16)
    buckets = None if args.buckets is None else _buckets(args.buckets, problems, row_tile)
    if args.buckets is None and row_tile:
        try:
            Buckets(default_sizes()).check_row_tile(row_tile)
        except ValueError as exc:
            problems.append(f"--row-tile: the default buckets do not fit it ({exc}): give --buckets too")
    remote = args.remote_media_timeout or REMOTE_MEDIA_TIMEOUT
    remote_s = _number("--remote-media-timeout", remote, problems, "seconds", zero=False)
    if args.remote_media_timeout is not None and not args.allow_remote_media:
        problems.append("--remote-media-timeout: only with --allow-remote-media")
    if any(not name.strip() for name in args.served_model_name):
        problems.append("--served-model-name: a name is empty")
    if not args.host.strip():
        problems.append("--host: is empty")
    port = _whole("--port", args.port, problems, low=1, high=65535)
    if args.log_level.lower() not in LOG_LEVELS:
        problems.append(f"--log-level: {args.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    cache_flag = args.compile_cache or environ.get("JAX_COMPILATION_CACHE_DIR") or COMPILE_CACHE
    cache = None if cache_flag == "none" else Path(cache_flag).expanduser()
    if cache is not None and cache.exists() and not cache.is_dir():
        problems.append(f"--compile-cache: {str(cache)!r} is not a folder")
    random_weights = None if args.random_weights is None else Path(args.random_weights).expanduser()
    if random_weights is not None and (problem := _config_problem(random_weights)):
        problems.append(f"--random-weights {str(random_weights)!r}: {problem}")
    packs = None
    try:
        packs = load_packs(args.packs, official=not args.no_official_packs)
    except PackError as e:
        problems.append(f"--packs: {e}")
    calibration = None
    if args.calibration is not None:
        try:
            calibration = load_calibration(args.calibration)
        except CalibrationError as e:
            problems.append(f"--calibration: {e}")
    profile_dir = None if args.profile_dir is None else Path(args.profile_dir).expanduser()
    if profile_dir is not None and profile_dir.exists() and not profile_dir.is_dir():
        problems.append(f"--profile-dir: {str(profile_dir)!r} is not a folder")
    devices = args.devices
    if devices is not None and devices != "all":
        _whole("--devices", devices, problems, low=1)
    if problems:
        raise SettingsError(problems)
    settings = Settings(
        packs=packs,
        calibration=calibration,
        model=model,
        precision=precision,
        buckets=buckets,
        row_tile=row_tile,
        api_keys=keys,
        metrics_auth=args.metrics_auth,
        max_queue=max_queue,
        max_delay_ms=max_delay_ms,
        request_deadline_s=deadline_s,
        hold_back=args.hold_back,
        served_names=tuple(args.served_model_name),
        device_memory_cap_gib=cap_gib,
        progress=True,
        random_weights=random_weights,
        warm_extraction=args.warm_extraction,
        remote_media_timeout_s=remote_s if args.allow_remote_media else None,
        profile_dir=profile_dir,
    )
    return Launch(settings, args.host, port, args.log_level.lower(), cache, devices)


def _model_problem(spec: str) -> str | None:
    """What is wrong with a model named on the command line, as far as can be told without loading it: a
    local checkpoint must exist and look like one; a built-in name or a Hub id is checked when it loads."""
    if spec in BUILTIN_MODELS:
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
        return None if looks_like_hub_id else "no such file or folder, and not a built-in name or a Hub id"
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            return "a folder without config.json or a single .gguf file"
        path = ggufs[0]
    try:
        if path.is_dir():
            json.loads((path / "config.json").read_text())
            return None
        with path.open("rb") as file:
            magic = file.read(4)
    except (OSError, ValueError) as exc:  # ValueError: config.json is not JSON (nor UTF-8)
        return f"cannot be read: {exc}"
    return None if path.suffix == ".gguf" and magic == b"GGUF" else f"{path.name} is not a GGUF file"


def _config_problem(path: Path) -> str | None:
    """What is wrong with a --random-weights config, as far as reading it tells."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"cannot be read as JSON: {exc}"
    if not isinstance(config, dict) or "model_type" not in config:
        return "not a transformers config.json (no model_type)"
    return None


def _api_keys(args: argparse.Namespace, environ: Mapping[str, str], problems: list[str]) -> tuple[str, ...]:
    """Every --api-key and the keys of every --api-key-file; $SPINF_API_KEY only when neither is given. A
    problem names where the key came from, never the key."""
    found = [(f"--api-key (#{i})", key) for i, key in enumerate(args.api_key, 1)]
    for path in args.api_key_file:
        found += _key_file(path, problems)
    if not (args.api_key or args.api_key_file) and KEY_VARIABLE in environ:  # set but empty: refused below
        found.append((f"${KEY_VARIABLE}", environ[KEY_VARIABLE]))
    for where, key in found:
        if not key:
            problems.append(f"{where}: the key is empty")
        elif not all("!" <= c <= "~" for c in key):
            problems.append(
                f"{where}: the key has a character that is not visible ASCII (a space, a control)"
            )
    return tuple(dict.fromkeys(key for _, key in found))


def _key_file(path: str, problems: list[str]) -> list[tuple[str, str]]:
    """One key a line; blank lines and lines that start with # are skipped."""
    flag = f"--api-key-file {path!r}"
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{flag}: cannot be read: {exc}")
        return []
    keys = [
        (f"{flag} line {n}", line.strip())
        for n, line in enumerate(lines, 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not keys:
        problems.append(f"{flag}: holds no key (one a line; blank lines and # comments are skipped)")
    return keys


def _whole(flag: str, text: str, problems: list[str], low: int, high: int | None = None) -> int | None:
    try:
        value = int(text)
    except ValueError:
        problems.append(f"{flag}: {text!r} is not a whole number")
        return None
    if value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        problems.append(f"{flag}: must be {bounds}, not {value}")
    return value


def _number(flag: str, text: str, problems: list[str], unit: str, *, zero: bool) -> float | None:
    try:
        value = float(text)
    except ValueError:
        problems.append(f"{flag}: {text!r} is not a number")
        return None
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        problems.append(
            f"{flag}: must be a number of {unit}, {'0 or more' if zero else 'above 0'}, not {text!r}"
        )
    return value


def read_buckets(text: str) -> tuple[int, ...]:
    """A --buckets flag's sizes; SettingsError if they are not a set the engine would take."""
    problems: list[str] = []
    sizes = _buckets(text, problems)
    if problems:
        raise SettingsError(problems)
    return sizes


def _buckets(text: str, problems: list[str], row_tile: int | None = None) -> tuple[int, ...] | None:
    try:
        sizes = tuple(int(size) for size in text.split(","))
    except ValueError:
        problems.append(f"--buckets: {text!r} is not a comma-separated list of whole numbers")
        return None
    try:
        # Ascending multiples of the block and of the read chunk, none too small, whole row tiles: what the
        # engine checks once the model is loaded, and the row tile (the backend's unless given) is known
        # before that.
        Buckets(sizes).check_row_tile(row_tile or default_row_tile())
    except ValueError as exc:
        problems.append(f"--buckets: {exc}")
        return None
    return sizes
