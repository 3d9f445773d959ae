#!/usr/bin/env bash
# The Triton wave kernel of the gated delta rule (gated_delta.wave_kernel) on the GPU, in one call (run on the
# device from the repository root, after prepare.sh here and
# `git show REV:pallas_kernels/gated_delta.py > .cache/device/gd_before.py` for the version to time against):
# 1. it compiles and agrees with the XLA waves at Qwen3.5's head shape (tests/test_gpu.py);
# 2. one layer's recurrence over the seed job's passes, XLA waves against the kernel (gated_delta_layer.py);
# 3. a short decision request of Kev's shape on the Qwen3.5-4B shape, the engine as it is against the engine
#    with the kernel in the layers (a copy of this tree whose Qwen3.5 layer asks tree_chunked for it), one
#    after the other in this call (latency_buckets.py, row tile $TILE, 256 unless given).
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
JAX_PLATFORMS=cuda timeout ${T1:-240} python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/test_gpu.py \
  -k gated_delta_wave > $OUT/wave-tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/wave-tests.log)"
(cd benchmarks && JAX_PLATFORMS=cuda timeout ${T2:-200} python3 gated_delta_layer.py --tokenizer /tmp/tok \
  --before ../.cache/device/gd_before.py --kernel --groups ${GROUPS:-1,4} --out $OUT/gdl > $OUT/gdl.log 2>&1; echo "layer rc=$?")
tail -8 $OUT/gdl.log | cut -c1-200
rm -rf /tmp/tree-kernel && mkdir -p /tmp/tree-kernel && cp -r spinf_jax pallas_kernels packs /tmp/tree-kernel/
sed -i 's/exports=slots.shape\[0\], width=wave_width()/exports=slots.shape[0], width=wave_width(), kernel=True/' \
  /tmp/tree-kernel/spinf_jax/models/qwen3_5.py
grep -c "kernel=True" /tmp/tree-kernel/spinf_jax/models/qwen3_5.py
for variant in xla kernel; do
  path=$([ $variant = kernel ] && echo /tmp/tree-kernel || echo "$PWD")
  (cd benchmarks && PYTHONPATH=$path JAX_PLATFORMS=cuda timeout ${T3:-150} python3 latency_buckets.py \
    --tokenizer /tmp/tok/tokenizer.json --shape qwen3.5-4b --tiles ${TILE:-256} --big 1024 \
    --out $OUT/latency-$variant > $OUT/latency-$variant.log 2>&1; echo "latency $variant rc=$?")
  tail -1 $OUT/latency-$variant.log | cut -c1-200
done
