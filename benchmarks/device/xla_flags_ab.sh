#!/usr/bin/env bash
# XLA flags side by side on one machine (run on the device from the repository root, after prepare.sh here):
# http_throughput.py's library part and one request per article at 8 and 32 clients, once with XLA_FLAGS=$A
# (empty unless given) and once with XLA_FLAGS=$B, in the order ORDER ("A B" unless given; "B A" in the next
# call). The 32-client part is traced (served_profile.md), the 8-client one is not: it is the one to compare.
set -u
bash benchmarks/device/setup.sh > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 3; }
cd benchmarks
for v in ${ORDER:-A B}; do
  flags=$([ $v = A ] && echo "${A:-}" || echo "${B:-}")
  name=flags-$v-$(date +%H%M%S)
  XLA_FLAGS="$flags" JAX_PLATFORMS=cuda timeout ${T:-270} python3 http_throughput.py --tokenizer /tmp/tok \
    --out $OUT/$name --seconds ${S:-15} --parts library,articles --clients 8,32 --profile-part "32 clients" \
    --compile-cache /tmp/xla-$v > $OUT/$name.log 2>&1
  echo "$name ($flags) rc=$? $(date +%T)"; tail -14 $OUT/$name.log | cut -c1-250
  find $OUT/$name -type d -name profile -prune -exec rm -rf {} \;
done
