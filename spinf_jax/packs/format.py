"""The prompt-pack file (docs/prompt-packs.md): a job's questions, how the content is presented to them, how
their answers become calibrated scores, categories and a decision. One YAML or JSON file per pack, decoded
into `Pack`; packs/schema.json is this Struct's JSON Schema.

`read_pack` checks what the types cannot say (ids unique, cells naming questions, positive options among the
options, labels known) and raises PackError naming the file and the field. A question's template and options
are checked again, with the model's tokenizer, when the server compiles the pack (spinf_jax.packs.compiled).
"""

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from spinf_jax import api

PACK_ID = r"^[a-z0-9][a-z0-9_.-]*/[a-z0-9][a-z0-9_.-]*$"
SUFFIXES = (".yaml", ".yml", ".json")


class PackError(ValueError):
    """A pack that cannot be loaded: which file, which field, what is wrong."""

    def __init__(self, path, field: str, message: str):
        self.path, self.field = str(path), field
        super().__init__(f"{path}: {field}: {message}" if field else f"{path}: {message}")


class Baseline(Struct, kw_only=True, forbid_unknown_fields=True):
    """A question's value on normal traffic: mean and std (the score is a z-score), or percentiles (the
    score is the fraction of normal traffic below the value)."""

    mean: float | None = None
    std: Annotated[float, Meta(gt=0)] | None = None
    percentiles: (
        Annotated[
            list[float],
            Meta(
                min_length=2, description="ascending values at evenly spaced quantiles, from 0 to 1 inclusive"
            ),
        ]
        | None
    ) = None
    items: Annotated[int, Meta(ge=1, description="how many normal items these were measured on")] | None = (
        None
    )


class PackQuestion(api.Query, kw_only=True, forbid_unknown_fields=True):
    """An ordinary {?} query (SPEC section 1): a wording, and the options categories read as cells."""


class Cell(Struct, kw_only=True, forbid_unknown_fields=True):
    """One option of one question, read as evidence for a category."""

    question: str
    option: Annotated[str, Meta(description="the option whose probability the cell reads")]
    measure: Annotated[
        Literal["p", "lift", "log_lift"],
        Meta(
            description="p: the option's p; lift: p - floor_p (its p on empty content); log_lift: "
            "log p - log floor_p"
        ),
    ] = "log_lift"
    weight: Annotated[float, Meta(gt=0)] = 1.0
    baseline: Baseline | None = None


class Category(Struct, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1)]
    description: str = ""
    cells: Annotated[list[Cell], Meta(min_length=1)]
    combine: Annotated[
        Literal["mean", "max"],
        Meta(description="mean: the weighted mean of the cells' scores; max: the largest weighted score"),
    ] = "mean"


class Rule(Struct, kw_only=True, forbid_unknown_fields=True):
    """A category whose score reaches `at_least` gives `label`."""

    category: str
    at_least: float
    label: str
    precision: Annotated[float, Meta(ge=0, le=1)] | None = None  # what the threshold was chosen for
    recall: Annotated[float, Meta(ge=0, le=1)] | None = None


class Decision(Struct, kw_only=True, forbid_unknown_fields=True):
    labels: Annotated[
        list[str],
        Meta(min_length=1, description="from the mildest (the default, when no rule fires) to the gravest"),
    ]
    rules: list[Rule] = []


class Presentation(Struct, kw_only=True, forbid_unknown_fields=True):
    wrapper: Annotated[
        str,
        Meta(
            description="the text the questions read, with {content} where the content goes; the default "
            "{content} shares the read with the request's own questions, any other wrapper reads it apart"
        ),
    ] = "{content}"
    examples: Annotated[
        list[str], Meta(description="few-shot text put before the wrapped content (a read of its own)")
    ] = []

    @property
    def prefix(self) -> str:
        return "".join(self.examples) + self.wrapper.split("{content}")[0]

    @property
    def suffix(self) -> str:
        return self.wrapper.split("{content}")[1]

    @property
    def bare(self) -> bool:
        return not self.prefix and not self.suffix


class CalibratedOn(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    fingerprint: str | None = None
    precision: str | None = None


class CalibrationData(Struct, kw_only=True, forbid_unknown_fields=True):
    source: Annotated[str, Meta(description="the data's name and where it comes from, or 'synthetic'")]
    normal_items: int = 0
    labelled_items: int = 0
    notes: str = ""


class Pack(Struct, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[str, Meta(pattern=PACK_ID, description="owner/name")]
    version: Annotated[str, Meta(min_length=1)]
    description: str = ""
    languages: list[str] = msgspec.field(default_factory=lambda: ["en"])
    calibrated_on: list[CalibratedOn] = []
    calibration: CalibrationData | None = None
    presentation: Presentation = msgspec.field(default_factory=Presentation)
    questions: Annotated[list[PackQuestion], Meta(min_length=1)]
    categories: Annotated[list[Category], Meta(min_length=1)]
    decision: Decision

    def category(self, category_id: str) -> Category:
        return next(c for c in self.categories if c.id == category_id)

    def question(self, question_id: str) -> PackQuestion:
        return next(q for q in self.questions if q.id == question_id)


def read_pack(path: str | Path) -> Pack:
    """Decode and check one pack file; PackError names the file and the field."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise PackError(path, "", f"a pack file ends in {', '.join(SUFFIXES)}")
    try:
        data = path.read_bytes()
        decode = msgspec.json.decode if path.suffix == ".json" else msgspec.yaml.decode
        pack = decode(data, type=Pack)
    except msgspec.ValidationError as e:
        message, _, where = str(e).partition(" - at `$")
        raise PackError(path, where.rstrip("`").lstrip(".") or "", message) from None
    except (msgspec.DecodeError, OSError) as e:
        raise PackError(path, "", str(e)) from None
    _check(pack, path)
    return pack


def _check(pack: Pack, path: Path) -> None:
    def fail(field: str, message: str):
        raise PackError(path, field, message)

    wrapper = pack.presentation.wrapper
    if wrapper.count("{content}") != 1:
        fail("presentation.wrapper", "must hold {content} exactly once")
    ids: set[str] = set()
    for i, q in enumerate(pack.questions):
        where = f"questions[{i}]"
        if q.id in ids:
            fail(where + ".id", f"question id {q.id!r} is used twice")
        ids.add(q.id)
        if not re.search(r"\{\?\}$", q.template.replace("{{", "").replace("}}", "")):
            fail(where + ".template", "a pack question ends in its {?} slot")
        if not q.options:
            fail(where + ".options", "a pack question lists its options")
        if q.orderings is not None:
            fail(where + ".orderings", "a pack's cells read its options as listed: no orderings")
        if q.workload is not None:
            fail(
                where + ".workload",
                "a pack calibrates its cells itself (baselines), not with a server workload",
            )
    categories: set[str] = set()
    for i, c in enumerate(pack.categories):
        if c.id in categories:
            fail(f"categories[{i}].id", f"category id {c.id!r} is used twice")
        categories.add(c.id)
        for j, cell in enumerate(c.cells):
            where = f"categories[{i}].cells[{j}]"
            if cell.question not in ids:
                fail(where + ".question", f"no question {cell.question!r}")
            if cell.option not in pack.question(cell.question).options:
                fail(where + ".option", f"{cell.option!r} is not an option of question {cell.question!r}")
            b = cell.baseline
            if b is not None:
                if (b.mean is None) != (b.std is None):
                    fail(where + ".baseline", "give mean and std together")
                if (b.mean is None) == (b.percentiles is None):
                    fail(where + ".baseline", "give mean and std, or percentiles (one of the two)")
                if b.percentiles is not None and b.percentiles != sorted(b.percentiles):
                    fail(where + ".baseline.percentiles", "must be ascending")
    labels = pack.decision.labels
    if len(set(labels)) != len(labels):
        fail("decision.labels", "labels must be unique")
    for i, rule in enumerate(pack.decision.rules):
        if rule.category not in categories:
            fail(f"decision.rules[{i}].category", f"no category {rule.category!r}")
        if rule.label not in labels:
            fail(f"decision.rules[{i}].label", f"{rule.label!r} is not one of decision.labels")
