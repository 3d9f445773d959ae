#!/usr/bin/env bash
# The decision APIs on a GPU (run on the device from the repository root, after prepare.sh here): System
# One's invariance tests in tests/test_gpu.py (tiny fixtures of every family, bf16 and fp8), then
# decisions_http.py at real shapes with fp8 made-up weights: Kev's shape (a new ~100-token state, 6
# questions) through /v1/systemone, /decide/shared and one request per question, at 1 and 64 clients.
# PARTS picks what runs, in order (default "tests qwen3.5-4b gemma-3-12b"); S is each part's seconds.
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
tail -2 $OUT/setup.log
for part in ${PARTS:-tests qwen3.5-4b gemma-3-12b}; do
  if [ "$part" = tests ]; then
    JAX_PLATFORMS=cuda timeout ${T_TESTS:-300} python3 -m pytest -o addopts="" -q -p no:cacheprovider \
      tests/test_gpu.py -k decision > $OUT/tests.log 2>&1
    echo "tests rc=$?"; tail -6 $OUT/tests.log
    continue
  fi
  (cd benchmarks && JAX_PLATFORMS=cuda timeout ${T:-420} python3 decisions_http.py --shape "$part" \
    --tokenizer /tmp/tok --clients ${CLIENTS:-1,64} --seconds ${S:-15} --out $OUT/$part > $OUT/$part.log 2>&1)
  echo "$part rc=$?"; grep -v '^{' $OUT/$part.log | tail -12
done
