"""`spinf-jax quantize` at Gemma 3 12B's shape on a GPU (random weights): how long writing the fp8 checkpoint
takes, how much host memory it holds while it does, and that the written folder scores bit for bit as
quantizing the source at load. One script, one run; prints a table, ends with one JSON line.

The source is a bf16 safetensors folder at the 12B text shape (GEMMA3_12B), written here first with made-up
values in 2 GB shards, as a Hub checkpoint would be. Then `spinf-jax quantize --no-parity` writes it at fp8 in
a process of its own, and the report's function (export.measure_parity) loads the source at fp32, the source
at fp8 (quantized at load) and the written folder, scoring the same prompts with each (random token ids: the
folder has no tokenizer). Random weights make the drift against fp32 meaningless as accuracy; the bits, the
times and the memory do not depend on the values.

    python3 benchmarks/gpu_quantize.py --work /tmp/quantize --out $OUT
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from common import GEMMA3_12B
from safetensors.numpy import save_file

from spinf_jax import export
from spinf_jax.models import abstract_decoder
from spinf_jax.models.params import params, per_source
from spinf_jax.quant import Precision


def save(result: dict, out: Path) -> None:
    """Written after every step, so a run cut short still leaves what it measured."""
    (out / "gpu_quantize.json").write_text(json.dumps(result, indent=2) + "\n")


def watched(command: list[str]) -> dict:
    """Run a command, sampling its resident memory every 0.2 s: the largest anonymous (heap) and file-backed
    (mapped files) parts, in GiB, which ru_maxrss alone does not tell apart."""
    child = subprocess.Popen(command)
    peaks = {"RssAnon": 0, "RssFile": 0}
    while child.poll() is None:
        try:
            for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in peaks:
                    peaks[key] = max(peaks[key], int(value.split()[0]))  # kB
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.2)
    if child.wait() != 0:
        raise RuntimeError(f"{command} exited {child.returncode}")
    return {f"quantize_peak_{k}_gib": round(v / 2**20, 2) for k, v in peaks.items()}


def write_source(folder: Path, shard_bytes: int = 2 * 10**9) -> int:
    """A bf16 folder at the 12B shape, tensor by tensor into shards; returns its bytes."""
    folder.mkdir(parents=True)
    decoder = abstract_decoder(GEMMA3_12B, Precision.BF16)
    pattern = (np.random.default_rng(0).standard_normal(1 << 22) * 0.02).astype(np.float32)
    shards, shard, used, total = [], {}, 0, 0
    for param in params(decoder):
        for source, value in per_source(param, param.get_value()):
            w = np.resize(pattern, value.shape).astype(ml_dtypes.bfloat16)
            if used and used + w.nbytes > shard_bytes:
                shards.append(shard)
                shard, used = {}, 0
            shard[source] = w
            used += w.nbytes
            total += w.nbytes
    shards.append(shard)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, folder / name)
        weight_map |= dict.fromkeys(tensors, name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(GEMMA3_12B))
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default="/tmp/quantize", help="scratch folder (needs ~40 GB)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-parity", action="store_true", help="stop after the quantize command")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": "gemma-3-12b text"}

    start = time.perf_counter()
    result["source_bytes"] = write_source(work / "source")
    result["write_source_s"] = round(time.perf_counter() - start, 1)

    save(result, out)
    # The command itself, without its report, in a process of its own: its time, and the most host memory it
    # held (the model is 23.5 GB in bf16; the writer should hold about one 2 GB shard).
    start = time.perf_counter()
    command = [sys.executable, "-m", "spinf_jax.cli", "quantize", str(work / "source"), "--precision", "fp8",
               "--out", str(work / "fp8"), "--no-parity"]  # fmt: skip
    result |= watched(command)
    result["quantize_write_s"] = round(time.perf_counter() - start, 1)
    result["quantize_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)
    files = sorted((work / "fp8").glob("*.safetensors"))
    result["written_files"] = len(files)
    result["written_bytes"] = sum(f.stat().st_size for f in files)

    save(result, out)
    if args.skip_parity:
        return
    start = time.perf_counter()
    report = export.measure_parity(str(work / "source"), work / "fp8", Precision.FP8)
    result["parity_s"] = round(time.perf_counter() - start, 1)
    result["parity"] = report

    save(result, out)
    same = report["written_vs_quantized_at_load"]["bit_identical"]
    loads = report["load_seconds"]
    print("| what | value |\n|---|---|")
    rows = [
        ("source (bf16, random)", f"{result['source_bytes'] / 1e9:.2f} GB in {result['write_source_s']} s"),
        ("spinf-jax quantize --precision fp8 (no report)", f"{result['quantize_write_s']} s"),
        ("written", f"{result['written_bytes'] / 1e9:.2f} GB in {result['written_files']} files"),
        ("peak host RSS of the quantize process: all / heap / mapped files",
         f"{result['quantize_peak_rss_gib']} / {result['quantize_peak_RssAnon_gib']} / "
         f"{result['quantize_peak_RssFile_gib']} GiB"),
        ("load s: fp32 source / fp8 at load / written fp8",
         f"{loads['fp32']:.1f} / {loads['quantized_at_load']:.1f} / {loads['written']:.1f}"),
        ("written = quantized at load, bit for bit", str(same)),
    ]  # fmt: skip
    for what, value in rows:
        print(f"| {what} | {value} |")
    print(json.dumps(result))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
