#!/usr/bin/env bash
# Whether the seed job's bits hold across processes (run on the device from the repository root, after
# prepare.sh here). Each name in RUNS ("default default autotune0 autotune0" unless given) is one fresh
# process of launch_costs.py (12B shape, fp8 made-up weights, bucket 4,096) with no compile cache, so each
# compiles and autotunes on its own, under XLA_FLAGS=$FLAGS_<name> (FLAGS_autotune0 is
# --xla_gpu_autotune_level=0, XLA's default kernels without timing them, unless given). Prints each run's
# seed-job time and sha256: two processes of one name that print two digests gave different bits.
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
FLAGS_autotune0=${FLAGS_autotune0:---xla_gpu_autotune_level=0}
cd benchmarks
i=0
for v in ${RUNS:-default default autotune0 autotune0}; do
  i=$((i + 1))
  name=digest-$i-$v
  flags=FLAGS_$v
  XLA_FLAGS="${!flags:-}" JAX_PLATFORMS=cuda timeout ${T:-150} python3 launch_costs.py --tokenizer /tmp/tok/tokenizer.json \
    --buckets 4096 --repeats ${REPEATS:-3} --out $OUT/$name > $OUT/$name.log 2>&1
  echo "$name (XLA_FLAGS=${!flags:-}) rc=$? $(head -1 $OUT/$name.log | grep -o 'the seed job.*')"
done
