"""Where a pass's device time goes at a real model shape: the seed job's passes under the JAX profiler, each
GPU kernel put in a class (fp8/bf16 GEMMs, tree attention, norms and reductions, quantization and casts,
other elementwise fusions), with the device's busy share of the passes' wall time and its idle stretches
by length (the kernels they came before say where the device waited for the host).

    python3 benchmarks/pass_profile.py --tokenizer TOKENIZER_JSON --out $OUT [--buckets 4096,16384]

The engine is Gemma 3 12B's shape with made-up weights (common.random_engine): speed does not depend on the
values. The seed job is scored once to compile and warm, then `--repeats` times inside `jax.profiler.trace`;
the kernels of the trace's GPU streams are summed by class. Writes pass_profile.json (every kernel name with
its class, calls and seconds) and pass_profile.md (the table), and prints the table.

A second table puts the time by what the model code was doing: the programs' optimized HLO (written beside,
gzipped) says which of the model's named scopes (mlp, linear, quantize, norm, rope, attention, lm_head) the
ops XLA fused into each of its kernels came from. `--from DIR` redoes that table from a run's files. A third
lists the copies by the kernel that ran before each (copies_by_neighbour).
"""

import argparse
import gzip
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
from common import engine_args, warm_seed_engine

# The model's named scopes (jax.named_scope in spinf_jax.models and spinf_jax.quant), outermost first.
SCOPES = ("lm_head", "attention", "mlp", "linear", "quantize", "norm", "rope")

# Kernel name patterns, first match wins. cuBLAS(Lt) names its GEMMs sm90_xmma_gemm_*, nvjet_* or
# cutlass_*; XLA names its own fusions after their root op (loop_/input_ fusions, reduce_, convert_).
CLASSES = (
    ("tree attention (Pallas)", re.compile(r"tree_attention|decode_attention")),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|triton_gemm|dot", re.I)),
    ("norms and reductions", re.compile(r"reduce|norm|softmax|argmax", re.I)),
    ("quantization and casts", re.compile(r"convert|quant|scale|e4m3|bitcast", re.I)),
    ("copies and gathers", re.compile(r"co?py|memset|gather|scatter|dynamic.?slice|transpose|concat", re.I)),
    ("other fusions", re.compile(r".")),
)


def kernel_class(name: str) -> str:
    return next(label for label, pattern in CLASSES if pattern.search(name))


def trace_events(trace_dir: Path) -> tuple[list[dict], set[int]]:
    """The events of the newest trace the JAX profiler wrote in the folder (Chrome trace events), and the ids
    of its GPU processes."""
    [trace] = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))[-1:]
    with gzip.open(trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
        and "/device:GPU" in e["args"].get("name", "")
    }  # fmt: skip
    return events, gpu


def device_kernels(trace_dir: Path) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, duration µs) of every event on a GPU stream, newest trace in the folder."""
    events, gpu = trace_events(trace_dir)
    # The GPU process also has lines that repeat the kernels' time by XLA op and module: keep the streams.
    threads = {
        (e["pid"], e["tid"]): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu
    }
    streams = {key for key, name in threads.items() if not re.search(r"XLA (Ops|Modules)|Steps", name)}
    print("GPU lines kept:", sorted(threads[k] for k in streams))
    return [
        (e["name"], float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and (e["pid"], e["tid"]) in streams
    ]


def copies_by_neighbour(kernels: list[tuple[str, float, float]]) -> list[dict]:
    """The copy-class kernels' time by the last other kernel that started before each (a trace of the server
    has no line of XLA ops to say which op a copy ran for; its neighbour tells a layer loop's copies from a
    pass's inputs and from the reads' programs)."""
    rows: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    before = ""
    for name, _, dur in sorted(kernels, key=lambda k: k[1]):
        if kernel_class(name) != "copies and gathers":
            before = name
            continue
        row = rows[(name, before)]
        row[0] += 1
        row[1] += dur / 1e6
    return sorted(
        ({"kernel": k, "after": b, "calls": c, "seconds": s} for (k, b), (c, s) in rows.items()),
        key=lambda r: -r["seconds"],
    )


def copies_table(rows: list[dict]) -> str:
    lines = ["| copy kernel | the last other kernel before it | calls | seconds |", "|---|---|---|---|"]
    lines += [
        f"| `{r['kernel'][:40]}` | `{r['after'][:60] or '-'}` | {r['calls']} | {r['seconds']:.4f} |"
        for r in rows[:15]
    ]
    return "\n".join(lines)


def hlo_labels(hlo: str) -> dict[str, str]:
    """HLO instruction name → where its work comes from in the model: the named scopes (SCOPES, as paths
    such as "mlp/linear/quantize") of the ops fused into it, or where none has a scope, its root's primitive
    in brackets ("[dynamic_update_slice]")."""
    computations: dict[str, list[tuple[str, str, list[str]]]] = {}
    roots: dict[str, str] = {}  # computation → its root's opcode
    opcodes: dict[str, str] = {}
    current = None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            head = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            current = computations.setdefault(head, [])
        elif current is not None and " = " in line:
            name = line.split(" = ")[0].split()[-1].lstrip("%")
            op_name = re.search(r'op_name="([^"]*)"', line)
            calls = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)
            current.append((name, op_name.group(1) if op_name else "", calls))
            opcode = re.search(r" = .*? ([a-z][\w\-]*)\(", line)
            opcodes[name] = opcode.group(1) if opcode else "?"
            if line.lstrip().startswith("ROOT "):
                roots[head] = opcodes[name]

    def scope(op_name: str) -> str:
        return "/".join(c for c in op_name.split("/") if c in SCOPES)

    def scopes(computation: str, seen: set) -> set[str]:
        if computation in seen:
            return set()
        seen.add(computation)
        found = set()
        for _, op_name, calls in computations.get(computation, ()):
            found |= {scope(op_name)} - {""}
            for c in calls:
                found |= scopes(c, seen)
        return found

    labels = {}
    for instructions in computations.values():
        for name, op_name, calls in instructions:
            found = {scope(op_name)} - {""}
            for c in calls:
                found |= scopes(c, set())
            primitive = op_name.rsplit("/", 1)[-1] or (roots.get(calls[0], "?") if calls else opcodes[name])
            labels[name] = " + ".join(sorted(found)) if found else f"[{primitive}]"
    return labels


def by_scope(kernels: list[dict], hlos: list[str]) -> list[dict]:
    """Seconds and calls of the summary's kernels by hlo_labels' label. A kernel XLA generated is named after
    its HLO instruction ("loop_convert_fusion_10" for loop_convert_fusion.10), looked up in the programs in
    the order given (the largest bucket's first: its passes take most of the time, and another program may
    reuse a name); cuBLAS's GEMMs, copies and the Pallas kernels keep their class, in brackets."""
    labels: dict[str, str] = {}
    for hlo in reversed(hlos):
        labels |= {re.sub(r"[.\-]", "_", name): label for name, label in hlo_labels(hlo).items()}
    rows: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        row = rows[labels.get(k["name"], f"({k['class']})")]
        row[0] += k["calls"]
        row[1] += k["seconds"]
    total = sum(s for _, s in rows.values())
    return sorted(
        ({"scopes": k, "calls": c, "seconds": s, "share": s / total} for k, (c, s) in rows.items()),
        key=lambda r: -r["seconds"],
    )


def scope_table(rows: list[dict]) -> str:
    lines = [
        "| model scopes of the ops in a kernel | calls | seconds | share of op time |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['scopes']} | {r['calls']} | {r['seconds']:.4f} | {r['share']:.1%} |" for r in rows[:25]]
    return "\n".join(lines)


# Idle stretches of the device (no kernel on any stream), by length in µs: launch latency between the kernels
# of one program is a few µs; the host walking a loop or planning the next pass shows as longer ones.
GAP_BINS = ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf")))


def span_seconds(kernels: list[tuple[str, float, float]]) -> float:
    """From the first kernel's start to the last one's end."""
    return (max(start + dur for _, start, dur in kernels) - min(start for _, start, _ in kernels)) / 1e6


def gaps(kernels: list[tuple[str, float, float]]) -> dict:
    """The device's idle time between its first and last kernel, by GAP_BINS, and the kernels that the
    longer gaps (≥ 5 µs) came before: where the device waited for the host."""
    bins = {f"{lo}-{hi} us": [0, 0.0] for lo, hi in GAP_BINS}
    before: dict[str, list] = defaultdict(lambda: [0, 0.0])
    end = None
    for name, start, dur in sorted(kernels, key=lambda k: k[1]):
        if end is not None and start > end:
            idle = start - end
            lo, hi = next(b for b in GAP_BINS if b[0] <= idle < b[1])
            bins[f"{lo}-{hi} us"][0] += 1
            bins[f"{lo}-{hi} us"][1] += idle / 1e6
            if idle >= 5:
                before[name][0] += 1
                before[name][1] += idle / 1e6
        end = max(end or 0.0, start + dur)
    return {
        "span_s": span_seconds(kernels),
        "bins": {k: {"count": c, "seconds": s} for k, (c, s) in bins.items()},
        "before": sorted(
            ({"kernel": k, "count": c, "seconds": s} for k, (c, s) in before.items()),
            key=lambda r: -r["seconds"],
        )[:15],
    }


def gap_table(g: dict) -> str:
    idle = sum(b["seconds"] for b in g["bins"].values())
    lines = [
        f"The device idle {idle:.4f} s of the {g['span_s']:.3f} s from its first kernel to its last:",
        "",
        "| idle stretch | count | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {b['count']} | {b['seconds']:.4f} |" for k, b in g["bins"].items()]
    lines += ["", "| kernel after an idle stretch ≥ 5 us | count | seconds idle before it |", "|---|---|---|"]
    lines += [f"| `{r['kernel'][:90]}` | {r['count']} | {r['seconds']:.4f} |" for r in g["before"]]
    return "\n".join(lines)


def summarize(kernels: list[tuple[str, float, float]], wall_s: float) -> dict:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, _, dur in kernels:
        by_name[name][0] += 1
        by_name[name][1] += dur / 1e6
    classes: dict[str, float] = defaultdict(float)
    for name, (_, seconds) in by_name.items():
        classes[kernel_class(name)] += seconds
    busy = sum(classes.values())
    return {
        "wall_s": wall_s,
        "kernel_s": busy,
        "busy_share": busy / wall_s,
        "gaps": gaps(kernels),
        "classes": {k: {"seconds": v, "share_of_kernels": v / busy} for k, v in classes.items()},
        "kernels": sorted(
            (
                {"name": n, "class": kernel_class(n), "calls": c, "seconds": s}
                for n, (c, s) in by_name.items()
            ),
            key=lambda k: -k["seconds"],
        ),
    }


def table(summary: dict, label: str) -> str:
    lines = [
        f"{label}: the calls' wall {summary['wall_s']:.3f} s, kernels {summary['kernel_s']:.3f} s "
        f"(device busy {summary['busy_share']:.0%} of the wall)",
        "",
        "| class | seconds | share of kernel time |",
        "|---|---|---|",
    ]
    for name, row in sorted(summary["classes"].items(), key=lambda kv: -kv[1]["seconds"]):
        lines.append(f"| {name} | {row['seconds']:.4f} | {row['share_of_kernels']:.1%} |")
    lines += ["", "| the 12 longest kernels | class | calls | seconds |", "|---|---|---|---|"]
    for k in summary["kernels"][:12]:
        lines.append(f"| `{k['name'][:90]}` | {k['class']} | {k['calls']} | {k['seconds']:.4f} |")
    return "\n".join(lines) + "\n\n" + gap_table(summary["gaps"])


def main() -> None:
    args = engine_args(__doc__, lambda p: p.add_argument("--from", dest="source", help=argparse.SUPPRESS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.source:  # the scope table again, from a run's files
        source = Path(args.source)
        kernels = json.loads((source / "pass_profile.json").read_text())["kernels"]
        files = sorted(source.glob("hlo-*.txt.gz"), key=lambda f: -int(f.name.split("-")[1].split(".")[0]))
        print(scope_table(by_scope(kernels, [gzip.decompress(f.read_bytes()).decode() for f in files])))
        return
    engine, request = warm_seed_engine(args)  # the traced calls score contents only
    engine.score(request)
    trace_dir = Path(tempfile.mkdtemp())  # the raw trace is large: only the summary is kept
    with jax.profiler.trace(str(trace_dir)):
        start = time.perf_counter()
        for _ in range(args.repeats):
            engine.score(request)
        wall = time.perf_counter() - start
    kernels = device_kernels(trace_dir)
    if not kernels:
        raise SystemExit("no GPU kernels in the trace: this profiles a GPU run (JAX_PLATFORMS=cuda)")
    summary = summarize(kernels, wall) | {"copies": copies_by_neighbour(kernels)}
    summary |= {"device": jax.devices()[0].device_kind, "buckets": list(engine.buckets.sizes),
                "precision": args.precision, "repeats": args.repeats}  # fmt: skip
    text = table(summary, f"seed job × {args.repeats}, Gemma 3 12B shape, {args.precision}, random weights")
    sizes = sorted(engine.buckets.sizes, reverse=True)
    hlos = [engine.program(size).as_text() for size in sizes]
    for size, hlo in zip(sizes, hlos, strict=True):
        (out / f"hlo-{size}.txt.gz").write_bytes(gzip.compress(hlo.encode()))
    summary["scopes"] = by_scope(summary["kernels"], hlos)
    text += "\n\n" + scope_table(summary["scopes"]) + "\n\n" + copies_table(summary["copies"])
    (out / "pass_profile.json").write_text(json.dumps(summary, indent=1))
    (out / "pass_profile.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
