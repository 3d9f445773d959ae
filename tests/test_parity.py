"""Parity with Hugging Face transformers on every fixture of the manifest (tiny families and real models).

Each log-prob entry runs once, on `spinf-jax parity`'s engine over the session's model of its (model,
precision) (tests/engines.py); an extraction entry on the session's engine of that model. That a second pass
gives the same bits is a property of the engine's program, not of a fixture: one test checks it for every
family of the tiny fixtures (the real models' stacks are among them)."""

from pathlib import Path

import pytest

from spinf_jax import parity
from spinf_jax.cli import main
from tests import engines

ENTRIES = parity.manifest()
EXTRACTION = parity.manifest(section="extraction")
TINY_ENTRIES = [e for e in ENTRIES if e["model"].startswith("fixtures/tiny/")]
# The real models: each loads a GGUF and runs fp8/int8 emulated on the CPU (slow tier).
REAL = pytest.mark.slow


# Left out of CI for its 15-minute budget (the manifest's "ci": false), 55 s of the suite's test time: the
# extraction entries of the MoE families (the experts are row-local: their decoding is their dense families')
# and of the dense tiny Gemma 4 (its decode path is the E2B and k = v fixtures' without their extras). Their
# log-prob entries run.
NOT_IN_CI = pytest.mark.skip(reason='"ci": false in the manifest: run by `spinf-jax parity --all`')


# The real models in CI at one precision each: Gemma 3 270M at fp8 (what GPU users run, and the most lossy)
# and SmolLM2 at fp32; their other precisions are the full tier's (`pytest -m full`), 160 s of CI's time.
IN_CI = {"gemma3-270m.fp8", "smollm2-135m.fp32", "extraction.gemma3-270m.fp32"}


def _marks(entry: dict) -> list:
    if not entry.get("ci", True):
        return [NOT_IN_CI]
    if entry["model"].startswith("fixtures/"):
        return []
    return [REAL] if entry["name"] in IN_CI else [REAL, pytest.mark.full]


def _engine(entry: dict):
    """The command's engine over the session's model of the entry."""
    return engines.parity_engine(parity.model_spec(entry), entry["precision"])


def _extraction_engine(entry: dict):
    """Decoding in the buckets the other tests' engines of the model use, so that they share its programs
    (any buckets give the same answers: tests/test_extraction.py)."""
    return engines.engine(parity.model_spec(entry), entry["precision"])


@pytest.mark.parametrize("entry", [pytest.param(e, id=e["name"], marks=_marks(e)) for e in ENTRIES])
def test_manifest_entry(entry):
    result = parity.run_entry(entry, _engine(entry))
    print(result.line())
    assert result.name == entry["name"]
    assert result.ok, result.line()
    if result.tokenizer_ok is not None:
        assert result.tokenizer_ok


@pytest.mark.parametrize("entry", [pytest.param(e, id=e["name"], marks=_marks(e)) for e in EXTRACTION])
def test_extraction_entry(entry):
    """Decoded answers against transformers' greedy and beam-search continuations (issue 14)."""
    result = parity.run_entry(entry, _extraction_engine(entry), section="extraction")
    print(result.line())
    assert result.ok, result.line()
    assert result.answers >= len(parity.read_reference(parity.REPO / entry["reference"])["prompts"])


def test_passes_are_bit_identical_in_every_family():
    """`spinf-jax parity --passes 2`: every family's program gives the same bits when it runs again."""
    for entry in TINY_ENTRIES:
        result = parity.run_entry(entry, _engine(entry), passes=2)
        assert result.bit_identical, result.line()


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
