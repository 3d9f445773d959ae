"""`system_fingerprint`: everything that can change a score's bits, named part by part and hashed.

Equal fingerprints promise the same bits. The parts are what our code decides (the checkpoint, the precision,
the engine's arithmetic and its pass shapes) and what it runs on: jax and jaxlib, the backend and device
model, `XLA_FLAGS` (they choose passes and kernels), on a GPU the CUDA libraries XLA calls (cuBLAS picks GEMM
algorithms by version, cuDNN its kernels) and the driver, and an autotuning results file the flags load; on
the CPU the host's processor and vector extensions, since XLA:CPU compiles for the host it runs on (a machine
with AVX-512 vectorises reductions in other widths and rounds them otherwise). `/health` lists the parts, so
two servers whose fingerprints differ say why.

What no part can name: GEMM kernels that XLA's GPU autotuner picked by timing them in this process
(docs/batch-invariance.md: the compile cache keeps them across restarts).
"""

import contextlib
import hashlib
import os
import platform
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import jax
import jaxlib

# The CPU extensions that change what XLA:CPU emits for our programs (vector widths, fused multiply-adds,
# half-precision conversions and dot products); the rest of /proc/cpuinfo's flags do not.
CPU_EXTENSIONS = re.compile(r"^(sse4_2|avx|avx2|fma|f16c|avx512\w*|avx_vnni\w*|amx\w*)$")
# jaxlib's CUDA plugin reports these (each a number, the library's version as it is loaded)
CUDA_LIBRARIES = (
    "cuda_driver_get_version",
    "cuda_runtime_get_version",
    "cublas_get_version",
    "cudnn_get_version",
    "cusolver_get_version",
    "cufft_get_version",
    "cusparse_get_version",
)
AUTOTUNE_RESULTS_FLAG = "--xla_gpu_load_autotune_results_from="


def parts(device: jax.Device, arithmetic: dict[str, str]) -> dict[str, str]:
    """The named parts of a fingerprint: `arithmetic` (what the engine decides: checkpoint, precision, pass
    shapes, ENGINE_VERSION) followed by what the process runs on."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    named = {
        **arithmetic,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": device.platform,
        "device": device.device_kind,  # another GPU model may compile other kernels
        "platform_version": device.client.platform_version,
        "xla_flags": " ".join(sorted(flags)),
    }
    if device.platform == "gpu":
        named.update(_cuda_libraries())
        named.update(_cuda_plugin())
    if device.platform == "cpu":
        named.update(_host_processor())
    for flag in flags:
        if flag.startswith(AUTOTUNE_RESULTS_FLAG):
            named["autotune_results"] = _file_digest(Path(flag.removeprefix(AUTOTUNE_RESULTS_FLAG)))
    return named


def digest(named: dict[str, str]) -> str:
    """The fingerprint of `parts(...)`: a part's name is hashed with its value, so a part that is added or
    dropped changes it too."""
    joined = "|".join(f"{k}={v}" for k, v in named.items())
    return "fp_" + hashlib.sha256(joined.encode()).hexdigest()[:16]


def _cuda_libraries() -> dict[str, str]:
    from jax._src.lib import cuda_versions  # None where jaxlib has no CUDA plugin

    if cuda_versions is None:
        return {}
    found = {}
    for name in CUDA_LIBRARIES:
        call = getattr(cuda_versions, name, None)
        if call is not None:
            found[name.removesuffix("_get_version")] = str(call())
    return found


def _cuda_plugin() -> dict[str, str]:
    found = {}
    for package in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def _host_processor() -> dict[str, str]:
    """The processor's model and the vector extensions XLA:CPU may use (Linux's /proc/cpuinfo; elsewhere
    what `platform` says)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.processor() or platform.machine()}
    first = info.split("\n\n")[0]  # processor 0's block
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in first.splitlines())
        if value
    )
    extensions = sorted(f for f in fields.get("flags", "").split() if CPU_EXTENSIONS.match(f))
    return {"cpu": fields.get("model name", platform.machine()), "cpu_extensions": " ".join(extensions)}


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as e:  # XLA fails on it too, at the first compile; say so here
        return f"unreadable ({e.strerror})"
