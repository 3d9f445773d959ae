#!/usr/bin/env bash
# Run here, from the repository root, before a GPU call: what the GPU machine lacks, into .cache/device
# (git ignores it; pass carry [".cache/device"] to the device tool). That machine reaches no package index
# and has jax, flax, transformers, torch and numpy already (docs in ../shared/ENGINEERING.md): it gets the
# wheels of our other dependencies (Python 3.12, manylinux) and Gemma 3's tokenizer, which the benchmarks at
# real shapes read (a folder with tokenizer.json), taken from the default model's GGUF file.
set -euo pipefail
out=.cache/device
mkdir -p "$out/wheels" "$out/tokenizer"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$out/wheels" \
  gguf==0.19.0 pyyaml==6.0.4 jinja2==3.1.6 httpx==0.28.1 tqdm==4.70.1 pillow==13.0.0 miniaudio==1.71 \
  litestar==2.25.0 msgspec==0.22.0 prometheus-client==0.26.0 uvicorn==0.54.0 zstandard==0.25.0 hatchling \
  pytest==9.2.0 hypothesis==6.170.15 2>&1 | grep -v "is ignored" || true
rm -f "$out"/wheels/numpy-*  # the machine's own numpy stays (jax was built against it)
rm -f "$out"/wheels/pillow-*  # its image has Pillow, and the 7 MB wheel would take a call past 64 MiB
.venv/bin/python - "$out/tokenizer" <<'PY'
import sys
from pathlib import Path

from spinf_jax import loader

gguf = loader.resolve(loader.DEFAULT_MODEL)
loader._gguf_tokenizer(*loader._file_key(gguf)).save(Path(sys.argv[1]))
PY
gzip -f -9 "$out/tokenizer/tokenizer.json"  # 33 MB → 5 MB: a call carries 64 MiB at most
du -sh "$out"
