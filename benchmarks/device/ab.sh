#!/usr/bin/env bash
# Two versions side by side on one machine (run on the device from the repository root, after prepare.sh
# here). Variant V (A or B) is this tree with the files under .cache/device/ab/V laid over it (same relative
# paths; none: the tree as it is) and XLA_FLAGS=$FLAGS_V (empty unless given). Each goes through
# http_throughput.py's parts PARTS ("library,articles": the library, and one request per article, unless
# given) at CLIENTS clients (8,32 unless given), S seconds a part (15), in the order ORDER ("A B" unless given;
# "B A" in the next call), without the GEMM peaks unless PEAKS=1; PROFILE="32 clients" traces that part
# (served_profile.md). They share one compile cache unless CACHE=separate (needed where their programs
# differ without a flag to tell them apart). E.g. the old runner against this one:
#   mkdir -p .cache/device/ab/A/spinf_jax && git show 3b1f006:spinf_jax/runner.py > $_/runner.py
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
for v in A B; do
  rm -rf /tmp/tree$v && mkdir -p /tmp/tree$v && cp -r spinf_jax pallas_kernels packs /tmp/tree$v/
  [ -d .cache/device/ab/$v ] && cp -r .cache/device/ab/$v/. /tmp/tree$v/
done
cd benchmarks
for v in ${ORDER:-A B}; do
  name=ab-$v-$(date +%H%M%S)
  flags=FLAGS_$v
  extra=()
  [ "${PEAKS:-}" = 1 ] || extra+=(--no-peaks)
  [ -n "${PROFILE:-}" ] && extra+=(--profile-part "$PROFILE")
  XLA_FLAGS="${!flags:-}" PYTHONPATH=/tmp/tree$v JAX_PLATFORMS=cuda timeout ${T:-270} python3 http_throughput.py \
    --tokenizer /tmp/tok --out $OUT/$name --seconds ${S:-15} --parts ${PARTS:-library,articles} --clients ${CLIENTS:-8,32} \
    --compile-cache /tmp/xla$([ "${CACHE:-}" = separate ] && echo -$v) "${extra[@]}" > $OUT/$name.log 2>&1
  echo "$name (XLA_FLAGS=${!flags:-}) rc=$? $(date +%T)"; tail -5 $OUT/$name.log | cut -c1-250
  [ -d $OUT/$name ] && find $OUT/$name -type d -name profile -prune -exec rm -rf {} \;
done
