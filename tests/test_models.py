"""The NNX model stacks as a research user sees them: weights as Params named after the checkpoint's tensors,
layers to index, and hidden states captured on request."""

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from spinf_jax.loader import load_model
from spinf_jax.models import Gemma3, Gemma4, Llama, abstract_decoder, family_for
from spinf_jax.models.layers import TreeBatch
from spinf_jax.models.params import Kind, params, per_source

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
FAMILIES = [
    "gemma3",
    "qwen3",
    "qwen2",
    "llama",
    "gemma4",
    "gemma4-e2b",
    "gemma4-keqv",
    "qwen3_5",
    "qwen3_moe",
    "gemma4-moe",
    "qwen3_5_moe",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_params_are_exactly_the_checkpoint_tensors(family):
    """Every Param names a tensor of the checkpoint and every tensor is some Param: the modules declare
    the whole model and nothing else (a Param the config does not have is None, not a placeholder)."""
    config = json.loads((TINY / family / "config.json").read_text())
    decoder = abstract_decoder(config, "bf16")
    with safe_open(TINY / family / "model.safetensors", "numpy") as f:
        names = f.keys()
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    declared = {
        name: tuple(part.shape) for p in params(decoder) for name, part in per_source(p, p.get_value())
    }
    assert declared == shapes
    assert all(isinstance(p.kind, Kind) for p in params(decoder))


def test_families_are_named_for_what_they_hold():
    assert family_for({"model_type": "gemma3_text"}) is Gemma3
    assert family_for({"model_type": "gemma4_text"}) is Gemma4
    assert {family_for({"model_type": t}) for t in ("llama", "qwen2", "qwen3")} == {Llama}
    with pytest.raises(ValueError, match="unsupported model_type"):
        family_for({"model_type": "mamba"})


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "gemma4-e2b"])
def test_hidden_states_capture(family):
    """hidden_states: the stream entering each layer, then the final output: its last entry is the forward's
    own output at those rows (same bits), its first the embedding of the tokens read there."""
    model = load_model(str(TINY / family), "fp32")
    decoder = model.decoder
    tokens = [2, 17, 93, 41, 5, 77, 12]
    batch = TreeBatch.sequence(tokens)
    rows = np.array([0, 3, 6], np.int32)
    states = np.asarray(model.hidden_states(batch, rows))
    assert states.shape == (decoder.num_layers + 1, 3, decoder.config.hidden_size)
    np.testing.assert_array_equal(states[-1], np.asarray(model.hidden(batch))[rows])
    table = np.asarray(decoder.embed.get_value())[np.array(tokens)[rows]]
    scale = np.sqrt(decoder.config.hidden_size, dtype=np.float32) if family.startswith("gemma") else 1.0
    np.testing.assert_allclose(states[0], table * scale, rtol=1e-6)
    assert not np.allclose(states[1], states[0])  # a layer ran between them
    # Capturing is opt-in: a plain call leaves no Intermediate behind on the module. (Under nnx.jit, which
    # writes back whatever the call put on the module, and compiles one program where an eager call compiles
    # one per operation.)
    nnx.jit(lambda d, b: d(b, model.row_tile))(decoder, batch)
    assert not nnx.state(decoder, nnx.Intermediate)


def test_a_layer_can_be_inspected_and_changed():
    """A notebook edits a weight in place and sees the effect: the Params are the model."""
    model = load_model(str(TINY / "qwen3"), "fp32")
    batch = TreeBatch.sequence([2, 17, 93, 41])
    before = np.asarray(model.hidden(batch))
    layer, m = model.decoder.layer(1)  # layer 1's weights are row m of its stack's
    assert layer.q.source[m] == "model.layers.1.self_attn.q_proj.weight" and layer.q.kind is Kind.LINEAR
    assert layer.q.get_value()[m].shape == (128, 64)  # [out, in]
    layer.down.set_value(layer.down.get_value().at[m].set(0))  # silence layer 1's MLP
    after = np.asarray(model.hidden(batch))
    assert np.abs(after - before).max() > 1e-3
