"""The device-memory cap (--device-memory-cap): the allocator is held to it where there is one to hold, and
the server refuses to serve a model whose weights and largest pass do not fit in it."""

import os
import shutil
import subprocess

GIB = 2**30


def cap_device_memory(gib: float) -> None:
    """Hold JAX's GPU allocator to `gib`. JAX takes a fraction of the device's memory
    (XLA_PYTHON_CLIENT_MEM_FRACTION), read when its backend starts: call this before. The device's size
    comes from nvidia-smi; without an NVIDIA GPU there is no allocator to hold, and only the start-up
    check applies."""
    total_mib = _first_gpu_mib()
    if total_mib:
        fraction = min(1.0, gib * 1024 / total_mib)
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"


def _first_gpu_mib() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    lines = out.stdout.split()
    return int(lines[0]) if out.returncode == 0 and lines and lines[0].isdigit() else None


def check_fits(needed_bytes: int, cap_gib: float | None) -> None:
    """Refuse (ValueError, which the server reports on /health and every request) when the largest pass
    needs more than the cap."""
    if cap_gib is not None and needed_bytes > cap_gib * GIB:
        raise ValueError(
            f"the weights and the largest pass need {needed_bytes / GIB:.2f} GiB, over --device-memory-cap "
            f"{cap_gib:g} GiB: use smaller --buckets, a lower precision, or a larger cap"
        )
