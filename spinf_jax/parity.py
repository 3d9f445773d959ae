"""Parity: score recorded prompts with our engine and compare with log-probabilities recorded from
Hugging Face transformers (PyTorch). References are produced by fixtures/record_references.py, never by us.

The prompts go through the program the server runs: the engine's bucketed pass (the largest of the
backend's default buckets), each prompt a tree read at every position, packed with the fixture's others.

Extraction parity decodes recorded prompts at an extraction slot (spinf_jax.extraction) and compares with
transformers' greedy and beam-search continuations of them (`extraction_run`).
"""

import gzip
import json
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from spinf_jax import audio, media
from spinf_jax.engine import Engine
from spinf_jax.layout import Extract, QuestionKey, build_tree
from spinf_jax.loader import Model, load_model
from spinf_jax.models.layers import TreeBatch
from spinf_jax.packer import Buckets, default_sizes, read_trees

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "fixtures" / "manifest.json"
MEDIA = REPO / "fixtures" / "media"  # the images the references' prompts hold


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
        trees += read_trees(ids, wanted, engine.buckets, _media(engine, p))
    scored = engine.score_trees(trees)
    logprobs = [s.option_logprobs(i) for s in scored for i in range(len(s.tree.read_rows))]
    return np.asarray(logprobs, np.float32), np.concatenate([s.top_tokens for s in scored])


def _media(engine: Engine, prompt: dict) -> tuple:
    """A recorded prompt's media (files in fixtures/media, named in order: its "images", its "audio" clips,
    or its "video" frames) as read_tree takes them: each at the row after its start token."""
    model = engine.model
    kind = next((k for k in ("images", "audio", "video") if prompt.get(k)), None)
    if kind is None:
        return ()
    start = model.audio_format.start_id if kind == "audio" else model.image_format.start_id
    rows = [i + 1 for i, token in enumerate(prompt["token_ids"]) if token == start]
    entries = []
    for row, name in zip(rows, prompt[kind], strict=True):
        data = (MEDIA / name).read_bytes()
        if kind == "images":
            entries.append((row, engine.image_tokens(media.digest(data), data, name)))
        elif kind == "video":
            frames = model.image_format.frames()
            entries.append((row, engine.image_tokens(media.digest(data), data, name, frames), "video"))
        else:
            samples = audio.read(data, Path(name).suffix[1:], name, model.audio_format.features)
            entries.append((row, engine.audio_tokens(media.digest(data), samples), "audio"))
    return tuple(entries)


def reference_buckets(row_tile: int | None = None) -> Buckets:
    """The buckets parity scores in: the server's sizes on this backend (those that hold whole row tiles of
    the model's, Buckets.check_row_tile), each able to read every row it holds with score_reference's six
    targets a row. At the server's capacities (a read per four rows, a target a row) a recorded prompt's
    reads would spread over several passes of mostly idle rows; a row's bits do not depend on the capacities
    (reads run in chunks of one shape; the invariance tests)."""
    sizes = tuple(s for s in default_sizes() if Buckets.holds_row_tiles(s, row_tile))
    return Buckets(sizes, read_every=1, targets_per_row=6)


def reference_engine(model: Model) -> Engine:
    """The engine parity scores with (reference_buckets): a fixture's prompts pack into as few passes as their
    tokens need, each in the smallest bucket that holds it."""
    return Engine(model, reference_buckets(model.row_tile))


def drift(ours: np.ndarray, argmax: np.ndarray, prompts: list[dict]) -> tuple[int, float, float, float]:
    """Our scores (score_reference's) against a reference's: (values compared, max |Δ|, mean |Δ|, share of
    positions where our argmax is the reference's top-1)."""
    # The same layout as score_reference: per position, [next token (or top-1 at the end), top-5...].
    recorded, ref_top1 = [], []
    for p in prompts:
        n = len(p["token_ids"])
        for t in range(n):
            nxt = [p["logprobs"][t]] if t + 1 < n else [p["top_logprobs"][t][0]]
            recorded.append(nxt + list(p["top_logprobs"][t]))
            ref_top1.append(p["top_ids"][t][0])
    diff = np.abs(ours.astype(np.float64) - np.asarray(recorded, np.float64))
    return (
        int(diff.size),
        float(diff.max()),
        float(diff.mean()),
        float(np.mean(argmax == np.asarray(ref_top1))),
    )


def own_reference(model: Model, token_ids: list[list[int]], texts: list[str | None], k: int = 5) -> dict:
    """A reference in fixtures/record_references.py's format recorded from one of our own models (the fp32
    load of a checkpoint), to measure other precisions of that checkpoint against. Which tokens it holds at
    each position (the k most likely) comes from a plain forward; every value comes from the engine's
    bucketed pass, as the compared scores do."""
    prompts = []
    # Every prompt in a pass of the same rows (one program), a whole number of the model's row tiles (1,024
    # on a GPU), its padding a chain of its own that the mask keeps apart.
    tile = math.lcm(128, model.row_tile or 128)
    rows = -(-max(map(len, token_ids)) // tile) * tile
    for ids, text in zip(token_ids, texts, strict=True):
        batch, _ = TreeBatch.chains([list(ids), [0] * (rows - len(ids))] if rows > len(ids) else [list(ids)])
        logits = model.logits(model.hidden(batch))[: len(ids)]
        top = np.asarray(jax.lax.top_k(logits, k)[1]).tolist()
        prompts.append({"text": text, "token_ids": list(ids), "top_ids": top})
    values, _ = score_reference(reference_engine(model), prompts)
    start = 0
    for p in prompts:
        rows = values[start : start + len(p["token_ids"])]
        start += len(p["token_ids"])
        p["logprobs"] = rows[:-1, 0].tolist()  # the next token's, at every position but the last
        p["top_logprobs"] = rows[:, 1:].tolist()
    return {"name": f"{model.name} [{model.precision.value}]", "prompts": prompts}


def compare(
    engine: Engine,
    ref: dict,
    *,
    tolerance: float | None,
    mean_tolerance: float | None,
    min_top1: float | None,
    passes: int,
    name: str,
) -> ParityResult:
    prompts, model = ref["prompts"], engine.model
    tokenizer_ok = None
    if model.tokenizer is not None and any(p.get("text") is not None for p in prompts):
        tok = model.tokenizer
        tokenizer_ok = all(
            tok.prefix() + tok.encode(p["text"]) == p["token_ids"]
            for p in prompts
            if p.get("text") is not None
        )
    ours, argmax = score_reference(engine, prompts)
    bit_identical = None
    if passes > 1:
        bit_identical = all(
            np.array_equal(ours, again) and np.array_equal(argmax, top)
            for again, top in (score_reference(engine, prompts) for _ in range(passes - 1))
        )
    compared, max_abs, mean_abs, top1 = drift(ours, argmax, prompts)
    return ParityResult(
        name=name,
        precision=model.precision.value,
        compared=compared,
        max_abs=max_abs,
        mean_abs=mean_abs,
        top1_agreement=top1,
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
) -> ParityResult:
    ref = read_reference(Path(reference))
    model = load_model(fixture, precision)
    return compare(
        reference_engine(model),
        ref,
        tolerance=tolerance,
        mean_tolerance=mean_tolerance,
        min_top1=min_top1,
        passes=passes,
        name=name or ref.get("name", fixture),
    )


def manifest(path: Path = MANIFEST, section: str = "fixtures") -> list[dict]:
    """The manifest's entries: "fixtures" (log-probs at every position) or "extraction" (decoded answers)."""
    return json.loads(Path(path).read_text())[section]


def run_all(passes: int = 1, path: Path = MANIFEST, only: str | None = None, name: str | None = None):
    """Every manifest entry, log-prob fixtures then extraction ones (or those whose name contains `only`, or
    the one called `name`); models shared between entries of the same (model, precision) load once."""
    loaded: dict[tuple[str, str], Model] = {}

    def model_of(entry: dict) -> Model:
        nonlocal loaded
        key = (entry["model"], entry["precision"])
        model = loaded.get(key) or load_model(model_spec(entry), entry["precision"])
        loaded = {key: model}  # keep only the current model resident
        return model

    def chosen(entry: dict) -> bool:
        return not ((only and only not in entry["name"]) or (name and name != entry["name"]))

    for section in ("fixtures", "extraction"):
        for entry in filter(chosen, manifest(path, section)):
            model = model_of(entry)
            engine = reference_engine(model) if section == "fixtures" else extraction_engine(model)
            yield run_entry(entry, engine, passes, section)


def run_entry(entry: dict, engine: Engine, passes: int = 1, section: str = "fixtures"):
    """One manifest entry of a section, scored by an engine on its model (load_model(model_spec(entry),
    entry["precision"])): a ParityResult, or an ExtractionParity for the extraction section. Any engine's
    buckets give the same bits (the invariance tests); the command uses reference_engine's and
    extraction_engine's."""
    reference = read_reference(REPO / entry["reference"])
    if section == "extraction":
        return extraction_compare(
            engine, reference, tolerance=entry["tolerance"], min_agree=entry["min_agree"], name=entry["name"]
        )
    return compare(
        engine,
        reference,
        tolerance=entry.get("tolerance"),
        mean_tolerance=entry.get("mean_tolerance"),
        min_top1=entry.get("min_top1"),
        passes=passes,
        name=entry["name"],
    )


def model_spec(entry: dict) -> str:
    """A manifest entry's model: a built-in name, or a path relative to the repository."""
    spec = entry["model"]
    return str(REPO / spec) if (REPO / spec).exists() else spec


# ---------------------------------------------------------------------------------------------------------
# Extraction


@dataclass
class ExtractionParity:
    name: str
    precision: str
    answers: int  # decoded answers compared with a recorded sequence
    max_abs_per_token: float  # max over those of |our log-prob - the reference's| / tokens
    greedy_tokens: int  # tokens of our generated answers compared with transformers' greedy continuation
    greedy_agree: float  # the share of them that are equal (the rest of a prompt counts once paths part)
    top_is_greedy: float  # prompts whose greedy continuation closes: share where our top answer is it
    tolerance: float  # bound on max_abs_per_token
    min_agree: float  # bound on greedy_agree and top_is_greedy
    tokenizer_ok: bool | None

    @property
    def ok(self) -> bool:
        return (
            self.max_abs_per_token <= self.tolerance
            and self.answers > 0
            and min(self.greedy_agree, self.top_is_greedy) >= self.min_agree
            and self.tokenizer_ok is not False
        )

    def line(self) -> str:
        tokenizer = (
            "" if self.tokenizer_ok is None else f" tokenizer {'ok' if self.tokenizer_ok else 'MISMATCH'}"
        )
        return (
            f"{'PASS' if self.ok else 'FAIL'} {self.name} [{self.precision}] extraction: {self.answers} "
            f"answers, max |Δ| per token {self.max_abs_per_token:.3g} (≤ {self.tolerance:g}); greedy tokens "
            f"{self.greedy_agree:.3f} of {self.greedy_tokens}, top answer = greedy {self.top_is_greedy:.3f} "
            f"(≥ {self.min_agree:g}){tokenizer}"
        )


def _recorded(prompt: dict) -> list[tuple[tuple[int, ...], list[float]]]:
    """The reference's sequences: greedy, then the beams (token ids, per-token log-probs)."""
    return [(tuple(s["ids"]), s["logprobs"]) for s in (prompt["greedy"], *prompt["beams"])]


def _reference_logprob(recorded, tokens: tuple[int, ...]) -> float | None:
    """The reference's log-prob of a token sequence that starts one of its recorded sequences, or None."""
    for ids, logprobs in recorded:
        if ids[: len(tokens)] == tokens:
            return float(np.sum(logprobs[: len(tokens)], dtype=np.float64))
    return None


def extraction_engine(model: Model) -> Engine:
    """The engine extraction parity decodes with: the smallest of the server's buckets on this backend."""
    return Engine(model, Buckets(default_sizes()[:1]))


def extraction_compare(
    engine: Engine, ref: dict, *, tolerance: float, min_agree: float, name: str
) -> ExtractionParity:
    """Decode every recorded prompt twice (a searched slot and a generated one) with the program the server
    runs, and compare:
    - our generated answer with transformers' greedy continuation, token by token up to the end of ours
      (and its closing text), as far as the reference goes;
    - every answer (searched or generated) that ends in a closing text or at its length bound, and that
      starts a recorded sequence, with the sum of that sequence's recorded log-probs. A {n} or {$} answer
      that ends where a non-number follows is left out of this: its end is a mass, not a token;
    - where the greedy continuation reaches the closing text, our most likely searched answer with it."""
    model, tok = engine.model, engine.model.tokenizer
    prompts = ref["prompts"]
    tokenizer_ok = None
    if tok is not None and any(p["content"] is not None for p in prompts):
        tokenizer_ok = all(
            tok.encode(p["content"]) == p["content_ids"] and tok.encode(p["template"]) == p["template_ids"]
            for p in prompts
        )
    trees = []
    for p in prompts:
        closing = tuple(tok.encode(p["closing"])) if p["closing"] else ()
        n, m = len(p["greedy"]["ids"]), len(p["beams"][0]["ids"])
        template = tuple(p["template_ids"])
        searched = Extract(p["kind"], closing, max_answers=8, max_tokens=m)
        generated = Extract(p["kind"], closing, max_tokens=n, generate=True)
        questions = [QuestionKey(template, extract=searched), QuestionKey(template, extract=generated)]
        trees.append(build_tree(p["prefix_ids"], p["content_ids"], questions))
    scored = engine.score_trees(trees)
    gaps, compared, agreed, tops = [], 0, 0, []
    for p, result in zip(prompts, scored, strict=True):
        recorded = _recorded(p)
        closing = tuple(tok.encode(p["closing"])) if p["closing"] else ()
        searched, [generated] = result.answers
        greedy = tuple(p["greedy"]["ids"])
        ours = (generated.tokens + closing)[: len(greedy)]
        same = next((i for i, (a, b) in enumerate(zip(ours, greedy, strict=False)) if a != b), len(ours))
        compared, agreed = compared + min(same + 1, len(ours)), agreed + same
        ends_in_a_token = bool(closing) or p["kind"] == "text"
        for answer, limit in [(a, len(p["beams"][0]["ids"])) for a in searched] + [(generated, len(greedy))]:
            at_bound = len(answer.tokens) == limit and not closing
            if not (ends_in_a_token or at_bound):
                continue
            full = answer.tokens + (closing if closing or at_bound else ())
            expected = _reference_logprob(recorded, full)
            if expected is not None:
                gaps.append(abs(answer.logprob - expected) / len(full))
        cut = greedy.index(closing[0]) if closing and closing[0] in greedy else -1
        if cut >= 0 and greedy[cut : cut + len(closing)] == closing:
            tops.append(bool(searched) and searched[0].tokens == greedy[:cut])
    return ExtractionParity(
        name=name,
        precision=model.precision.value,
        answers=len(gaps),
        max_abs_per_token=float(max(gaps, default=0.0)),
        greedy_tokens=compared,
        greedy_agree=agreed / max(compared, 1),
        top_is_greedy=float(np.mean(tops)) if tops else 1.0,
        tolerance=tolerance,
        min_agree=min_agree,
        tokenizer_ok=tokenizer_ok,
    )
