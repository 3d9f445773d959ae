#!/usr/bin/env bash
# GPU row tiles side by side on one machine (run on the device from the repository root, after prepare.sh):
# two copies of the tree whose loader.default_row_tile differ on GPUs (A=1024 and B=2048 unless given), each
# through http_throughput.py's library and 8-client parts with the same buckets, in the order ORDER ("A B",
# then "B A" in the next call). Used for the twenty-sixth session's A/B (benchmarks/results/README.md).
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1
for v in A B; do
  tile=$([ $v = A ] && echo ${A:-1024} || echo ${B:-2048})
  rm -rf /tmp/tile$v && mkdir -p /tmp/tile$v && cp -r spinf_jax pallas_kernels packs /tmp/tile$v/
  sed -i "/def default_row_tile/,/return/ s/else [0-9]*$/else $tile/" /tmp/tile$v/spinf_jax/loader.py
  grep -q "else $tile$" /tmp/tile$v/spinf_jax/loader.py || { echo "row tile $v not set"; exit 3; }
done
cd benchmarks
for v in ${ORDER:-A B}; do
  name=tile-$v-$(date +%H%M%S)
  PYTHONPATH=/tmp/tile$v JAX_PLATFORMS=cuda timeout ${T:-280} python3 http_throughput.py --tokenizer /tmp/tok \
    --out $OUT/$name --seconds ${S:-15} --parts library,articles --clients 8 \
    --buckets ${BUCKETS:-4096,6144,8192,10240,12288,14336,16384} --no-peaks --compile-cache /tmp/xla > $OUT/$name.log 2>&1
  echo "$name rc=$?"; grep -E "^library|8 clients" $OUT/$name.log | tail -3
done
