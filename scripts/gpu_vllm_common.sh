# Sourced by the scripts/gpu_vllm_*.sh runs on a GPU node: their
# environment (vLLM and its dependencies installed under /tmp/site, the
# CUDA libraries of the node's Python), and starting and stopping an
# `inferscale worker --engine vllm` in the background.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 INFERSCALE_HOME=/tmp/ishome
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
OUT=${OUT:-/tmp/out}
BIN=${BIN:-target/release/inferscale}

# start_worker LOG TIMEOUT_S ARGS…: runs `inferscale worker --engine vllm
# ARGS…` logging to LOG, sets WORKER to its pid and returns once it serves;
# exits the script if it dies or is not serving within TIMEOUT_S seconds.
start_worker() {
  local log=$1 limit=$2
  shift 2
  $BIN worker --engine vllm "$@" > "$log" 2>&1 &
  WORKER=$!
  local start
  start=$(date +%s)
  until grep -q "gRPC on" "$log"; do
    if ! kill -0 $WORKER 2>/dev/null; then echo "worker exited"; tail -40 "$log"; exit 1; fi
    if [ $(( $(date +%s) - start )) -gt "$limit" ]; then echo "worker not ready in $limit s"; tail -40 "$log"; exit 1; fi
    sleep 2
  done
  echo "worker ready after $(( $(date +%s) - start )) s"
}

# stop_worker PID…: SIGTERM to each (the worker last), waits up to 40 s for
# the worker, and says whether vLLM went with it.
stop_worker() {
  kill -TERM "$@"
  for _ in $(seq 40); do kill -0 $WORKER 2>/dev/null || break; sleep 1; done
  kill -0 $WORKER 2>/dev/null && echo "worker still running after SIGTERM"
  pgrep -f "vllm.entrypoints.cli.main" > /dev/null && echo "vLLM left running" || echo "vLLM stopped with the worker"
}
