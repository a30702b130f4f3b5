# Environment for running InferScale's CUDA backend on a machine whose CUDA
# libraries come from the PyPI wheels (nvidia-*-cu13) of its Python, as on
# our H200 nodes: source it before `inferscale … --backend cuda`.
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH="$site/nvidia/cu13/lib:$site/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
if [ -z "${INFERSCALE_CUDA_INCLUDE:-}" ]; then
    for d in /usr/local/cuda/targets/x86_64-linux/include /usr/local/cuda-*/targets/x86_64-linux/include \
        "$site/nvidia/cu13/include"; do
        if [ -f "$d/cuda_bf16.h" ]; then export INFERSCALE_CUDA_INCLUDE="$d"; break; fi
    done
fi
