"""Parity: score recorded prompts with our engine and compare with log-probabilities recorded from
Hugging Face transformers (PyTorch). References are produced by fixtures/record_references.py, never by us.

The prompts go through the program the server runs: the engine's bucketed pass (the largest of the
backend's default buckets), each prompt a tree read at every position, packed with the fixture's others.
"""

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spinf_jax.engine import Engine
from spinf_jax.loader import Model, load_model
from spinf_jax.packer import Buckets, default_sizes, read_trees

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "fixtures" / "manifest.json"


@dataclass
class ParityResult:
    name: str
    precision: str
    compared: int  # how many log-probabilities were compared
    max_abs: float
    mean_abs: float
    top1_agreement: float  # our argmax == the reference's top-1, over all positions
    tolerance: float | None  # bound on max |Δ| (None: the mean and top-1 bounds carry the check)
    mean_tolerance: float | None
    min_top1: float | None
    tokenizer_ok: bool | None  # our tokenizer reproduces the recorded token ids (None: no text prompts)
    bit_identical: bool | None  # passes > 1: every pass gave the same bits
    load_seconds: float

    @property
    def ok(self) -> bool:
        return (
            (self.tolerance is None or self.max_abs <= self.tolerance)
            and (self.mean_tolerance is None or self.mean_abs <= self.mean_tolerance)
            and (self.min_top1 is None or self.top1_agreement >= self.min_top1)
            and self.tokenizer_ok is not False
            and self.bit_identical is not False
        )

    def line(self) -> str:
        bounds = ", ".join(
            f"{what} ≤ {bound:g}"
            for what, bound in (("max", self.tolerance), ("mean", self.mean_tolerance))
            if bound is not None
        )
        extra = f" top1 {self.top1_agreement:.4f}" + (f" (≥ {self.min_top1})" if self.min_top1 else "")
        if self.tokenizer_ok is not None:
            extra += f" tokenizer {'ok' if self.tokenizer_ok else 'MISMATCH'}"
        if self.bit_identical is not None:
            extra += f" passes {'bit-identical' if self.bit_identical else 'DIFFER'}"
        return (
            f"{'PASS' if self.ok else 'FAIL'} {self.name} [{self.precision}] {self.compared} log-probs: "
            f"max |Δ| {self.max_abs:.3g} mean |Δ| {self.mean_abs:.3g} ({bounds}){extra} "
            f"load {self.load_seconds:.1f}s"
        )


def read_reference(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def score_reference(engine: Engine, prompts: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Our log-probs of every recorded (position, token) pair and our argmax at every position, from the
    engine's bucketed passes (the program the server runs): each prompt is a tree of trunk only, read at
    every position, split over several trees where its reads overflow the largest bucket."""
    trees = []
    for p in prompts:
        ids, top = p["token_ids"], p["top_ids"]
        # Per position: the next token (the top-1 at the end), then the recorded top-k.
        wanted = {t: [ids[t + 1] if t + 1 < len(ids) else top[t][0], *top[t]] for t in range(len(ids))}
        trees += read_trees(ids, wanted, engine.buckets)
    scored = engine.score_trees(trees)
    logprobs = [s.option_logprobs(i) for s in scored for i in range(len(s.tree.read_rows))]
    return np.asarray(logprobs, np.float32), np.concatenate([s.top_tokens for s in scored])


def compare(
    model: Model,
    ref: dict,
    *,
    tolerance: float | None,
    mean_tolerance: float | None,
    min_top1: float | None,
    passes: int,
    name: str,
) -> ParityResult:
    prompts = ref["prompts"]
    tokenizer_ok = None
    if model.tokenizer is not None and any(p.get("text") is not None for p in prompts):
        tok = model.tokenizer
        tokenizer_ok = all(
            tok.prefix() + tok.encode(p["text"]) == p["token_ids"]
            for p in prompts
            if p.get("text") is not None
        )
    # The largest of the buckets the server runs on this backend: every bucket gives the same bits (the
    # invariance tests), and one program compiles faster than several.
    engine = Engine(model, Buckets(default_sizes()[-1:]))
    ours, argmax = score_reference(engine, prompts)
    bit_identical = None
    if passes > 1:
        bit_identical = all(
            np.array_equal(ours, again) and np.array_equal(argmax, top)
            for again, top in (score_reference(engine, prompts) for _ in range(passes - 1))
        )
    # The same layout as score_reference: per position, [next token (or top-1 at the end), top-5...].
    recorded, ref_top1, has_next = [], [], []
    for p in prompts:
        n = len(p["token_ids"])
        for t in range(n):
            nxt = [p["logprobs"][t]] if t + 1 < n else [p["top_logprobs"][t][0]]
            recorded.append(nxt + list(p["top_logprobs"][t]))
            ref_top1.append(p["top_ids"][t][0])
            has_next.append(t + 1 < n)
    recorded = np.asarray(recorded, np.float64)
    diff = np.abs(ours.astype(np.float64) - recorded)
    return ParityResult(
        name=name,
        precision=model.precision.value,
        compared=int(diff.size),
        max_abs=float(diff.max()),
        mean_abs=float(diff.mean()),
        top1_agreement=float(np.mean(argmax == np.asarray(ref_top1))),
        tolerance=tolerance,
        mean_tolerance=mean_tolerance,
        min_top1=min_top1,
        tokenizer_ok=tokenizer_ok,
        bit_identical=bit_identical,
        load_seconds=model.load_seconds,
    )


def run(
    fixture: str,
    reference: Path,
    *,
    precision: str = "fp32",
    tolerance: float | None = 1e-4,
    mean_tolerance: float | None = None,
    min_top1: float | None = None,
    passes: int = 1,
    name: str | None = None,
    model: Model | None = None,
) -> ParityResult:
    ref = read_reference(Path(reference))
    model = model or load_model(fixture, precision)
    return compare(
        model,
        ref,
        tolerance=tolerance,
        mean_tolerance=mean_tolerance,
        min_top1=min_top1,
        passes=passes,
        name=name or ref.get("name", fixture),
    )


def manifest(path: Path = MANIFEST) -> list[dict]:
    return json.loads(Path(path).read_text())["fixtures"]


def run_all(passes: int = 1, path: Path = MANIFEST, only: str | None = None, name: str | None = None):
    """Every manifest entry (or those whose name contains `only`, or the one called `name`); models shared
    between entries of the same (model, precision) load once."""
    loaded: dict[tuple[str, str], Model] = {}
    for entry in manifest(path):
        if (only and only not in entry["name"]) or (name and name != entry["name"]):
            continue
        key = (entry["model"], entry["precision"])
        model = loaded.get(key) or load_model(_repo_path(entry["model"]), entry["precision"])
        loaded = {key: model}  # keep only the current model resident
        yield run(
            entry["model"],
            REPO / entry["reference"],
            precision=entry["precision"],
            tolerance=entry.get("tolerance"),
            mean_tolerance=entry.get("mean_tolerance"),
            min_top1=entry.get("min_top1"),
            passes=passes,
            name=entry["name"],
            model=model,
        )


def _repo_path(spec: str) -> str:
    """Manifest model specs are built-in names or paths relative to the repository."""
    return str(REPO / spec) if (REPO / spec).exists() else spec
