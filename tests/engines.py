"""The models and engines the tests share. A model is loaded once a session per (spec, precision), and an
engine built once per (model, precision, buckets): a test that only asks an engine things takes one from
here instead of loading or compiling its own. (A test that needs an engine's fresh state, such as an empty
floor cache, builds `Engine(model(...), ...)`: its programs then come from the session's compile cache.)

Specs are the built-in names (spinf/gemma-3-270m, spinf/smollm2-135m-instruct) or a folder of
fixtures/tiny by its name ("gemma3", "qwen3", ...)."""

import dataclasses
import functools
import string
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from spinf_jax import parity
from spinf_jax.engine import Engine
from spinf_jax.loader import Model, load_model
from spinf_jax.packer import Buckets
from spinf_jax.tokenizer import Tokenizer

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def model(spec: str, precision: str = "fp32") -> Model:
    return _model(_spec(spec), precision)


def engine(spec: str, precision: str = "fp32", sizes: tuple[int, ...] = (256, 512, 1024), block: int = 64):
    return _engine(_spec(spec), precision, Buckets(tuple(sizes), block))


def parity_engine(spec: str, precision: str = "fp32") -> Engine:
    """`spinf-jax parity`'s engine (parity.reference_engine) over the session's model."""
    spec = _spec(spec)
    return _engine(spec, precision, parity.reference_buckets(_model(spec, precision).row_tile))


def _spec(spec: str) -> str:
    """One name per model, so that a tiny fixture named by its folder or by its path loads once."""
    folder = TINY / spec  # an absolute path stays itself
    return str(folder.resolve()) if folder.is_dir() else spec


@functools.cache
def _model(spec: str, precision: str) -> Model:
    return load_model(spec, precision)


@functools.cache
def _engine(spec: str, precision: str, buckets: Buckets) -> Engine:
    return Engine(_model(spec, precision), buckets)


def release() -> None:
    """Forget the models and engines shared so far (and so their compiled programs, once nothing else holds
    them): the next test that asks for one loads or builds it again."""
    _engine.cache_clear()
    _model.cache_clear()


@functools.cache
def byte_tokenizer() -> Tokenizer:
    """A tokenizer for the tiny fixtures (512-token vocabularies, no tokenizer of their own): one token per
    byte, and " A" to " Z" one token each, so that lettered answers can be read; BOS last."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", letter) for letter in string.ascii_uppercase]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<bos>"] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<bos>"])
    return Tokenizer(backend, bos_id=vocab["<bos>"], add_bos=True)


@functools.cache
def with_bytes(
    spec: str, precision: str = "fp32", sizes: tuple[int, ...] = (256, 512, 1024), block: int = 32
):
    """A tiny fixture's engine whose model reads text through byte_tokenizer (its weights the session's)."""
    model = dataclasses.replace(_model(_spec(spec), precision), tokenizer=byte_tokenizer())
    return Engine(model, Buckets(tuple(sizes), block))
