"""`spinf-jax quantize`: a checkpoint in the engine's stored form (spinf_jax.quantized), ready to publish.

Into one folder it writes:
- the weights exactly as the loader makes them at fp8 or int8. They come from `loader.stored_weights`, the
  loader's own path, so loading the folder gives the bits quantizing the source at load gives (the parity
  report checks it). One tensor is made at a time and they go out in shards of at most `shard_bytes` (a
  larger tensor gets a shard of its own): host memory holds one shard, never the whole model;
- config.json: the source's, plus its `quantization_config`;
- the tokenizer: the source folder's files, or for a GGUF file the tokenizer the engine builds from it;
- parity.json and parity.md: the written folder's scores against quantizing the source at load (they must be
  bit-identical, else the command fails) and against the source's fp32 load (the drift), on PROMPTS;
- README.md: the model card.
"""

import datetime
import gc
import itertools
import json
import os
import re
import shutil
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from spinf_jax import parity
from spinf_jax.checkpoint import GGUFFile
from spinf_jax.loader import checkpoint_digest, load_model, open_checkpoint, resolve, stored_weights
from spinf_jax.models import abstract_decoder
from spinf_jax.models.params import Kind, nbytes, params, per_source, sources
from spinf_jax.quant import Precision, QuantArray
from spinf_jax.quantized import SCALE_SUFFIX, quantization_config
from spinf_jax.tokenizer import Tokenizer

SHARD_BYTES = 2 * 10**9
INDEX = "model.safetensors.index.json"
# A Hugging Face folder's files, besides weights and config.json, that its tokenizer and chat template need.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)

# The parity report's prompts: a few kinds of text a scoring request holds, and (for a model with a chat
# template) a chat turn as the engine renders it. Models without a tokenizer get fixed random token ids.
PROMPTS = (
    "The capital of France is Paris, and the capital of Italy is",
    "I bought these headphones last month. The sound is clear, but the left ear cup cracked after two weeks "
    "and support never answered my emails. Overall I would rate them",
    "Heavy rain closed three mountain roads on Tuesday; officials expect the river to peak overnight and to "
    "fall slowly through the weekend.",
    "Question: Is a tomato a fruit or a vegetable?\nAnswer:",
    "def mean(values):\n    return sum(values) / len(values)\n\n\nprint(mean([1, 2, 3]))",
    "Der schnelle braune Fuchs springt über den faulen Hund. Le renard brun saute par-dessus le chien.",
    "Hello, my order 55120 was marked as delivered yesterday, but nothing arrived and the tracking page now "
    "shows an error. I have been a customer for six years and this is the second time it has happened. "
    "Could you refund the order or send it again by Friday? It is a birthday present.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light and reflects green, "
    "which is why leaves look green to us.",
)
CHAT = "Is this message spam? 'Congratulations, you won a prize! Click here to claim it.' Answer yes or no."


def quantize(spec: str, precision: Precision | str, out: Path, *, shard_bytes: int = SHARD_BYTES,
             measure: bool = True, command: str | None = None) -> dict:  # fmt: skip
    """Write the checkpoint `spec` at `precision` into the folder `out` (new or empty), with its model card
    and (unless measure=False) its parity report. Returns the report (parity.json's content)."""
    precision, out = Precision(precision), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    path = resolve(spec)
    checkpoint = open_checkpoint(path)
    decoder = abstract_decoder(checkpoint.config, precision)
    config = dict(checkpoint.config) | {"quantization_config": quantization_config(decoder)}
    written = write_weights(decoder, checkpoint, out, shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(checkpoint, out)
    report = {
        "source": spec,
        "source_digest": checkpoint_digest(path),
        "precision": precision.value,
        "command": command or f"spinf-jax quantize {spec} --precision {precision.value} --out {out}",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "spinf_jax": version("spinf-jax"),
        },
        "weights_bytes": written,
    }
    if measure:
        report |= measure_parity(spec, out, precision)
        (out / "parity.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "parity.md").write_text(parity_markdown(report))
    (out / "README.md").write_text(model_card(report, checkpoint, decoder, checkpoint_digest(out)))
    return report


def _shards(decoder, shard_bytes: int) -> list[int]:
    """Each checkpoint tensor's shard, in the order of `_tensors`: a shard ends where the next tensor would
    take it past shard_bytes."""
    plan, shard, used = [], 0, 0
    for param in params(decoder):
        for _, value in per_source(param, param.get_value()):
            size = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(value))
            if used and used + size > shard_bytes:
                shard, used = shard + 1, 0
            plan.append(shard)
            used += size
    return plan


def _tensors(decoder, checkpoint):
    """(name, stored value) of each checkpoint tensor, a layer of a stacked Param at a time."""
    for param, stacked in stored_weights(decoder, checkpoint):
        yield from per_source(param, stacked)


def write_weights(decoder, checkpoint, out: Path, shard_bytes: int = SHARD_BYTES) -> int:
    """The decoder's weights in their stored form, as safetensors shards (+ the index when there are several).
    Returns the bytes of tensor data written."""
    plan = _shards(decoder, shard_bytes)
    count = plan[-1] + 1
    names = [
        "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        for i in range(count)
    ]
    weight_map, total = {}, 0
    made = zip(plan, _tensors(decoder, checkpoint), strict=True)
    for shard, group in itertools.groupby(made, key=lambda item: item[0]):
        tensors = {}
        for _, (source, value) in group:
            quantized = isinstance(value, QuantArray)
            keys = [source, source + SCALE_SUFFIX] if quantized else [source]
            for key, array in zip(keys, jax.tree.leaves(value), strict=True):
                tensors[key] = np.asarray(array)
                total += tensors[key].nbytes
        save_file(tensors, out / names[shard])
        weight_map |= dict.fromkeys(tensors, names[shard])
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_tokenizer(checkpoint, out: Path) -> None:
    if isinstance(checkpoint, GGUFFile):
        Tokenizer.from_gguf(checkpoint).save(out)
        return
    for name in TOKENIZER_FILES:
        if (checkpoint.folder / name).exists():
            shutil.copy(checkpoint.folder / name, out / name)


def _prompts(model) -> tuple[list[list[int]], list[str | None]]:
    tok = model.tokenizer
    if tok is None:  # checkpoints without a tokenizer (the tiny test models) are scored from token ids
        rng = np.random.default_rng(0)
        lengths = (17, 40, 100)
        return [rng.integers(3, model.config.vocab_size, n).tolist() for n in lengths], [None] * len(lengths)
    texts = list(PROMPTS)
    if tok.chat_template is not None:
        texts.append(tok.render_chat([{"role": "user", "content": CHAT}]))
    return [tok.prefix() + tok.encode(text) for text in texts], texts


def measure_parity(spec: str, out: Path, precision: Precision) -> dict:
    """The written folder against quantizing the source at load (bit for bit) and against the source's fp32
    load (the drift), every score from the engine's bucketed pass (spinf_jax.parity). One model is resident at
    a time."""
    fp32 = load_model(spec, Precision.FP32)
    reference = parity.own_reference(fp32, *_prompts(fp32))
    seconds = {"fp32": fp32.load_seconds}
    # A Model's compiled functions refer back to it (a cycle): collect it now, not whenever gc next runs.
    del fp32
    gc.collect()
    scores = {}
    for name, where in (("quantized_at_load", spec), ("written", str(out))):
        model = load_model(where, precision)
        scores[name] = parity.score_reference(parity.reference_engine(model), reference["prompts"])
        seconds[name] = model.load_seconds
        del model
        gc.collect()
    (at_load, at_load_top), (written, written_top) = scores["quantized_at_load"], scores["written"]
    compared, max_abs, mean_abs, top1 = parity.drift(written, written_top, reference["prompts"])
    return {
        "prompts": len(reference["prompts"]),
        "tokens": sum(len(p["token_ids"]) for p in reference["prompts"]),
        "compared": compared,
        "written_vs_quantized_at_load": {
            "bit_identical": bool(
                np.array_equal(written, at_load) and np.array_equal(written_top, at_load_top)
            ),
            "max_abs": float(np.max(np.abs(written.astype(np.float64) - at_load))),
        },
        "vs_fp32": {"max_abs": max_abs, "mean_abs": mean_abs, "top1_agreement": top1},
        "load_seconds": seconds,
    }


def parity_markdown(report: dict) -> str:
    same, drift, m = report["written_vs_quantized_at_load"], report["vs_fp32"], report["machine"]
    return f"""# Parity: {report["source"]} at {report["precision"]}

`{report["command"]}`
{report["date"]}, jax {m["jax"]} on {m["backend"]} ({m["device"]}, {m["cpus"]} CPUs),
spinf-jax {m["spinf_jax"]}.

{report["prompts"]} fixed prompts ({report["tokens"]} tokens, `spinf_jax.export.PROMPTS`), each scored at
every position through the engine's bucketed pass: the actual next token and the fp32 model's 5 most likely
tokens there, {report["compared"]:,} log-probabilities. Top-1 agreement: the share of positions where this
folder's most likely next token is the fp32 model's.

| this folder against | max abs diff | mean abs diff | top-1 agreement |
|---|---|---|---|
| the source quantized at load | {same["max_abs"]:.3g} | {_identical(same)} | |
| the source at fp32 | {drift["max_abs"]:.3g} | {drift["mean_abs"]:.3g} | {drift["top1_agreement"]:.3f} |
"""


def _identical(same: dict) -> str:
    return "bit-identical" if same["bit_identical"] else "**NOT bit-identical**"


def _grouped(names: list[str]) -> str:
    """Tensor names with the layer index replaced by *, and how many layers have each."""
    counts = Counter(re.sub(r"layers\.\d+\.", "layers.*.", n) for n in names)
    return ", ".join(f"`{name}`" + (f" ×{n}" if n > 1 else "") for name, n in counts.items())


def _source(checkpoint) -> str:
    if not isinstance(checkpoint, GGUFFile):
        return "a safetensors folder"
    types = ", ".join(
        f"{t} ×{n}" for t, n in Counter(q.name for q, _, _ in checkpoint.tensors.values()).items()
    )
    return (
        f"a GGUF file (`{checkpoint.path.name}`, tensor types {types}). Its weights are dequantized to f32 "
        "and quantized again, so the fp32 model compared against is the dequantized GGUF, not the original"
    )


def model_card(report: dict, checkpoint, decoder, digest: str) -> str:
    p = Precision(report["precision"])
    fp8 = p is Precision.FP8
    by_kind = {kind: [n for w in params(decoder) if w.kind is kind for n in sources(w)] for kind in Kind}
    stored = (
        f"{'float8_e4m3fn' if fp8 else 'int8'} [out, in] + `weight_scale` f32 [out]: absmax of the row / "
    )
    stored += "448" if fp8 else "127"
    activations = (
        "fp8 e4m3, quantized at run time with one scale per token (the absmax of its row): a token's result "
        "never depends on what shares its batch"
        if fp8
        else "bf16: weights only (the int8 values are widened to bf16 in the matmul), for GPUs without fp8"
    )
    sizes = {q: nbytes(abstract_decoder(checkpoint.config, q)) for q in (Precision.FP32, Precision.BF16)}
    measured = "Not measured (`--no-parity`)."
    if "vs_fp32" in report:
        same, drift, m = report["written_vs_quantized_at_load"], report["vs_fp32"], report["machine"]
        measured = f"""On {report["prompts"]} fixed prompts ({report["compared"]:,} log-probabilities;
parity.md and parity.json), measured {report["date"]} on {m["backend"]} ({m["device"]}, {m["cpus"]} CPUs):
- this folder against the source quantized at load: {_identical(same)} (max |Δ| {same["max_abs"]:.3g});
- against the source at fp32: max |Δ log-prob| {drift["max_abs"]:.3g}, mean {drift["mean_abs"]:.3g}, top-1
  agreement {drift["top1_agreement"]:.3f}."""
    norms = "norms and biases" if by_kind[Kind.BIAS] else "norms"
    routers = (
        f"\n| experts' routers | bf16 | {_grouped(by_kind[Kind.ROUTER])} |" if by_kind[Kind.ROUTER] else ""
    )
    towers = ""
    if "text_config" in checkpoint.config:
        towers = (
            "\n- A multimodal source: only its text decoder's weights are here (no vision or audio tower); "
            "config.json\n  keeps the source's whole configuration."
        )
    return f"""# {report["source"]}, {p.value}

The weights of `{report["source"]}` in the form spinf-jax keeps them at {p.value}, written by
`spinf-jax quantize` (spinf-jax {report["machine"]["spinf_jax"]}, {report["date"]}). Loading this folder
quantizes nothing: the engine puts the stored values and scales in place, and scores as it does when it
quantizes the source at load.

- Source: `{report["source"]}`, {_source(checkpoint)}.
- Source digest (sha256 over its files, `spinf_jax.loader.checkpoint_digest`): `{report["source_digest"]}`
- This folder's digest (weights, config, tokenizer, parity.json): `{digest}`
- Recipe: `{report["command"]}`
- Use: `spinf-jax serve PATH --precision {p.value}` or `Engine.load(PATH, "{p.value}")`, at {p.value} only:
  the folder holds no full-precision weights, and loading it at another precision is an error.{towers}

## What is quantized how

| weights | stored as | tensors |
|---|---|---|
| linear projections | {stored} | {_grouped(by_kind[Kind.LINEAR])} |
| embedding tables (the LM head too) | bf16 | {_grouped(by_kind[Kind.EMBED])} |{routers}
| {norms} | f32 | {_grouped(by_kind[Kind.NORM] + by_kind[Kind.BIAS])} |

Activations: {activations}.

Why the rest is kept wider: the embedding doubles as the LM head, which runs only at the few positions a
score reads, so bf16 costs little time there, while 8-bit rows would move every logit by several percent.
Norm scales and biases are tiny and precision-sensitive.

Calibration data: none. Weight scales are each output channel's absmax, from the weight alone; activation
scales {"are computed per token at run time (dynamic)" if fp8 else "do not exist (bf16 activations)"}.

## Size

{report["weights_bytes"]:,} bytes of tensor data; the same weights take {sizes[Precision.BF16]:,} bytes in
bf16 and {sizes[Precision.FP32]:,} in fp32.

## Parity

{measured}

## Format

The Hugging Face layout: config.json with a `quantization_config`, `model.safetensors` (or shards and
`{INDEX}`), the tokenizer files. float8 tensors are safetensors `F8_E4M3`. `quant_method` is `spinf-jax`:
the other keys borrow compressed-tensors' names where they mean the same (`config_groups`, `weights`,
`input_activations`, `ignore`), but no other engine has been checked to read this folder, and the scales
are stored [out], not [out, 1].
"""
