"""How long the README's first request takes after `spinf-jax serve` says ready, as a new user meets it.

    uv run --extra server --extra models python benchmarks/first_request.py --out FILE

For each start (the default, then `--no-warm-extraction`), one after the other, each with an empty compile
cache of its own (as on a fresh machine): the seconds from the process's start until /health says ready,
then the README's first `curl` body (read from README.md, so the doc's own request is measured) sent at
once, twice: the first answer's seconds and the second's. The first request holds a `{*}` slot, whose
programs the server compiles ahead of it by default. Prints a line per start and ends with one JSON line;
--out writes the JSON too.
"""

import argparse
import json
import re
import shlex
import tempfile
import time
from pathlib import Path

import httpx
from common import write_cpu_document
from server_process import start_server, stop_server, wait_ready

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_request() -> dict:
    """The README's first curl body (its `-d '...'`)."""
    body = re.search(r"curl -s localhost:8000/v1/score .*? -d '(.*?)'", README.read_text(), re.S)
    return json.loads(body.group(1))


def one_start(flags: list[str], serve_args: list[str]) -> dict:
    cache = tempfile.mkdtemp()
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    start = time.perf_counter()
    process, url = start_server([*serve_args, "--compile-cache", cache, *flags], log)
    try:
        wait_ready(url, process, timeout=1800)
        ready = time.perf_counter() - start
        body, seconds = readme_request(), []
        for _ in range(2):
            asked = time.perf_counter()
            httpx.post(f"{url}/v1/score", json=body, timeout=600).raise_for_status()
            seconds.append(time.perf_counter() - asked)
    finally:
        stop_server(process)
    return {"flags": flags, "ready_seconds": ready, "first_seconds": seconds[0], "second_seconds": seconds[1],
            "log": log.read_text().splitlines()[-40:]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-args", default="", help="more flags for every start")
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = []
    for flags in ([], ["--no-warm-extraction"]):
        runs.append(one_start(flags, shlex.split(args.serve_args)))
        shown = {k: v for k, v in runs[-1].items() if k != "log"}
        print(json.dumps(shown), flush=True)
    write_cpu_document("first_request", args.out, runs=runs)


if __name__ == "__main__":
    main()
