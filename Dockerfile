# syntax=docker/dockerfile:1
# spinf-jax's server image (docs/docker.md). GPU by default; `--build-arg VARIANT=cpu` builds the CPU one.
ARG VARIANT=gpu

# jax[cuda12] brings CUDA 12.9 and cuDNN as wheels, so the GPU base needs only what lets the NVIDIA container
# toolkit mount the driver: the `base` flavour (a cudnn-runtime base would hold a second copy, some GB).
FROM nvidia/cuda:12.9.1-base-ubuntu24.04 AS gpu
ENV SPINF_EXTRAS="--extra cuda --extra server --extra models"

FROM ubuntu:24.04 AS cpu
ENV SPINF_EXTRAS="--extra server --extra models"

FROM ${VARIANT}
ARG DEBIAN_FRONTEND=noninteractive
# Python 3.12 is Ubuntu 24.04's own (.python-version); git clones `--packs` repositories. The distribution
# pins the versions: hadolint's DL3008 would have us repeat them here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /usr/local/bin/uv

WORKDIR /app
ENV UV_PYTHON=python3.12 \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    PATH=/app/.venv/bin:$PATH
# The dependencies first, in a layer of their own that a change to the source does not rebuild. The extras
# are one word each: SPINF_EXTRAS is split on purpose.
COPY pyproject.toml uv.lock ./
# hadolint ignore=SC2086
RUN --mount=type=cache,target=/root/.cache/uv uv sync --locked --no-dev --no-install-project $SPINF_EXTRAS
# Then the project (editable, in /app: `parity --all` finds fixtures/ beside it); .dockerignore keeps out the
# rest.
COPY . .
# hadolint ignore=SC2086
RUN --mount=type=cache,target=/root/.cache/uv uv sync --locked --no-dev $SPINF_EXTRAS

# The process runs as root so that the one volume, /root/.cache, is writable whether it is a named volume or
# a folder of the host; docker/entrypoint.sh points every cache there.
VOLUME /root/.cache
EXPOSE 8000
# /health answers 200 once the model is loaded and every bucket program compiled, 503 while warming up (or
# after a failed load). The first start compiles for minutes on a GPU; the start period covers it.
HEALTHCHECK --start-period=10m --interval=15s --timeout=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# serve drains on SIGTERM: no new connections, requests in flight get up to 60 s, the queue is answered.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/bin/sh", "/app/docker/entrypoint.sh"]
