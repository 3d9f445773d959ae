"""Parity with Hugging Face transformers on every fixture of the manifest (tiny families and real models)."""

from pathlib import Path

import pytest

from spinf_jax import parity
from spinf_jax.cli import main

ENTRIES = parity.manifest()
EXTRACTION = parity.manifest(section="extraction")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])
def test_manifest_entry(entry):
    [result] = parity.run_all(passes=2, name=entry["name"])
    print(result.line())
    assert result.name == entry["name"]
    assert result.ok, result.line()
    assert result.bit_identical
    if result.tokenizer_ok is not None:
        assert result.tokenizer_ok


@pytest.mark.parametrize("entry", EXTRACTION, ids=[e["name"] for e in EXTRACTION])
def test_extraction_entry(entry):
    """Decoded answers against transformers' greedy and beam-search continuations (issue 14)."""
    [result] = parity.run_all(name=entry["name"])
    print(result.line())
    assert result.ok, result.line()
    assert result.answers >= len(parity.read_reference(parity.REPO / entry["reference"])["prompts"])


def test_cli_fails_beyond_tolerance(capsys):
    """The command must exit non-zero when the bound is tighter than the measured difference."""
    args = [
        "parity",
        "--fixture",
        str(parity.REPO / "fixtures/tiny/llama"),
        "--reference",
        str(parity.REPO / "fixtures/references/tiny-llama.json.gz"),
    ]
    assert main(args) == 0
    assert main([*args, "--tolerance", "1e-9"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_detects_a_wrong_reference(tmp_path: Path):
    """A reference from another model must fail: parity is not vacuous."""
    args = [
        "parity",
        "--fixture",
        str(parity.REPO / "fixtures/tiny/qwen2"),
        "--reference",
        str(parity.REPO / "fixtures/references/tiny-llama.json.gz"),
    ]
    assert main(args) == 1
