# syntax=docker/dockerfile:1.7
#
# The InferScale router: stateless HTTP front end (OpenAI-compatible API on
# 8080; /healthz, /readyz, /metrics). Build from the repository root:
#
#   docker build -f deploy/docker/router.Dockerfile -t inferscale-router:0.1.0 .
#
# The context is the repository root; router.Dockerfile.dockerignore beside
# this file (BuildKit reads <Dockerfile>.dockerignore) keeps it to the sources.
# No HEALTHCHECK: Kubernetes probes /healthz and /readyz.
# checkov:skip=CKV_DOCKER_2:Kubernetes liveness/readiness probes (deploy/helm) check the process; a Docker HEALTHCHECK is ignored by the kubelet.

ARG RUST_VERSION=1.89
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
WORKDIR /src
COPY . .
# The CUDA backend is loaded with dlopen at run time, so the default feature
# set builds without a CUDA toolkit; the router never opens it. protoc comes
# vendored with the build dependencies.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p inferscale-cli \
    && install -D -m 0755 target/release/inferscale /out/inferscale

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
ARG APP_UID=10001
# ca-certificates: OTLP over TLS to an external collector; tini: PID 1 that
# forwards SIGTERM (graceful shutdown) and reaps children.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid "${APP_UID}" inferscale \
    && useradd --system --uid "${APP_UID}" --gid inferscale --home-dir /home/inferscale \
       --create-home --shell /usr/sbin/nologin inferscale
COPY --from=builder /out/inferscale /usr/local/bin/inferscale
ENV INFERSCALE_API_LISTEN=0.0.0.0:8080 \
    INFERSCALE_HOME=/home/inferscale/.cache/inferscale
USER 10001:10001
WORKDIR /home/inferscale
EXPOSE 8080
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/inferscale"]
CMD ["router"]
