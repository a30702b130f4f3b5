// GEMMs of at most eight rows — a decode step of a few sequences — are a
// read of the weight and little else: out[r, c] = Σ_k x[r, k] · w[c, k]
// (+ bias[c]). cuBLAS's kernels read the small weights of a 1.5B model at a
// quarter of HBM bandwidth (ncu on an H100: a 1,536 × 1,536 weight, 4.7 MB,
// at 0.67 TB/s — a few dozen blocks, few loads in flight); the tuner
// (crates/cuda/src/gemm.rs) times this kernel beside them and keeps it only
// for shapes where it wins.
//
// `split` warps per output column c: each lane streams 16-byte words of w's
// row c (consecutive lanes, consecutive words: one 512-byte read per warp
// per word) and issues GEMV_UNROLL of them before using any, so that even a
// weight of few columns keeps enough bytes in flight to saturate HBM. The
// weight is read once, so it bypasses L1 (`L1::no_allocate`) and leaves L1
// to x, which every warp reads. Each lane sums its words' products in f32 in
// order, then the warp adds the lanes' sums (a tree) and the column's warps
// their sums in order; the bias, when given,
// is added to the bf16-rounded product exactly as `add_bias` would after an
// unfused GEMM. Needs k % 8 == 0 and x, w 16-byte aligned (the caller checks).
#define GEMV_UNROLL 8

__device__ __forceinline__ uint4 ld_streaming(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// G = 1: out[r, c] = x[r] · w[c] (+ bias[c]), c < n. G = 2 (gated, the
// MLP's fused gate and up projections, w of 2n rows): out[r, c] =
// silu(g) · u with g = x[r] · w[c] and u = x[r] · w[n + c] (each + bias,
// rounded to bf16 first), the same bits as this kernel's G = 1 over 2n
// columns followed by `silu_mul`, one pass and no [rows, 2n] intermediate.
template <int R, int G>
__device__ void gemv_rows(bf16* out, const bf16* x, const bf16* w, const bf16* bias, int rows, int n, int k,
                          int split) {
    __shared__ float partial[8][G][R];  // per warp of the (at most 8-warp) block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.x * ((blockDim.x >> 5) / split) + warp / split, slice = warp % split;
    const bool live = col < n;
    const uint4* wr[G];
#pragma unroll
    for (int g = 0; g < G; g++) wr[g] = (const uint4*)(w + (size_t)(live ? col + g * n : 0) * k);
    const int words = live ? k >> 3 : 0, stride = 32 * split;
    float acc[G][R];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[g][r] = 0.0f;
    // The first words of w are requested before waiting for the kernel
    // that writes x (see pdl_begin): launched early, this kernel has its
    // weight on the way while that one finishes.
    uint4 wv[G][GEMV_UNROLL];
    const int first = slice * 32 + lane;
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int i = first + u * stride;
            wv[g][u] = i < words ? ld_streaming(wr[g] + i) : make_uint4(0, 0, 0, 0);
        }
    pdl_begin();
    for (int base = first; base < words; base += stride * GEMV_UNROLL) {
        if (base != first)
#pragma unroll
            for (int g = 0; g < G; g++)
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; u++) {
                    const int i = base + u * stride;
                    wv[g][u] = i < words ? ld_streaming(wr[g] + i) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int i = base + u * stride;
            if (i >= words) break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= rows) break;
                float xf[8];
                unpack8(__ldg((const uint4*)(x + (size_t)r * k) + i), xf);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float wf[8];
                    unpack8(wv[g][u], wf);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[g][r] = fmaf(wf[e], xf[e], acc[g][r]);
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[g][r] = warp_sum(acc[g][r]);
    if (split > 1) {
        // The column's warps add their slices' sums in slice order.
        if (lane == 0)
#pragma unroll
            for (int g = 0; g < G; g++)
#pragma unroll
                for (int r = 0; r < R; r++) partial[warp][g][r] = acc[g][r];
        __syncthreads();
        if (slice != 0) return;
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                acc[g][r] = partial[warp][g][r];
                for (int s = 1; s < split; s++) acc[g][r] += partial[warp + s][g][r];
            }
    }
    if (lane != 0 || !live) return;
    float b[G];
#pragma unroll
    for (int g = 0; g < G; g++) b[g] = bias ? __bfloat162float(bias[col + g * n]) : 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= rows) break;
        float y[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            y[g] = acc[g][r];
            if (bias) y[g] = __bfloat162float(__float2bfloat16(y[g])) + b[g];
        }
        if (G == 1) {
            out[(size_t)r * n + col] = __float2bfloat16(y[0]);
        } else {
            // As silu_mul computes it from the bf16 gate and up values.
            const float gv = __bfloat162float(__float2bfloat16(y[0]));
            const float uv = __bfloat162float(__float2bfloat16(y[G - 1]));
            out[(size_t)r * n + col] = __float2bfloat16(gv / (1.0f + __expf(-gv)) * uv);
        }
    }
}

// One kernel per row bucket (rows ≤ R), plain and gated; `bias` may be null.
// Blocks of 256 threads: 8 / `split` columns a block, each read by `split`
// warps, warp s taking the row's 512-byte chunks s, s + split, … (the
// tuner times each split: one warp a column suits short rows, several suit
// long ones).
#define GEMV(R)                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) gemv_r##R(bf16* out, const bf16* x, const bf16* w,         \
                                                                const bf16* bias, int rows, int n, int k,         \
                                                                int split) {                                      \
        gemv_rows<R, 1>(out, x, w, bias, rows, n, k, split);                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) gemv_silu_r##R(bf16* out, const bf16* x, const bf16* w,    \
                                                                     const bf16* bias, int rows, int n, int k,    \
                                                                     int split) {                                 \
        gemv_rows<R, 2>(out, x, w, bias, rows, n, k, split);                                                      \
    }

GEMV(1)
GEMV(2)
GEMV(4)
GEMV(8)
