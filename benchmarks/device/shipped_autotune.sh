#!/usr/bin/env bash
# Whether XLA's autotuning results, carried from one process to fresh ones, give the fresh ones the first one's
# bits (run on the device from the repository root, after prepare.sh here). Each run is a fresh process of
# launch_costs.py (12B shape, fp8 made-up weights, bucket 4,096) with JAX's persistent cache in a folder of its
# own: jax then keeps XLA's per-fusion autotuning results in its subfolder xla_gpu_per_fusion_autotune_cache_dir
# (jax's default jax_persistent_cache_enable_xla_caches) and reads what is there before timing kernels.
# - tuned: an empty folder; it autotunes and writes the results;
# - shipped-1, shipped-2: a folder holding only a copy of tuned's results (no compiled programs): each
#   compiles everything, reading the kernels' choices instead of timing them;
# - fresh: an empty folder again (autotunes on its own, as a server without a cache does).
# Prints each run's seed-job time and sha256: shipped-N with tuned's digest means the shipped results pin the
# bits; fresh's shows whether this run's autotuning happened to agree anyway. Also the results' size, and a
# tarball of them in $OUT.
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
RESULTS=xla_gpu_per_fusion_autotune_cache_dir
run() {  # name, cache folder
  (cd benchmarks && JAX_COMPILATION_CACHE_DIR=$2 JAX_PLATFORMS=cuda timeout ${T:-150} python3 launch_costs.py \
    --tokenizer /tmp/tok/tokenizer.json --buckets 4096 --repeats ${REPEATS:-3} --out $OUT/$1 > $OUT/$1.log 2>&1)
  echo "$1 rc=$? $(head -1 $OUT/$1.log | grep -o 'the seed job.*')"
}
rm -rf /tmp/at-*
run tuned /tmp/at-tuned
echo "results: $(find /tmp/at-tuned/$RESULTS -type f | wc -l) files, $(du -sh /tmp/at-tuned/$RESULTS | cut -f1)"
tar -czf $OUT/autotune-results.tgz -C /tmp/at-tuned $RESULTS
for i in 1 2; do
  mkdir -p /tmp/at-$i && cp -r /tmp/at-tuned/$RESULTS /tmp/at-$i/
  run shipped-$i /tmp/at-$i
done
run fresh /tmp/at-fresh
