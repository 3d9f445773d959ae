"""How long launching a pass holds the host, against the pass's whole time, and what the host does meanwhile.

    python3 benchmarks/launch_costs.py --tokenizer TOKENIZER_JSON --out $OUT [--buckets 4096,16384]
        [--row-tile 2048]

The engine is Gemma 3 12B's shape with made-up weights (common.random_engine); the passes are the seed job's.
For the first pass of each bucket size: the time `Engine._launch_pass` takes to return (the program and its
read chunks dispatched; JAX returns before the device is done unless something in the program waits for the
device) and the time until its outputs are ready, the median of --repeats. Then --repeats launches of the
largest bucket's pass run under `jax.profiler.trace`, and the host events inside the launches are summed by
name (digits folded to N): whether the host waited on the device (a predicate copied back, a synchronize) or
spent its time enqueueing the program's thunks. Also the seed job's time through `Engine.score` (median of
--repeats) and a sha256 of its passes' target log-probs and top tokens, to compare settings such as --row-tile
or XLA flags (each in its own process): same digest, same bits. Writes launch_costs.json and launch_costs.md.
"""

import collections
import hashlib
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from common import engine_args, warm_seed_engine
from pass_profile import trace_events

from spinf_jax.packer import pack


def launch_times(engine, p, repeats: int) -> dict:
    jax.block_until_ready(engine._launch_pass(p))  # compiled and warm
    launch, total = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = engine._launch_pass(p)
        launch.append(time.perf_counter() - start)
        jax.block_until_ready(outputs)
        total.append(time.perf_counter() - start)
    return {"size": p.size, "reads": p.reads, "launch_ms": 1e3 * statistics.median(launch),
            "total_ms": 1e3 * statistics.median(total)}  # fmt: skip


def bits_digest(engine, trees) -> str:
    """sha256 over every tree's target log-probs and top tokens, in order."""
    h = hashlib.sha256()
    for scored in engine.score_trees(trees):
        h.update(np.asarray(scored.logprobs).tobytes() + np.asarray(scored.top_tokens).tobytes())
    return h.hexdigest()


def host_events(engine, p, repeats: int) -> dict:
    """Host events inside traced launches, by name: calls and milliseconds per launch."""
    folder = Path(tempfile.mkdtemp())
    with jax.profiler.trace(str(folder)):
        for i in range(repeats):
            with jax.profiler.TraceAnnotation(f"launch-{i}"):
                outputs = engine._launch_pass(p)
            jax.block_until_ready(outputs)
    events, device = trace_events(folder)
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] not in device]
    launches = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans if e["name"].startswith("launch-")
    ]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in spans:
        if not e["name"].startswith("launch-") and any(a <= float(e["ts"]) < b for a, b in launches):
            row = by_name[re.sub(r"\d+", "N", e["name"])]
            row[0] += 1
            row[1] += float(e["dur"]) / 1e3
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        name: {"calls": calls / len(launches), "ms": ms / len(launches)} for name, (calls, ms) in rows[:40]
    }


def main() -> None:
    args = engine_args(__doc__, lambda parser: parser.add_argument("--row-tile", type=int))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine, request = warm_seed_engine(args)
    trees = engine.service.scorer.plan(request).trees
    passes = pack(trees, engine.buckets)
    first = {p.size: p for p in reversed(passes)}
    times = [launch_times(engine, p, args.repeats) for p in sorted(first.values(), key=lambda p: p.size)]
    events = host_events(engine, first[max(first)], args.repeats)
    job = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.score(request)
        job.append(time.perf_counter() - start)
    job_s = statistics.median(job)
    digest = bits_digest(engine, trees)
    device = jax.devices()[0].device_kind
    lines = [
        f"Launching a pass, Gemma 3 12B shape, {args.precision}, random weights, {device}, "
        f"row tile {engine.model.row_tile}; the seed job {job_s:.4f} s (Engine.score, median), its bits "
        f"sha256 {digest[:16]}",
        "",
        "| bucket | reads | launch returns (ms) | outputs ready (ms) |",
        "|---|---|---|---|",
        *(f"| {t['size']} | {t['reads']} | {t['launch_ms']:.1f} | {t['total_ms']:.1f} |" for t in times),
        "",
        f"Host events inside a launch of the {max(first)}-row pass (per launch; nested events overlap):",
        "",
        "| event | calls | ms |",
        "|---|---|---|",
        *(
            f"| `{name[:80]}` | {row['calls']:.0f} | {row['ms']:.2f} |"
            for name, row in list(events.items())[:20]
        ),
    ]
    results = {"device": device, "precision": args.precision, "row_tile": engine.model.row_tile,
               "seed_job_s": job_s, "seed_job_sha256": digest, "launches": times,
               "host_events": events}  # fmt: skip
    (out / "launch_costs.json").write_text(json.dumps(results, indent=1))
    (out / "launch_costs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
