"""How long `spinf-jax serve` takes to be ready at Gemma 3 12B's shape (made-up weights), cold and warm.

    python3 benchmarks/start_time.py --tokenizer TOKENIZER_DIR --out $OUT [--buckets 4096,16384]

Four starts, one after another, each a process of its own on the served default buckets (or --buckets): the
start without extraction programs (`--no-warm-extraction`) with an empty compile cache (cold), the same again
(warm: the programs the first compiled), then the default start (extraction programs too) with another empty
cache, and again warm. Each: the seconds from the process's start until
/health says ready, what the server's "ready" log line says of it (seconds loading and compiling), and the
seconds until no bucket is left compiling in the background (a plain start is ready with its smallest and
largest). Writes start_time.json, start_time.md and each start's log (the caches go to a temporary folder).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import GEMMA3_12B
from server_process import start_server, stop_server, wait_compiled, wait_ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True, help="a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--precision", default="fp8")
    parser.add_argument("--buckets", help="the served default where not given")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "gemma-3-12b.json"
    config.write_text(json.dumps(GEMMA3_12B))
    serve = [args.tokenizer, "--random-weights", str(config), "--precision", args.precision]
    serve += ["--log-level", "info", *(["--buckets", args.buckets] if args.buckets else [])]
    caches = Path(tempfile.mkdtemp())
    rows = []
    for flags, cache in ((["--no-warm-extraction"], "plain"), ([], "extraction")):
        for state in ("cold", "warm"):
            name = f"{cache}-{state}"
            start = time.perf_counter()
            process, url = start_server([*serve, "--compile-cache", str(caches / cache), *flags],
                                        out / f"server-{name}.log")  # fmt: skip
            try:
                ready = wait_ready(url, process, timeout=900)
                rows.append({"start": name, "flags": flags, "ready_seconds": time.perf_counter() - start,
                             "ready_buckets": ready.get("buckets")})  # fmt: skip
                rows[-1]["buckets"] = wait_compiled(url, timeout=900).get("buckets")
                rows[-1]["compiled_seconds"] = time.perf_counter() - start
            finally:
                stop_server(process)
            rows[-1] |= _ready_line(out / f"server-{name}.log")
            print(rows[-1], flush=True)
            (out / "start_time.json").write_text(json.dumps(rows, indent=1))  # each start as it ends
    table = [
        "| start | compile cache | flags | ready with buckets | ready after | loading | compiling "
        "| all compiled after |",
        "|---" * 8 + "|",
    ]
    for row in rows:
        cache = row["start"].rsplit("-", 1)[1]
        buckets = ", ".join(f"{b:,}" for b in row["ready_buckets"] or [])
        seconds = f"{row['ready_seconds']:.1f} s | {row.get('load_s', '?')} s | {row.get('compile_s', '?')} s"
        table.append(
            f"| {row['start']} | {cache} | {' '.join(row['flags'])} | {buckets} | {seconds} "
            f"| {row['compiled_seconds']:.1f} s |"
        )
    (out / "start_time.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


def _ready_line(log: Path) -> dict:
    """load_s and compile_s from the server's "ready" event (a JSON log line), where it wrote one."""
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"event": "ready"' in line:
            event = json.loads(line)
            return {k: event[k] for k in ("load_s", "compile_s") if k in event}
    return {}


if __name__ == "__main__":
    main()
