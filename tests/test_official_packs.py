"""The official packs (packs/spinf/) on the default model: golden contents and their decisions.

fixtures/pack_goldens/contents.json holds a handful of contents per pack with the decision a person would
give; decisions.json the decisions the default model gave when they were recorded (record.py), with the
pack's version. A change to a pack or to the engine that moves a decision fails here: re-record, and read
the agreement with the expected decisions before committing."""

import json
from pathlib import Path

import pytest

from spinf_jax.packs.loader import load_packs

GOLDENS = Path(__file__).resolve().parent.parent / "fixtures" / "pack_goldens"
CONTENTS = json.loads((GOLDENS / "contents.json").read_text())
RECORDED = json.loads((GOLDENS / "decisions.json").read_text())
PACKS = [p for p in CONTENTS if not p.startswith("_")]


def test_every_official_pack_has_goldens():
    assert set(PACKS) == set(load_packs())


@pytest.mark.parametrize("pack_id", PACKS)
def test_golden_decisions(gemma_engine, pack_id):
    items, recorded = CONTENTS[pack_id], RECORDED[pack_id]
    assert load_packs()[pack_id].pack.version == recorded["version"]
    body = {
        "inputs": [{"messages": [{"role": "user", "content": i["text"]}]} for i in items],
        "packs": [{"id": pack_id}],
    }
    got = [r["packs"][0]["decision"]["label"] for r in gemma_engine.score(body)["results"]]
    assert got == recorded["decisions"]
    agree = sum(g == i["expected"] for g, i in zip(got, items, strict=True))
    assert f"{agree}/{len(items)}" == recorded["agree"]
