#!/usr/bin/env bash
# Run on the GPU machine at the start of a call (from the repository root, after prepare.sh here): installs
# the carried wheels and this checkout, and unpacks the tokenizer into /tmp/tok. A warm machine keeps them,
# so a later call returns at once.
set -euo pipefail
if python3 -c "import litestar, spinf_jax" 2>/dev/null && [ -f /tmp/tok/tokenizer.json ]; then exit 0; fi
wheels=.cache/device/wheels
python3 -m pip install -q --no-index --find-links "$wheels" gguf pyyaml jinja2 httpx tqdm pillow miniaudio \
  litestar msgspec prometheus-client uvicorn zstandard hatchling pytest hypothesis
python3 -m pip install -q --no-index --no-deps --no-build-isolation .
mkdir -p /tmp/tok
gunzip -c .cache/device/tokenizer/tokenizer.json.gz > /tmp/tok/tokenizer.json
cp .cache/device/tokenizer/tokenizer_config.json /tmp/tok/
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
