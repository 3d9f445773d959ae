"""Bucket programs go to JAX's persistent compilation cache, so a restarted server reuses them."""

import subprocess
import sys
from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny" / "qwen3"
WARM = (
    "import sys; from spinf_jax.engine import Engine, use_compilation_cache; "
    "from spinf_jax.loader import load_model; from spinf_jax.packer import Buckets; "
    "use_compilation_cache(sys.argv[1]); "
    f"Engine(load_model({str(TINY)!r}, 'fp32'), Buckets((256, 512), block=64)).warmup()"
)


@pytest.mark.slow  # two subprocesses that import JAX and compile
def test_restart_reuses_compiled_programs(tmp_path):
    def start() -> set[str]:
        subprocess.run([sys.executable, "-c", WARM, str(tmp_path)], check=True, capture_output=True)
        return {p.name for p in tmp_path.rglob("*") if p.is_file()}

    first = start()
    assert len(first) >= 2  # at least one program per bucket
    assert start() == first  # the second start compiled nothing new: every program came from the cache
