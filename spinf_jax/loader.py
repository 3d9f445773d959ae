"""Find a checkpoint (built-in name, local folder or file, Hugging Face Hub id), read it tensor by tensor
and place each weight on the device in its final (quantized) form."""

import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.audio import AudioFormat
from spinf_jax.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL
from spinf_jax.checkpoint import GGUFFile, SafetensorsFolder
from spinf_jax.media import ImageFormat
from spinf_jax.models import abstract_audio_tower, abstract_decoder, abstract_tower
from spinf_jax.models.decoder import Decoder, hidden_states, split
from spinf_jax.models.layers import TreeBatch
from spinf_jax.models.params import Kind, params, per_source, stacked_shape, stored_as
from spinf_jax.progress import Progress, Steps
from spinf_jax.quant import Precision, QuantArray, Weight, quantize
from spinf_jax.quantized import SCALE_SUFFIX, written_precision
from spinf_jax.tokenizer import Tokenizer


def resolve(spec: str, weights: bool = True) -> Path:
    """Model spec → local path of a folder or a .gguf file (of a Hub model without its weights, for its
    tokenizer: weights=False)."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]()
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        # Honours HF_HUB_OFFLINE and the local cache (HF_HUB_CACHE / HF_HOME) like every Hub client.
        wanted = ["*.json", "tokenizer*", *(["*.safetensors"] if weights else [])]
        return Path(snapshot_download(spec, allow_patterns=wanted))
    raise FileNotFoundError(f"no model at {spec!r}: not a built-in name, a local path, or a Hub id")


def open_checkpoint(path: Path) -> SafetensorsFolder | GGUFFile:
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf(*_file_key(path))
    if path.is_dir():
        return SafetensorsFolder(path)
    raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a .gguf file")


# A GGUF file's header and tokenizer are read once a process while the file is unchanged: parsing Gemma 3's
# 262k-token vocabulary and building its BPE merges take ~15 s of a ~25 s load on the CPU, the same for
# every precision the file is loaded at.


def _file_key(path: Path) -> tuple[Path, int, int]:
    stat = path.stat()
    return path.resolve(), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: Path, mtime_ns: int, size: int) -> Tokenizer:
    return Tokenizer.from_gguf(_gguf(path, mtime_ns, size))


@partial(jax.jit, static_argnums=1)
def _to_final(w: jax.Array, precision: Precision):
    return quantize(w, precision)


def _final(w: jax.Array, kind: Kind, precision: Precision) -> Weight:
    # Wait for each tensor: else reads run ahead of the device and full-precision copies pile up there.
    return jax.block_until_ready(_to_final(w, stored_as(kind, precision)))


def _as_written(source: str, expected: Weight, w, checkpoint) -> Weight:
    """A tensor of a checkpoint in the stored form (spinf_jax.quantized), put on the device as it is: it must
    already have the dtype and shape the engine keeps it in (`expected`)."""
    quantized = isinstance(expected, QuantArray)
    value = QuantArray(w, checkpoint.get(source + SCALE_SUFFIX)) if quantized else w
    for got, want in zip(jax.tree.leaves(value), jax.tree.leaves(expected), strict=True):
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            raise ValueError(
                f"{source}: stored as {got.dtype}{list(got.shape)}, the engine keeps it as "
                f"{want.dtype}{list(want.shape)}"
            )
    return jax.block_until_ready(jax.tree.map(jnp.asarray, value))


def stored_weights(decoder: Decoder, checkpoint) -> Iterator[tuple[nnx.Param, Weight]]:
    """An abstract decoder's Params, each with its value in its final form on the device: one tensor read,
    moved to the device and cast/quantized at a time, so host memory holds one tensor, not the model. What
    load_weights puts in place and `spinf-jax quantize` writes (one code path, so the two give the same
    bits). A checkpoint already in the stored form is put in place as it is, at the precision it was written
    for only."""
    written = written_precision(checkpoint.config)
    if written not in (None, decoder.precision):
        raise ValueError(
            f"the checkpoint was written for {written.value} by `spinf-jax quantize`: load it with precision "
            f"{written.value!r} (it holds no full-precision weights to make {decoder.precision.value} from)"
        )
    for param in params(decoder):
        layers = []  # one per source: a layer's weight of a stack, or the one tensor
        for source, expected in per_source(param, param.get_value()):
            w = checkpoint.get(source)
            if tuple(w.shape) != tuple(expected.shape):
                raise ValueError(f"{source}: checkpoint shape {tuple(w.shape)} != expected {expected.shape}")
            if written is None:
                layers.append(_final(jnp.asarray(w), param.kind, decoder.precision))
            else:
                layers.append(_as_written(source, expected, w, checkpoint))
        yield (
            param,
            _stack(layers, stacked_shape(param.source)) if isinstance(param.source, tuple) else layers[0],
        )


@partial(jax.jit, static_argnums=1)
def _stack(layers: list[Weight], lead: tuple[int, ...]) -> Weight:
    """The sources' tensors (in per_source's order) stacked into the Param's leading axes `lead`."""
    return jax.tree.map(lambda *a: jnp.stack(a).reshape(*lead, *a[0].shape), *layers)


def load_weights(decoder: Decoder, checkpoint, progress: Progress | None = None) -> None:
    """Fill an abstract decoder's Params in place (stored_weights), each a step of "load" (progress)."""
    with Steps(progress, "load", len(params(decoder)), "tensor") as step:
        for param, value in stored_weights(decoder, checkpoint):
            param.set_value(value)
            step()


_DIGESTS = Path(os.environ.get("SPINF_CACHE", Path.home() / ".cache" / "spinf-jax")) / "digests.json"


def checkpoint_digest(path: Path) -> str:
    """sha256 over the checkpoint's files (weights, config, tokenizer), remembered per (file, size, mtime)
    so that a 24 GB checkpoint is hashed once, not at every start. It keys the scores' fingerprint."""
    files = (
        [path]
        if path.is_file()
        else sorted(
            f
            for f in path.iterdir()
            if f.is_file() and f.suffix in (".safetensors", ".json", ".gguf", ".model")
        )
    )
    known = json.loads(_DIGESTS.read_text()) if _DIGESTS.exists() else {}
    total = hashlib.sha256()
    for f in files:
        stat = f.stat()
        key = f"{f.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in known:
            h = hashlib.sha256()
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
            known[key] = h.hexdigest()
        total.update(f"{f.name}:{known[key]}".encode())
    # Written whole under another name, then renamed: another process reading it (a server starting, a test
    # worker) sees the old file or the new one, never a half-written one (a read of an empty file failed).
    _DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    partial_file = _DIGESTS.with_name(f"{_DIGESTS.name}.{os.getpid()}.tmp")
    partial_file.write_text(json.dumps(known))
    partial_file.replace(_DIGESTS)
    return total.hexdigest()


def random_weights(decoder: Decoder, key: jax.Array, std: float = 0.02) -> None:
    """Fill an abstract decoder with random weights at its real shapes, in their final form: for speed and
    memory measurements and GPU parity against a reference given the same weights (throughput does not
    depend on values)."""
    for param, k in zip(params(decoder), jax.random.split(key, len(params(decoder))), strict=True):
        shape = param.get_value().shape
        param.set_value(
            _final(jax.random.normal(k, shape, jnp.bfloat16) * std, param.kind, decoder.precision)
        )


def default_row_tile() -> int:
    """128 rows on the CPU; on GPUs 2,048, enough rows that the tiled GEMMs fill the GPU: at the 12B shape on
    an H100 (2026-12-06) a 16,384-row pass took 0.405 s against 0.427 s in 1,024-row tiles, and 8 clients
    over HTTP got 1.056-1.058x the questions/s (benchmarks/results/README.md, 2,048-row tiles)."""
    return 128 if jax.default_backend() == "cpu" else 2048


@dataclass
class Model:
    """A loaded model: its NNX decoder (weights on the device), the tokenizer, and how it runs its rows."""

    name: str
    decoder: Decoder
    tokenizer: Tokenizer | None
    digest: str = ""  # checkpoint_digest of what was loaded
    load_seconds: float = 0.0
    vision: nnx.Module | None = None  # the images' tower (models.abstract_tower), for models that read them
    image_format: ImageFormat | None = None  # how they are preprocessed and stand in the content
    audio: nnx.Module | None = None  # the audio tower (models.abstract_audio_tower), for models that hear
    audio_format: AudioFormat | None = None
    # Row-local work in tiles of this many rows (see models.layers.by_rows); None runs each pass's rows at
    # once, which is row-invariant on no backend we measured (docs/batch-invariance.md).
    row_tile: int | None = field(default_factory=default_row_tile)
    _jitted: dict = field(default_factory=dict, repr=False)

    def with_row_tile(self, row_tile: int | None) -> "Model":
        """This model running its rows in tiles of `row_tile` (None: all of a pass's rows at once), its
        compiled functions traced again (they were traced with the old tile)."""
        return replace(self, row_tile=row_tile, _jitted={})

    @property
    def config(self):
        return self.decoder.config

    @property
    def precision(self) -> Precision:
        return self.decoder.precision

    def _apply(self, name: str, fn, *args):
        """fn(decoder, *args), compiled once as a plain jax.jit over the decoder's weights (split now, so a
        weight changed in place is seen)."""
        jitted = self._jitted.get(name)
        if jitted is None:
            jitted = self._jitted[name] = jax.jit(
                lambda graphdef, weights, *a: fn(nnx.merge(graphdef, weights), *a), static_argnums=0
            )
        return jitted(*split(self.decoder), *args)

    def soft_tokens(self, *inputs) -> jax.Array:
        """An image's soft tokens [rows, hidden] from what its tower reads (ImageFormat.tower_inputs): the
        input embeddings of its rows in a pass (TreeBatch.with_media); the image's are the first
        ImageFormat.soft_count rows. One image a call, one program."""
        if self.vision is None:
            raise ValueError(f"{self.name} reads no images")
        jitted = self._jitted.get("vision")
        if jitted is None:
            jitted = self._jitted["vision"] = jax.jit(lambda g, w, *x: nnx.merge(g, w)(*x), static_argnums=0)
        return jitted(*split(self.vision), *map(jnp.asarray, inputs))

    def audio_soft_tokens(self, features, mask) -> jax.Array:
        """A clip's soft tokens [rows, hidden] from its features and their mask, padded to the tower's one
        shape (models.gemma4_audio.pad_frames); the clip's are the first audio.soft_token_count rows."""
        if self.audio is None:
            raise ValueError(f"{self.name} reads no audio")
        jitted = self._jitted.get("audio")
        if jitted is None:
            tower = jax.jit(lambda g, w, *x: nnx.merge(g, w)(*x)[0], static_argnums=0)  # its soft tokens
            jitted = self._jitted["audio"] = tower
        return jitted(*split(self.audio), jnp.asarray(features), jnp.asarray(mask))

    def hidden(self, batch: TreeBatch) -> jax.Array:
        """[T, hidden] final hidden states of a packed pass."""
        return self._apply("hidden", lambda d, b: d(b, self.row_tile), batch)

    def hidden_states(self, batch: TreeBatch, rows: jax.Array) -> jax.Array:
        """[layers + 1, N, hidden]: the residual stream at `rows` entering every layer, then the final normed
        output (models.decoder.hidden_states)."""
        capture = partial(hidden_states, row_tile=self.row_tile)
        return self._apply("hidden_states", capture, batch, rows)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] → [N, vocab] f32 logits."""
        return self._apply("logits", lambda d, h: d.logits(h), hidden)

    def logprobs(self, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Log-probabilities of chosen next tokens, without keeping a [N, vocab] matrix around.

        hidden [N, hidden], targets [N, K] token ids → (log P(targets) [N, K] f32, argmax token [N]).
        """

        def logprobs(decoder, hidden, targets):
            logits = decoder.logits(hidden)
            norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
            picked = jnp.take_along_axis(logits, targets, axis=-1) - norm
            return picked, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        return self._apply("logprobs", logprobs, hidden, targets)


def load_model(
    spec: str = DEFAULT_MODEL, precision: Precision | str | None = None, progress: Progress | None = None
) -> Model:
    """precision None: the one a `spinf-jax quantize` folder was written for, else bf16."""
    start = time.perf_counter()
    path = resolve(spec)
    checkpoint = open_checkpoint(path)
    precision = precision or written_precision(checkpoint.config) or Precision.BF16
    decoder = abstract_decoder(checkpoint.config, precision)
    load_weights(decoder, checkpoint, progress)
    vision = abstract_tower(checkpoint.config, precision)
    if vision is not None:
        load_weights(vision, checkpoint, progress)
    image_format = ImageFormat.from_checkpoint(checkpoint.config, path) if vision is not None else None
    audio_format = AudioFormat.from_checkpoint(checkpoint.config, path if path.is_dir() else None)
    mel_bins = audio_format.features.feature_size if audio_format is not None else 0
    audio = abstract_audio_tower(checkpoint.config, precision, mel_bins)
    if audio is not None:
        load_weights(audio, checkpoint, progress)
    tokenizer = _tokenizer(checkpoint)
    digest = checkpoint_digest(path)
    seconds = time.perf_counter() - start
    audio_format = audio_format if audio is not None else None  # e.g. Gemma 3n's: a tower we do not build
    media = dict(vision=vision, image_format=image_format, audio=audio, audio_format=audio_format)
    return Model(spec, decoder, tokenizer, digest, seconds, **media)


def random_model(
    config: Path | str, tokenizer_of: str = DEFAULT_MODEL, precision: Precision | str = "bf16"
) -> Model:
    """A model at the shape a transformers config.json describes, with made-up weights (random_weights, a
    fixed seed) and the tokenizer of the model `tokenizer_of`, or of a folder holding its tokenizer.json:
    speed and memory at a model's real shape without its checkpoint (`spinf-jax serve --random-weights`,
    benchmarks/http_throughput.py). Its scores mean nothing. The digest names the config, so two loads of
    one config give the same fingerprint and the same bits."""
    start = time.perf_counter()
    text = Path(config).expanduser().read_text()
    hf_config = json.loads(text)
    decoder = abstract_decoder(hf_config, precision)
    path = resolve(tokenizer_of, weights=False)
    tokenizer = (
        Tokenizer.from_folder(path) if has_tokenizer_files(path) else _tokenizer(open_checkpoint(path))
    )
    words = tokenizer.backend.get_vocab_size(with_added_tokens=True) if tokenizer else 0
    vocab = decoder.config.vocab_size
    if words > vocab:
        raise ValueError(
            f"the tokenizer of {tokenizer_of} has {words} tokens, more than the config's {vocab}"
        )
    random_weights(decoder, jax.random.key(0))
    digest = "random-" + hashlib.sha256(text.encode()).hexdigest()[:16]
    name = f"random:{Path(config).stem}"
    return Model(name, decoder, tokenizer, digest, time.perf_counter() - start)


def has_tokenizer_files(path: Path) -> bool:
    """Whether a folder holds a tokenizer.json: enough for random_model, which needs no weights."""
    return (path / "tokenizer.json").is_file()


def _tokenizer(checkpoint: SafetensorsFolder | GGUFFile) -> Tokenizer | None:
    if isinstance(checkpoint, GGUFFile):
        return _gguf_tokenizer(*_file_key(checkpoint.path))
    if has_tokenizer_files(checkpoint.folder):
        return Tokenizer.from_folder(checkpoint.folder)
    return None  # tiny test checkpoints are scored from token ids
