// Shared helpers for InferScale's CUDA kernels. The kernel sources are
// concatenated after this file and compiled by NVRTC at start for the
// device's architecture (crates/cuda/src/kernels.rs).
#include <cuda_bf16.h>
#include <mma.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;

// Cosine and sine of `position * inv_freq[i]`: from the table for positions
// below `table_positions` (the same f32 values the CPU backend uses), else
// computed on the fly exactly as the table was.
__device__ __forceinline__ void rope_cos_sin(u32 position, int i, int half, const float* cos_t, const float* sin_t,
                                             const float* inv_freq, u32 table_positions, float* c, float* s) {
    if (position < table_positions) {
        *c = cos_t[(size_t)position * half + i];
        *s = sin_t[(size_t)position * half + i];
    } else {
        float a = (float)position * inv_freq[i];
        *c = cosf(a);
        *s = sinf(a);
    }
}

// Programmatic dependent launch (sm_90 and newer; no-ops before). A kernel
// launched with it (`launch_pdl` in crates/cuda/src/launch.rs) may start while
// the kernel before it in the stream still runs: it must call `pdl_begin`
// before it reads what earlier kernels wrote or writes anything, and may
// only read what no kernel writes (weights) before that. `pdl_begin` waits
// for the earlier grid to finish and its writes to be visible, then lets the
// next grid's blocks start (they then run their own prologue while this one
// works). A kernel launched without it runs as any other.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#define NEG_INF __int_as_float(0xff800000)

// Sum (or maximum) over a block of up to 1024 threads; `scratch` holds 32 floats.
template <bool MAX>
__device__ float block_reduce(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (int)threadIdx.x < warps ? scratch[threadIdx.x] : (MAX ? NEG_INF : 0.0f);
    if (warp == 0) v = MAX ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    return scratch[0];
}

__device__ float block_sum(float v, float* scratch) { return block_reduce<false>(v, scratch); }
__device__ float block_max(float v, float* scratch) { return block_reduce<true>(v, scratch); }

// D += A·B on the tensor cores, one m16n8k16 tile: A 16×16 bf16 (row-major
// fragment a0..a3), B 16×8 bf16 (column fragment b0, b1), D 16×8 f32.
__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight bf16 values in a 16-byte word, as floats and back.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const __nv_bfloat162* h = (const __nv_bfloat162*)&v;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 v;
    __nv_bfloat162* h = (__nv_bfloat162*)&v;
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
}

// 16 bytes global → shared without passing through registers (sm_80
// cp.async); `full` false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool full) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(full ? 16 : 0));
}
// 4 bytes global → shared (cp.async.ca); `full` false writes zeros.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool full) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(full ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8×8 bf16 tiles of a shared matrix into registers (lane l names the
// row of tile l >> 3): A fragments of one m16n8k16 MMA, or B fragments of
// two from a matrix stored [n][k].
__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const bf16* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

// Four 8×8 bf16 tiles of a row-major shared matrix, transposed on the way
// into registers: the B fragments of two m16n8k16 MMAs (lane l names row
// l & 15 of the 16, column block l >> 4).
__device__ __forceinline__ void ldmatrix_x4_trans(u32& b0, u32& b1, u32& b2, u32& b3, const bf16* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                 : "r"(a));
}
