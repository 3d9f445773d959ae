"""docs/api.md (and docs/decision-apis.md, for the decision APIs) document every field of every body: one
table per msgspec Struct that the routes decode or answer with, checked both ways. A field added to a Struct
without a row fails, and so does a row (or a table) left for a field (or a Struct) that is gone. The prose
stays written by hand; this only checks that it covers the schemas."""

import re
from functools import cache
from pathlib import Path

import msgspec
import pytest

from spinf_jax import api, openai_decisions, systemone
from spinf_jax.server.app import Settings, create_app

DOCS = Path(__file__).resolve().parent.parent / "docs"
API_MDS = (DOCS / "api.md", DOCS / "decision-apis.md")
# The routes' bodies: what the server decodes, and what it answers with (errors included).
REQUESTS = (
    *(api.ScoreRequest, api.ChatCompletionRequest, api.DecideRequest, api.SharedDecideRequest),
    api.ProfileRequest,
    *(systemone.SystemOneRequest, systemone.SystemOneBatchRequest, openai_decisions.DecisionsRequest),
)
RESPONSES = (
    *(api.ScoreResponse, api.ChatCompletion, api.DecisionResult, api.SharedDecisions),
    *(api.ModelList, api.PackList, api.Health, api.ProfileResult, api.ErrorEnvelope),
    *(systemone.SystemOneResponse, systemone.SystemOneBatchResponse, openai_decisions.DecisionsResponse),
)
HEADING = re.compile(r"^#+ (.*)$", re.M)
STRUCT_NAME = re.compile(r"`([A-Z]\w*)`")
CELL_DIVIDER = re.compile(r"(?<!\\)\|")  # a table's `|`, not an escaped `\|` inside a cell


def reachable(roots) -> list[type[msgspec.Struct]]:
    """Every Struct the roots are or hold, inside lists, dicts, unions and Annotated types too, in the order
    first met."""
    found: list[type[msgspec.Struct]] = []

    def walk(info) -> None:
        if isinstance(info, msgspec.inspect.StructType):
            if info.cls not in found:
                found.append(info.cls)
                for field in info.fields:
                    walk(field.type)
        elif isinstance(
            info, msgspec.inspect.ListType | msgspec.inspect.SetType | msgspec.inspect.VarTupleType
        ):
            walk(info.item_type)
        elif isinstance(info, msgspec.inspect.DictType):
            walk(info.key_type)
            walk(info.value_type)
        elif isinstance(info, msgspec.inspect.UnionType):
            for arm in info.types:
                walk(arm)
        elif isinstance(info, msgspec.inspect.Metadata):
            walk(info.type)

    for info in msgspec.inspect.multi_type_info(roots):
        walk(info)
    return found


def fields(struct: type[msgspec.Struct]) -> dict[str, bool]:
    """A Struct's JSON field names, each with whether a request must give it; a tagged Struct's tag (`type`
    of a content part) is a required field too."""
    out = {f.encode_name: f.required for f in msgspec.structs.fields(struct)}
    tag = struct.__struct_config__.tag_field
    if tag is not None:
        out[tag] = True
    return out


@cache
def tables() -> dict[tuple[str, ...], dict[str, str]]:
    """The docs' tables of Structs: the Struct names of a heading → {field: its type cell} of the table under
    it (the first cell of each row names the field)."""
    out = {}
    for path in API_MDS:
        out |= _tables(path.read_text())
    return out


def _tables(text: str) -> dict[tuple[str, ...], dict[str, str]]:
    headings = list(HEADING.finditer(text))
    out = {}
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        names = tuple(STRUCT_NAME.findall(heading[1]))
        if not names:
            continue
        body = text[heading.end() : following.start() if following else len(text)]
        rows = {}
        for line in body.splitlines():
            cells = [c.strip() for c in CELL_DIVIDER.split(line)[1:-1]]
            if len(cells) < 3 or not cells[0].startswith("`"):
                continue  # prose, a table's header or its divider
            for name in re.findall(r"`([^`]+)`", cells[0]):
                assert name not in rows, f"{names}: field {name} has two rows"
                rows[name] = cells[1]
        out[names] = rows
    return out


STRUCTS = reachable(REQUESTS + RESPONSES)
REQUEST_STRUCTS = reachable(REQUESTS)
BY_NAME = {s.__name__: s for s in STRUCTS}


def test_the_bodies_are_what_the_server_documents():
    """The roots above are the routes' bodies: the Structs reachable from them are exactly the components of
    the server's OpenAPI document, and every public Struct of spinf_jax.api is among them."""
    schema = create_app(Settings("spinf/gemma-3-270m")).openapi_schema.to_schema()
    assert {s.__name__ for s in STRUCTS} == set(schema["components"]["schemas"])
    defined = {
        value
        for name, value in vars(api).items()
        if isinstance(value, type) and issubclass(value, msgspec.Struct) and not name.startswith("_")
    }
    assert defined - {msgspec.Struct} <= set(STRUCTS)


def test_every_table_is_of_a_struct_that_exists():
    known = {s.__name__ for s in STRUCTS}
    for names in tables():
        assert set(names) <= known, f"the docs have a table for {set(names) - known}, which is no body's"


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_each_struct_has_a_table_with_exactly_its_fields(struct):
    mine = [names for names in tables() if struct.__name__ in names]
    assert len(mine) == 1, f"the docs need one table headed `{struct.__name__}` (found {len(mine)})"
    [names] = mine
    structs = [BY_NAME[name] for name in names]
    wanted = set().union(*(fields(s) for s in structs))
    documented = set(tables()[names])
    assert not wanted - documented, f"{names}: fields without a row in docs/api.md: {wanted - documented}"
    assert not documented - wanted, f"{names}: rows for fields that do not exist: {documented - wanted}"


@pytest.mark.parametrize("struct", REQUEST_STRUCTS, ids=lambda s: s.__name__)
def test_request_tables_mark_exactly_the_required_fields(struct):
    [names] = [names for names in tables() if struct.__name__ in names]
    for name, required in fields(struct).items():
        marked = "required" in tables()[names][name]
        assert marked == required, f"{struct.__name__}.{name}: required is {required} in the Struct"
