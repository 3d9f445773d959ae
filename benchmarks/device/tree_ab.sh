#!/usr/bin/env bash
# Two versions of the code side by side on one machine (run on the device from the repository root, after
# prepare.sh here): variant V is this tree with the files under .cache/device/ab/V laid over it (same relative
# paths; none: the tree as it is), each through http_throughput.py's library part and one request per article
# at CLIENTS (8,32 unless given) clients, in the order ORDER ("A B" unless given; "B A" in the next call).
# Both share one compile cache: give them the same programs, or set CACHE=separate.
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
for v in A B; do
  rm -rf /tmp/tree$v && mkdir -p /tmp/tree$v && cp -r spinf_jax pallas_kernels packs /tmp/tree$v/
  [ -d .cache/device/ab/$v ] && cp -r .cache/device/ab/$v/. /tmp/tree$v/
done
cd benchmarks
for v in ${ORDER:-A B}; do
  name=tree-$v-$(date +%H%M%S)
  cache=/tmp/xla$([ "${CACHE:-}" = separate ] && echo -$v)
  PYTHONPATH=/tmp/tree$v JAX_PLATFORMS=cuda timeout ${T:-270} python3 http_throughput.py --tokenizer /tmp/tok \
    --out $OUT/$name --seconds ${S:-15} --parts library,articles --clients ${CLIENTS:-8,32} --no-peaks \
    --compile-cache $cache > $OUT/$name.log 2>&1
  echo "$name rc=$? $(date +%T)"; tail -5 $OUT/$name.log | cut -c1-250
done
