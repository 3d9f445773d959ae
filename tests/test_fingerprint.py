"""system_fingerprint names what can change bits (spinf_jax.fingerprint): each part moves it, /health lists
them, and the digest of the listed parts is the fingerprint the scores carry."""

import jax
import pytest

from spinf_jax import fingerprint

ARITHMETIC = {"model": "abc", "precision": "fp32", "block": "128", "row_tile": "128", "engine_version": "7"}


def _fingerprint():
    return fingerprint.digest(fingerprint.parts(jax.devices()[0], ARITHMETIC))


def test_the_parts_name_the_software_and_the_machine(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    named = fingerprint.parts(jax.devices()[0], ARITHMETIC)
    assert list(named)[:5] == list(ARITHMETIC)
    assert named["jax"] == jax.__version__ and named["backend"] == "cpu" and named["xla_flags"] == ""
    assert named["cpu"]  # XLA:CPU compiles for the host's processor
    assert "avx" in named["cpu_extensions"].split() or jax.devices()[0].client.platform_version != "cpu"


@pytest.mark.parametrize("part", sorted(ARITHMETIC))
def test_each_part_of_the_arithmetic_moves_it(part):
    moved = fingerprint.digest(fingerprint.parts(jax.devices()[0], ARITHMETIC | {part: "other"}))
    assert moved != _fingerprint()


def test_xla_flags_move_it_in_any_order(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    plain = _fingerprint()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_gpu_autotune_level=0")
    tuned = _fingerprint()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0  --xla_cpu_enable_fast_math=false")
    assert tuned != plain and _fingerprint() == tuned


def test_an_autotuning_file_is_hashed_by_its_contents(monkeypatch, tmp_path):
    results = tmp_path / "autotune.textproto"
    results.write_text("version: 3\n")
    monkeypatch.setenv("XLA_FLAGS", f"{fingerprint.AUTOTUNE_RESULTS_FLAG}{results}")
    first = _fingerprint()
    results.write_text("version: 3\nresults {}\n")
    assert _fingerprint() != first
    results.unlink()
    assert fingerprint.parts(jax.devices()[0], ARITHMETIC)["autotune_results"].startswith("unreadable")


def test_the_engine_carries_the_digest_of_its_parts(smollm_engine):
    engine = smollm_engine
    assert engine.fingerprint == fingerprint.digest(engine.fingerprint_parts)
    assert engine.fingerprint_parts["precision"] == engine.model.precision.value
    assert (
        engine.score(
            {
                "messages": [{"content": "hi"}],
                "scoring": {"queries": [{"id": "q", "template": "Ok? {?}", "options": [" yes", " no"]}]},
            }  # fmt: skip
        )["system_fingerprint"]
        == engine.fingerprint
    )
