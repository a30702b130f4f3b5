// Row-wise and elementwise kernels: embedding gather, norms, activations,
// residual adds, row selection. Activations are bf16; arithmetic is f32.

extern "C" __global__ void embedding_gather(bf16* out, const bf16* table, const u32* ids, int cols) {
    pdl_begin();
    const bf16* src = table + (size_t)ids[blockIdx.x] * cols;
    bf16* dst = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

extern "C" __global__ void select_rows(bf16* out, const bf16* x, const u32* rows, int cols) {
    const bf16* src = x + (size_t)rows[blockIdx.x] * cols;
    bf16* dst = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

// One block per row: y = x / sqrt(mean(x²) + eps) · w.
extern "C" __global__ void rms_norm(bf16* out, const bf16* x, const bf16* w, int cols, float eps) {
    __shared__ float scratch[32];
    const bf16* row = x + (size_t)blockIdx.x * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = __bfloat162float(row[c]);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / cols + eps);
    bf16* dst = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        dst[c] = __float2bfloat16(__bfloat162float(row[c]) * inv * __bfloat162float(w[c]));
}

// The end of rms_norm_v8 and add_rms_norm_v8, called by every thread of the
// block (it reduces across it): the thread's 8 values `f` of the row are
// normalised by the row's root mean square and stored times `w`.
__device__ __forceinline__ void rms_norm8_store(float* f, bool live, int cols, float eps, const bf16* w,
                                                bf16* out_row, float* scratch) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) ss += f[i] * f[i];
    float inv = rsqrtf(block_sum(ss, scratch) / cols + eps);
    if (!live) return;
    float g[8];
    unpack8(((const uint4*)w)[threadIdx.x], g);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = f[i] * inv * g[i];
    ((uint4*)out_row)[threadIdx.x] = pack8(f);
}

// rms_norm for widths that are multiples of 8 and at most 8192: one thread
// per 8 values, held in registers between the reduction and the write.
extern "C" __global__ void rms_norm_v8(bf16* out, const bf16* x, const bf16* w, int cols, float eps) {
    pdl_begin();
    __shared__ float scratch[32];
    const bool live = threadIdx.x * 8 < cols;
    float f[8];
    unpack8(live ? ((const uint4*)(x + (size_t)blockIdx.x * cols))[threadIdx.x] : make_uint4(0, 0, 0, 0), f);
    rms_norm8_store(f, live, cols, eps, w, out + (size_t)blockIdx.x * cols, scratch);
}

// The residual add and the norm after it, fused: x += y (in bf16, as
// add_assign rounds it), then out = rms_norm_v8(x). Same widths as rms_norm_v8.
extern "C" __global__ void add_rms_norm_v8(bf16* out, bf16* x, const bf16* y, const bf16* w, int cols, float eps) {
    pdl_begin();
    __shared__ float scratch[32];
    const int v = threadIdx.x;
    const bool live = v * 8 < cols;
    uint4 sum = make_uint4(0, 0, 0, 0);
    if (live) {
        uint4 a = ((const uint4*)(x + (size_t)blockIdx.x * cols))[v];
        uint4 b = ((const uint4*)(y + (size_t)blockIdx.x * cols))[v];
        __nv_bfloat162* a2 = (__nv_bfloat162*)&a;
        const __nv_bfloat162* b2 = (const __nv_bfloat162*)&b;
        __nv_bfloat162* s2 = (__nv_bfloat162*)&sum;
#pragma unroll
        for (int i = 0; i < 4; i++) s2[i] = __hadd2(a2[i], b2[i]);
        ((uint4*)(x + (size_t)blockIdx.x * cols))[v] = sum;
    }
    float f[8];
    unpack8(sum, f);
    rms_norm8_store(f, live, cols, eps, w, out + (size_t)blockIdx.x * cols, scratch);
}

// One block per row: y = (x − mean) / sqrt(var + eps) · w + b.
extern "C" __global__ void layer_norm(bf16* out, const bf16* x, const bf16* w, const bf16* b, int cols, float eps) {
    __shared__ float scratch[32];
    const bf16* row = x + (size_t)blockIdx.x * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += __bfloat162float(row[c]);
    float mean = block_sum(s, scratch) / cols;
    float var = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float d = __bfloat162float(row[c]) - mean;
        var += d * d;
    }
    float inv = rsqrtf(block_sum(var, scratch) / cols + eps);
    bf16* dst = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        dst[c] = __float2bfloat16((__bfloat162float(row[c]) - mean) * inv * __bfloat162float(w[c]) +
                                  __bfloat162float(b[c]));
}

extern "C" __global__ void gelu(bf16* out, const bf16* x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = __bfloat162float(x[i]);
        out[i] = __float2bfloat16(0.5f * v * (1.0f + erff(v * 0.70710678118654752f)));
    }
}

// Rows of `gate_up` are [gate | up], `half` wide each; out = silu(gate) · up.
// Grid (column blocks, rows), two columns per thread (`half` is even).
extern "C" __global__ void silu_mul(bf16* out, const bf16* gate_up, int half) {
    pdl_begin();
    const __nv_bfloat162* g2 = (const __nv_bfloat162*)(gate_up + (size_t)blockIdx.y * 2 * half);
    const __nv_bfloat162* u2 = (const __nv_bfloat162*)(gate_up + (size_t)blockIdx.y * 2 * half + half);
    __nv_bfloat162* o2 = (__nv_bfloat162*)(out + (size_t)blockIdx.y * half);
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < half / 2; c += gridDim.x * blockDim.x) {
        float2 g = __bfloat1622float2(g2[c]), u = __bfloat1622float2(u2[c]);
        o2[c] = __floats2bfloat162_rn(g.x / (1.0f + __expf(-g.x)) * u.x, g.y / (1.0f + __expf(-g.y)) * u.y);
    }
}

// Columns start .. start + width of every row of x (x_cols wide). Grid
// (column blocks, rows); `vec` = 8 when width, x_cols and start are
// multiples of 8 (16-byte copies), else 1.
extern "C" __global__ void copy_cols(bf16* out, const bf16* x, int width, int x_cols, int start, int vec) {
    const bf16* src = x + (size_t)blockIdx.y * x_cols + start;
    bf16* dst = out + (size_t)blockIdx.y * width;
    if (vec == 8) {
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width / 8; c += gridDim.x * blockDim.x)
            ((uint4*)dst)[c] = ((const uint4*)src)[c];
    } else {
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) dst[c] = src[c];
    }
}

// x += y over n elements (n even: activations have even widths).
extern "C" __global__ void add_assign(bf16* x, const bf16* y, size_t n) {
    pdl_begin();
    __nv_bfloat162* x2 = (__nv_bfloat162*)x;
    const __nv_bfloat162* y2 = (const __nv_bfloat162*)y;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n / 2; i += (size_t)gridDim.x * blockDim.x)
        x2[i] = __hadd2(x2[i], y2[i]);
}

// x[r, c] += b[c] for every row.
extern "C" __global__ void add_bias(bf16* x, const bf16* b, size_t n, int cols) {
    pdl_begin();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(__bfloat162float(x[i]) + __bfloat162float(b[i % cols]));
}

// Greedy decoding reduces each row of logits to the index of its largest
// value on the device, the lowest index on ties (as the CPU's argmax), and
// copies one id per row to the host instead of the whole vocabulary. This
// keeps the better of two (value, index) pairs by that rule.
__device__ __forceinline__ void argmax_merge(float& best, int& idx, float ob, int oi) {
    if (ob > best || (ob == best && oi < idx)) {
        best = ob;
        idx = oi;
    }
}

// One block per row: out[row] = Σ (a − b)² over the row (kv+blend's
// deviation of recomputed values from injected ones).
extern "C" __global__ void row_sq_distance(float* out, const bf16* a, const bf16* b, int cols) {
    __shared__ float scratch[32];
    const size_t off = (size_t)blockIdx.x * cols;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float d = __bfloat162float(a[off + c]) - __bfloat162float(b[off + c]);
        acc += d * d;
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// kv+blend's question rank. One block per (query row, head): the softmax
// of scale·q·k over the n keys of the head's KV group (online max and sum
// on the first pass, the dot products recomputed on the second), each
// key's probability added to mass[key]. `mass` starts at zero; q is
// [rows, heads·head_dim], k [n, kv_heads·head_dim], head_dim ≤ 256.
extern "C" __global__ void attention_mass(float* mass, const bf16* q, const bf16* k, int n, int heads, int kv_heads,
                                          int head_dim, float scale) {
    __shared__ float scratch[32];
    __shared__ float qs[256];
    const int row = blockIdx.x / heads, h = blockIdx.x % heads;
    const int g = h / (heads / kv_heads);
    const bf16* qh = q + ((size_t)row * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = __bfloat162float(qh[d]) * scale;
    __syncthreads();
    const size_t stride = (size_t)kv_heads * head_dim;
    const bf16* kg = k + (size_t)g * head_dim;
    float m = NEG_INF, s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const bf16* kj = kg + j * stride;
        float l = 0.0f;
        for (int d = 0; d < head_dim; d++) l += qs[d] * __bfloat162float(kj[d]);
        if (l > m) {
            s = s * __expf(m - l) + 1.0f;
            m = l;
        } else {
            s += __expf(l - m);
        }
    }
    const float M = block_max(m, scratch);
    const float S = block_sum(m == NEG_INF ? 0.0f : s * __expf(m - M), scratch);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const bf16* kj = kg + j * stride;
        float l = 0.0f;
        for (int d = 0; d < head_dim; d++) l += qs[d] * __bfloat162float(kj[d]);
        atomicAdd(&mass[j], __expf(l - M) / S);
    }
}

// The (value, index) pair of the largest value among this block's threads,
// lowest index on ties, in thread 0.
__device__ void block_argmax(float& best, int& idx) {
    __shared__ float sbest[32];
    __shared__ int sidx[32];
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(best, idx, __shfl_down_sync(0xffffffff, best, o), __shfl_down_sync(0xffffffff, idx, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        sbest[warp] = best;
        sidx[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? sbest[lane] : NEG_INF;
        idx = lane < warps ? sidx[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1)
            argmax_merge(best, idx, __shfl_down_sync(0xffffffff, best, o), __shfl_down_sync(0xffffffff, idx, o));
    }
}

// A row's argmax in two steps, so that a vocabulary's row is read by many
// blocks at once (one block reading 150k logits alone took 13 µs on an
// H100, most of it waiting on memory; ~75 blocks and the merge take 7): block (p, row) reduces columns [p·chunk, (p+1)·chunk)
// into part_best/part_idx[row · parts + p]; `argmax_merge_parts` then takes
// the best part of each row. `chunk` is a multiple of 8 when `cols` is
// (16-byte loads).
extern "C" __global__ void argmax_parts(float* part_best, int* part_idx, const bf16* x, int cols, int chunk) {
    pdl_begin();
    const int row = blockIdx.y, parts = gridDim.x, begin = blockIdx.x * chunk, end = min(cols, begin + chunk);
    const bf16* r = x + (size_t)row * cols;
    float best = NEG_INF;
    int idx = 0x7fffffff;
    if ((cols & 7) == 0) {
        for (int c8 = begin / 8 + threadIdx.x; c8 * 8 < end; c8 += blockDim.x) {
            float f[8];
            unpack8(((const uint4*)r)[c8], f);
#pragma unroll
            for (int i = 0; i < 8; i++) argmax_merge(best, idx, f[i], c8 * 8 + i);
        }
    } else {
        for (int c = begin + threadIdx.x; c < end; c += blockDim.x) argmax_merge(best, idx, __bfloat162float(r[c]), c);
    }
    block_argmax(best, idx);
    if (threadIdx.x == 0) {
        part_best[(size_t)row * parts + blockIdx.x] = best;
        part_idx[(size_t)row * parts + blockIdx.x] = idx;
    }
}

// One block per row: the best of the row's `parts` partial results (an
// index of 0x7fffffff — a part that saw only −inf or NaN — is read as 0, as
// the host's argmax of such a row).
extern "C" __global__ void argmax_merge_parts(u32* out, const float* part_best, const int* part_idx, int parts) {
    pdl_begin();
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x)
        argmax_merge(best, idx, part_best[(size_t)blockIdx.x * parts + p], part_idx[(size_t)blockIdx.x * parts + p]);
    block_argmax(best, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0u : (u32)idx;
}
