"""`spinf-jax quantize`: a checkpoint written in the engine's stored form loads with no quantizing and scores
bit for bit as its source quantized at load (spinf_jax.export, spinf_jax.quantized)."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinf_jax import export, parity
from spinf_jax.cli import main
from spinf_jax.engine import Engine
from spinf_jax.layout import build_tree
from spinf_jax.loader import checkpoint_digest, load_model, open_checkpoint, resolve
from spinf_jax.models.params import params
from spinf_jax.packer import Buckets
from spinf_jax.quant import Precision, QuantArray
from spinf_jax.tokenizer import Tokenizer
from tests.trees import POOL

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def _write(family: str, precision: str, out: Path, shard_bytes: int = export.SHARD_BYTES) -> Path:
    export.quantize(str(TINY / family), precision, out, shard_bytes=shard_bytes, measure=False)
    return out


def _weights(model) -> list:
    return jax.tree.leaves([p.get_value() for p in params(model.decoder)])


@pytest.mark.parametrize("family", ["gemma3", "qwen2", "gemma4-e2b", "qwen3_moe"])
@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_written_weights_are_the_weights_quantized_at_load(tmp_path, family, precision):
    """Every stored array (values, scales, bf16 embeddings and routers, f32 norms and biases) has the same
    dtype and bits, read from shards of at most 40 kB (a larger tensor alone in its shard) listed in the
    index; a mixture of experts' experts one tensor each, as in its source."""
    out = _write(family, precision, tmp_path / "q", shard_bytes=40_000)
    written, at_load = load_model(str(out), precision), load_model(str(TINY / family), precision)
    assert isinstance(written.decoder.layer(0)[0].q.get_value(), QuantArray)
    for got, want in zip(_weights(written), _weights(at_load), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {f.name for f in shards}
    for shard in shards:
        tensors = [name for name, file in index["weight_map"].items() if file == shard.name]
        assert shard.stat().st_size < 40_000 + 4096 or len({t.removesuffix("_scale") for t in tensors}) == 1
    assert written.digest == checkpoint_digest(out) != at_load.digest
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight_scale" in index["weight_map"]
        assert written.decoder.layer(0)[0].router.get_value().dtype == jnp.bfloat16


def test_int8_checkpoint_scores_bit_identical_to_quantizing_at_load(tmp_path):
    """Engine scores (log-probs and top tokens of every read) of a few trees of questions."""
    out = _write("qwen3", "int8", tmp_path / "q")
    rng = np.random.default_rng(0)
    trees = [build_tree([2], rng.integers(3, 500, n).tolist(), POOL[:4]) for n in (30, 90)]

    def scores(spec: Path) -> list[np.ndarray]:
        engine = Engine.load(str(spec), "int8", buckets=Buckets((512,), block=64))
        return [a for s in engine.score_trees(trees) for a in (s.logprobs, s.top_tokens)]

    for got, want in zip(scores(out), scores(TINY / "qwen3"), strict=True):
        np.testing.assert_array_equal(got, want)


def test_loading_at_another_precision_is_an_error(tmp_path):
    out = _write("gemma3", "fp8", tmp_path / "q")
    for other in ("int8", "bf16"):
        with pytest.raises(ValueError, match="written for fp8 .* precision 'fp8'"):
            load_model(str(out), other)


def test_without_a_precision_a_folder_loads_at_the_one_it_was_written_for(tmp_path, capsys):
    out = _write("gemma3", "fp8", tmp_path / "q")
    assert load_model(str(out)).precision is Precision.FP8
    assert load_model(str(TINY / "gemma3")).precision is Precision.BF16
    # serve reads it before loading (its --check loads nothing); a --precision given still counts
    for flags, precision in (([], "fp8"), (["--precision", "int8"], "int8")):
        assert main(["serve", str(out), "--check", "--compile-cache", "none", *flags]) == 0
        assert f"({precision})" in capsys.readouterr().out


def test_other_quantized_checkpoints_are_refused(tmp_path):
    """A checkpoint quantized by another tool would load as garbage if read as plain weights."""
    shutil.copytree(TINY / "llama", tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'fp8'"):
        load_model(str(tmp_path / "q"), "fp8")


@pytest.mark.parametrize("spec", ["spinf/gemma-3-270m", "spinf/smollm2-135m-instruct"])
def test_tokenizer_written_from_a_gguf_file_gives_the_same_ids(tmp_path, spec):
    checkpoint = open_checkpoint(resolve(spec))
    export.write_tokenizer(checkpoint, tmp_path)
    ours, back = Tokenizer.from_gguf(checkpoint), Tokenizer.from_folder(tmp_path)
    assert (back.bos_id, back.eos_id, back.add_bos) == (ours.bos_id, ours.eos_id, ours.add_bos)
    assert back.chat_template == ours.chat_template
    texts = [*export.PROMPTS, "  two spaces\n\ttab, émigré 日本語 🤖", "<start_of_turn>user\nhi<|im_end|>"]
    for text in texts:
        assert back.prefix() + back.encode(text) == ours.prefix() + ours.encode(text), text


def test_cli_writes_a_loadable_folder_with_card_and_report(tmp_path):
    out = tmp_path / "tiny-gemma3-fp8"
    assert main(["quantize", str(TINY / "gemma3"), "--precision", "fp8", "--out", str(out)]) == 0
    assert {f.name for f in out.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "parity.json",
        "parity.md",
        "README.md",
    }
    report = json.loads((out / "parity.json").read_text())
    assert report["written_vs_quantized_at_load"] == {"bit_identical": True, "max_abs": 0.0}
    assert 0 < report["vs_fp32"]["mean_abs"] < report["vs_fp32"]["max_abs"]
    assert report["source_digest"] == checkpoint_digest(TINY / "gemma3")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["precision"]) == ("spinf-jax", "fp8")
    assert config["ignore"] == ["model.embed_tokens"]
    card = (out / "README.md").read_text()
    assert report["source_digest"] in card and checkpoint_digest(out) in card and "bit-identical" in card
    model = load_model(str(out), "fp8")
    assert model.decoder.embed.get_value().dtype == jnp.bfloat16
    assert main(["quantize", str(TINY / "gemma3"), "--precision", "fp8", "--out", str(out)]) == 2  # not empty


def test_the_report_reference_holds_at_any_row_tile():
    """The parity report's own reference runs a plain forward of each prompt: it must fit the model's row
    tiles (1,024 rows on a GPU, more than these prompts) and give the same tokens whatever the tile."""
    ids = [np.random.default_rng(1).integers(3, 500, n).tolist() for n in (17, 300)]
    refs = []
    for tile in (128, 1024):
        model = load_model(str(TINY / "gemma3"), "fp32")
        model.row_tile = tile
        refs.append(parity.own_reference(model, ids, [None, None]))
    assert [p["top_ids"] for p in refs[0]["prompts"]] == [p["top_ids"] for p in refs[1]["prompts"]]
