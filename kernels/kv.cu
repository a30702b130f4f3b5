// RoPE, the paged KV cache, and KV injection.
//
// Cache layout: per layer, `[slots, kv_heads·head_dim]` bf16 (slot =
// block · block_size + offset), K and V in separate buffers holding every
// layer back to back. Rotation follows HF's rotate_half: dimension i pairs
// with i + rot/2, for i < rot/2; dimensions from rot on are not rotated.

// In place: one thread per (row, head, two adjacent pairs); rot/2 is even.
extern "C" __global__ void rope_apply(bf16* x, const u32* positions, int cols, int head_dim, int rot,
                                      const float* cos_t, const float* sin_t, const float* inv_freq,
                                      u32 table_positions) {
    int half = rot / 2;
    int units = (cols / head_dim) * (half / 2);
    u32 p = positions[blockIdx.x];
    bf16* row = x + (size_t)blockIdx.x * cols;
    for (int j = threadIdx.x; j < units; j += blockDim.x) {
        int h = j / (half / 2), i = 2 * (j % (half / 2));
        float c0, s0, c1, s1;
        rope_cos_sin(p, i, half, cos_t, sin_t, inv_freq, table_positions, &c0, &s0);
        rope_cos_sin(p, i + 1, half, cos_t, sin_t, inv_freq, table_positions, &c1, &s1);
        __nv_bfloat162* lo = (__nv_bfloat162*)(row + h * head_dim + i);
        __nv_bfloat162* hi = (__nv_bfloat162*)(row + h * head_dim + i + half);
        float2 x1 = __bfloat1622float2(*lo), x2 = __bfloat1622float2(*hi);
        *lo = __floats2bfloat162_rn(x1.x * c0 - x2.x * s0, x1.y * c1 - x2.y * s1);
        *hi = __floats2bfloat162_rn(x2.x * c0 + x1.x * s0, x2.y * c1 + x1.y * s1);
    }
}

// Heads [0, n) of a row (`src`, head_dim apart) rotated to position p into
// `dst(h)`, one thread per (head, two adjacent pairs) — rope_apply's
// arithmetic, term for term — and the dimensions past `rot` (partial
// rotary) copied as they are.
template <typename Dst>
__device__ __forceinline__ void rope_heads(const bf16* src, Dst dst, int n, u32 p, int head_dim, int rot,
                                           const float* cos_t, const float* sin_t, const float* inv_freq,
                                           u32 table_positions) {
    const int half = rot / 2, per_head = half / 2;
    for (int j = threadIdx.x; j < n * per_head; j += blockDim.x) {
        int h = j / per_head, i = 2 * (j % per_head);
        const bf16* x = src + h * head_dim;
        bf16* y = dst(h);
        float c0, s0, c1, s1;
        rope_cos_sin(p, i, half, cos_t, sin_t, inv_freq, table_positions, &c0, &s0);
        rope_cos_sin(p, i + 1, half, cos_t, sin_t, inv_freq, table_positions, &c1, &s1);
        float2 x1 = __bfloat1622float2(*(const __nv_bfloat162*)(x + i));
        float2 x2 = __bfloat1622float2(*(const __nv_bfloat162*)(x + i + half));
        *(__nv_bfloat162*)(y + i) = __floats2bfloat162_rn(x1.x * c0 - x2.x * s0, x1.y * c1 - x2.y * s1);
        *(__nv_bfloat162*)(y + i + half) = __floats2bfloat162_rn(x2.x * c0 + x1.x * s0, x2.y * c1 + x1.y * s1);
    }
    const int tail = head_dim - rot;
    for (int j = threadIdx.x; j < n * tail; j += blockDim.x) {
        int h = j / tail, c = rot + j % tail;
        dst(h)[c] = src[h * head_dim + c];
    }
}

// The attention inputs of a layer out of its fused QKV projection, in one
// pass: row r of `qkv` is [Q | K | V]; Q is rotated to positions[r] into
// out_q, K rotated and V copied into cache slot slots[r] of one layer.
// The rotation is rope_apply's, term for term, so the result is the same
// bits as split_cols + rope + rope + write_kv. One block per row; K heads
// follow the Q heads in the row, so one pass over the heads rotates both.
extern "C" __global__ void qkv_rope_write(bf16* out_q, bf16* kc, bf16* vc, const bf16* qkv, const u32* positions,
                                          const u32* slots, int q_cols, int kv_cols, int head_dim, int rot,
                                          const float* cos_t, const float* sin_t, const float* inv_freq,
                                          u32 table_positions) {
    pdl_begin();
    const bf16* row = qkv + (size_t)blockIdx.x * (q_cols + 2 * kv_cols);
    bf16* q = out_q + (size_t)blockIdx.x * q_cols;
    bf16* k = kc + (size_t)slots[blockIdx.x] * kv_cols;
    bf16* v = vc + (size_t)slots[blockIdx.x] * kv_cols;
    for (int c = threadIdx.x * 8; c < kv_cols; c += blockDim.x * 8)
        *(uint4*)(v + c) = *(const uint4*)(row + q_cols + kv_cols + c);
    const int q_heads = q_cols / head_dim, heads = q_heads + kv_cols / head_dim;
    auto dst = [&](int h) { return h < q_heads ? q + h * head_dim : k + (h - q_heads) * head_dim; };
    rope_heads(row, dst, heads, positions[blockIdx.x], head_dim, rot, cos_t, sin_t, inv_freq, table_positions);
}

// Row i of k and v to slot slots[i] of one layer's cache.
extern "C" __global__ void write_kv(bf16* kc, bf16* vc, const bf16* k, const bf16* v, const u32* slots, int kv_dim) {
    size_t dst = (size_t)slots[blockIdx.x] * kv_dim, src = (size_t)blockIdx.x * kv_dim;
    for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
        kc[dst + c] = k[src + c];
        vc[dst + c] = v[src + c];
    }
}

extern "C" __global__ void gather_kv(bf16* k, bf16* v, const bf16* kc, const bf16* vc, const u32* slots, int kv_dim) {
    size_t src = (size_t)slots[blockIdx.x] * kv_dim, dst = (size_t)blockIdx.x * kv_dim;
    for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
        k[dst + c] = kc[src + c];
        v[dst + c] = vc[src + c];
    }
}

// Copies whole blocks (src, dst) = (pairs[2i], pairs[2i+1]) in every layer:
// grid (pairs, layers), 16-byte copies (block_elems is a multiple of 8).
extern "C" __global__ void copy_blocks(bf16* kc, bf16* vc, const u32* pairs, size_t layer_elems, int block_elems) {
    size_t base = blockIdx.y * layer_elems;
    const uint4* ks = (const uint4*)(kc + base + (size_t)pairs[2 * blockIdx.x] * block_elems);
    const uint4* vs = (const uint4*)(vc + base + (size_t)pairs[2 * blockIdx.x] * block_elems);
    uint4* kd = (uint4*)(kc + base + (size_t)pairs[2 * blockIdx.x + 1] * block_elems);
    uint4* vd = (uint4*)(vc + base + (size_t)pairs[2 * blockIdx.x + 1] * block_elems);
    for (int c = threadIdx.x; c < block_elems / 8; c += blockDim.x) {
        kd[c] = ks[c];
        vd[c] = vs[c];
    }
}

// The fused injection: rotate each stored pre-RoPE key to its target
// position and write it and its value to its cache slot, for every injected
// token and layer in one launch. `table` holds, as 64-bit words: chunk c's
// layer-l K pointer at [c·L + l], V pointers after all K pointers (for fp8,
// then the K and V scale pointers and the K offset pointers likewise), then four u32 arrays of T
// entries (chunk, row within the chunk, position, slot). Stored tensors are
// `[rows, kv_dim]` bf16, or fp8 codes with a float scale per KV head (and
// a bf16 offset per key channel).
//
// Grid (blocks over token groups of INJECT_TOKENS, a run of `layers` from
// `layer0`). From device memory there is a block per group; from the host
// tier a few layers at a time and a few blocks striding over the groups —
// enough loads in flight for the bus, while leaving the multiprocessors to
// the prefill that runs beside it. A thread owns 8 dimensions
// (16-byte accesses) of every token in its group and issues all their loads
// before any store; a thread whose dimensions lie in the first half of a
// head's rotated part rotates them with their partners rot/2 further on.
// Needs rot/2 and head_dim multiples of 8.
//
// Where a value lands is the destination's business (`Dst::at`: the K and V
// addresses of dimension e of a slot in a layer): our paged cache, or a
// cache another engine owns, addressed by its strides. Where it comes from
// is the source's (`Src::load`: 8 values of a stored row as bf16): bf16
// tensors, or fp8-e4m3 codes with a scale per KV head and key offsets,
// dequantized here —
// the same bf16 the host would have made of them, in no extra pass.
#define INJECT_TOKENS 4

// Stored bf16 rows: the table's K pointers [c·L + l], then the V pointers.
struct Bf16Src {
    static constexpr int WORDS = 2;  // table words per (chunk, layer) before the meta arrays
    const bf16* const* k_ptrs;
    const bf16* const* v_ptrs;
    __device__ Bf16Src(const unsigned long long* table, size_t n) : k_ptrs((const bf16* const*)table), v_ptrs(k_ptrs + n) {}
    __device__ __forceinline__ uint4 load(bool key, size_t cl, u32 row, int kv_dim, int e, int head_dim) const {
        const bf16* p = (key ? k_ptrs : v_ptrs)[cl] + (size_t)row * kv_dim + e;
        return *(const uint4*)p;
    }
    // 4 values (e a multiple of 4).
    __device__ __forceinline__ uint2 load4(bool key, size_t cl, u32 row, int kv_dim, int e, int head_dim) const {
        const bf16* p = (key ? k_ptrs : v_ptrs)[cl] + (size_t)row * kv_dim + e;
        return *(const uint2*)p;
    }
};

// OCP fp8-e4m3 ("fn": no infinities; 0x7f and 0xff are NaN) as f32, exactly.
__device__ __forceinline__ float e4m3_to_float(u32 c) {
    u32 e = (c >> 3) & 0xf, m = c & 7;
    float v = e == 0 ? (float)m * 0.001953125f  // subnormal: m · 2^-9
              : (e == 15 && m == 7) ? __int_as_float(0x7fc00000)
                                    : __int_as_float((int)(((e + 120) << 23) | (m << 20)));
    return (c & 0x80) ? -v : v;
}

// Stored fp8 rows: K code pointers [c·L + l], V code pointers, then the K
// and V scale pointers (a float per KV head of that chunk and layer), then
// the K offset pointers (a bf16 per key channel). A key is code · scale +
// offset, a value code · scale: multiplied, rounded, then added, as the
// host decodes them (no fused multiply-add), so that both give the same
// bf16 bit for bit.
struct Fp8Src {
    static constexpr int WORDS = 5;
    const unsigned char* const* k_ptrs;
    const unsigned char* const* v_ptrs;
    const float* const* ks_ptrs;
    const float* const* vs_ptrs;
    const bf16* const* ko_ptrs;
    __device__ Fp8Src(const unsigned long long* table, size_t n)
        : k_ptrs((const unsigned char* const*)table), v_ptrs(k_ptrs + n), ks_ptrs((const float* const*)(table + 2 * n)),
          vs_ptrs(ks_ptrs + n), ko_ptrs((const bf16* const*)(table + 4 * n)) {}
    __device__ __forceinline__ uint4 load(bool key, size_t cl, u32 row, int kv_dim, int e, int head_dim) const {
        uint2 codes = *(const uint2*)((key ? k_ptrs : v_ptrs)[cl] + (size_t)row * kv_dim + e);
        float s = (key ? ks_ptrs : vs_ptrs)[cl][e / head_dim];
        uint4 offs = key ? *(const uint4*)(ko_ptrs[cl] + e) : make_uint4(0, 0, 0, 0);
        const __nv_bfloat162* off = (const __nv_bfloat162*)&offs;
        uint4 out;
        __nv_bfloat162* o = (__nv_bfloat162*)&out;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 w = j < 2 ? codes.x : codes.y, sh = 16 * (j & 1);
            float2 b = __bfloat1622float2(off[j]);
            o[j] = __floats2bfloat162_rn(__fadd_rn(__fmul_rn(e4m3_to_float((w >> sh) & 0xff), s), b.x),
                                         __fadd_rn(__fmul_rn(e4m3_to_float((w >> (sh + 8)) & 0xff), s), b.y));
        }
        return out;
    }
    // 4 values (e a multiple of 4), decoded as `load` decodes them.
    __device__ __forceinline__ uint2 load4(bool key, size_t cl, u32 row, int kv_dim, int e, int head_dim) const {
        const u32 w = *(const u32*)((key ? k_ptrs : v_ptrs)[cl] + (size_t)row * kv_dim + e);
        const float s = (key ? ks_ptrs : vs_ptrs)[cl][e / head_dim];
        uint2 offs = key ? *(const uint2*)(ko_ptrs[cl] + e) : make_uint2(0, 0);
        const __nv_bfloat162* off = (const __nv_bfloat162*)&offs;
        uint2 out;
        __nv_bfloat162* o = (__nv_bfloat162*)&out;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const float2 b = __bfloat1622float2(off[j]);
            o[j] = __floats2bfloat162_rn(__fadd_rn(__fmul_rn(e4m3_to_float((w >> (16 * j)) & 0xff), s), b.x),
                                         __fadd_rn(__fmul_rn(e4m3_to_float((w >> (16 * j + 8)) & 0xff), s), b.y));
        }
        return out;
    }
};

template <typename Src, typename Dst>
__device__ __forceinline__ void inject_body(const Dst& out, const unsigned long long* table, u32 tokens, u32 chunks,
                                            u32 layer, u32 layers, int kv_dim, int head_dim, int rot,
                                            const float* cos_t, const float* sin_t, const float* inv_freq,
                                            u32 table_positions) {
    const Src src(table, (size_t)chunks * layers);
    const u32* meta = (const u32*)(table + Src::WORDS * (size_t)chunks * layers);
    const int half = rot / 2;
    for (u32 group = blockIdx.x; group * INJECT_TOKENS < tokens; group += gridDim.x)
    for (int e = threadIdx.x * 8; e < kv_dim; e += blockDim.x * 8) {
        const int c = e % head_dim;
        const bool rotate = c < half, copy_k = c >= rot;
        uint4 vv[INJECT_TOKENS], lo[INJECT_TOKENS], hi[INJECT_TOKENS];
        bf16* kd[INJECT_TOKENS];
        bf16* vd[INJECT_TOKENS];
        u32 pos[INJECT_TOKENS];
        bool live[INJECT_TOKENS];
#pragma unroll
        for (int i = 0; i < INJECT_TOKENS; i++) {
            u32 t = group * INJECT_TOKENS + i;
            live[i] = t < tokens;
            if (!live[i]) continue;
            u32 chunk = meta[t], row = meta[tokens + t];
            pos[i] = meta[2 * tokens + t];
            out.at(layer, meta[3 * tokens + t], e, &kd[i], &vd[i]);
            const size_t cl = (size_t)chunk * layers + layer;
            vv[i] = src.load(false, cl, row, kv_dim, e, head_dim);
            if (rotate || copy_k) lo[i] = src.load(true, cl, row, kv_dim, e, head_dim);
            if (rotate) hi[i] = src.load(true, cl, row, kv_dim, e + half, head_dim);
        }
#pragma unroll
        for (int i = 0; i < INJECT_TOKENS; i++) {
            if (!live[i]) continue;
            *(uint4*)vd[i] = vv[i];
            if (copy_k) *(uint4*)kd[i] = lo[i];
            if (!rotate) continue;
            float cs[8], sn[8];
            if (pos[i] < table_positions) {
                const float4* ct = (const float4*)(cos_t + (size_t)pos[i] * half + c);
                const float4* st = (const float4*)(sin_t + (size_t)pos[i] * half + c);
                *(float4*)cs = ct[0];
                *(float4*)(cs + 4) = ct[1];
                *(float4*)sn = st[0];
                *(float4*)(sn + 4) = st[1];
            } else {
                for (int j = 0; j < 8; j++) {
                    float a = (float)pos[i] * inv_freq[c + j];
                    cs[j] = cosf(a);
                    sn[j] = sinf(a);
                }
            }
            __nv_bfloat162* l2 = (__nv_bfloat162*)&lo[i];
            __nv_bfloat162* h2 = (__nv_bfloat162*)&hi[i];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 x1 = __bfloat1622float2(l2[j]), x2 = __bfloat1622float2(h2[j]);
                float c0 = cs[2 * j], c1 = cs[2 * j + 1], s0 = sn[2 * j], s1 = sn[2 * j + 1];
                l2[j] = __floats2bfloat162_rn(x1.x * c0 - x2.x * s0, x1.y * c1 - x2.y * s1);
                h2[j] = __floats2bfloat162_rn(x2.x * c0 + x1.x * s0, x2.y * c1 + x1.y * s1);
            }
            *(uint4*)kd[i] = lo[i];
            *(uint4*)(kd[i] + half) = hi[i];
        }
    }
}

// Our paged cache (layout at the top of this file).
struct PagedDst {
    bf16* kc;
    bf16* vc;
    size_t layer_elems;
    int kv_dim;
    __device__ __forceinline__ void at(u32 layer, u32 slot, int e, bf16** k, bf16** v) const {
        size_t o = layer * layer_elems + (size_t)slot * kv_dim + e;
        *k = kc + o;
        *v = vc + o;
    }
};

#define INJECT_PAGED(name, Src)                                                                                     \
    extern "C" __global__ void name(bf16* kc, bf16* vc, const unsigned long long* table, u32 tokens, u32 chunks,     \
                                    u32 layer0, u32 layers, size_t layer_elems, int kv_dim, int head_dim, int rot,    \
                                    const float* cos_t, const float* sin_t, const float* inv_freq,                   \
                                    u32 table_positions) {                                                            \
        PagedDst out{kc, vc, layer_elems, kv_dim};                                                                    \
        inject_body<Src>(out, table, tokens, chunks, layer0 + blockIdx.y, layers, kv_dim, head_dim, rot, cos_t,      \
                         sin_t, inv_freq, table_positions);                                                           \
    }
INJECT_PAGED(inject_kv, Bf16Src)
INJECT_PAGED(inject_kv_fp8, Fp8Src)

// A cache another engine owns (vLLM's), one tensor per layer at `bases[l]`,
// addressed in elements: slot s = block · block_size + n is at
// block·s_block + n·s_slot, head h at h·s_head, V at s_kv past K. The host
// checks every stride and base keeps 16-byte accesses aligned.
struct StridedDst {
    const unsigned long long* bases;
    u32 block_size;
    size_t s_block, s_slot, s_head, s_kv;
    int head_dim;
    __device__ __forceinline__ void at(u32 layer, u32 slot, int e, bf16** k, bf16** v) const {
        size_t o = (size_t)(slot / block_size) * s_block + (size_t)(slot % block_size) * s_slot +
                   (size_t)(e / head_dim) * s_head + (e % head_dim);
        *k = (bf16*)bases[layer] + o;
        *v = *k + s_kv;
    }
};

#define INJECT_STRIDED(name, Src)                                                                                   \
    extern "C" __global__ void name(const unsigned long long* bases, const unsigned long long* table, u32 tokens,    \
                                    u32 chunks, u32 layers, u32 block_size, size_t s_block, size_t s_slot,            \
                                    size_t s_head, size_t s_kv, int kv_dim, int head_dim, int rot,                    \
                                    const float* cos_t, const float* sin_t, const float* inv_freq,                   \
                                    u32 table_positions) {                                                            \
        StridedDst out{bases, block_size, s_block, s_slot, s_head, s_kv, head_dim};                                   \
        inject_body<Src>(out, table, tokens, chunks, blockIdx.y, layers, kv_dim, head_dim, rot, cos_t, sin_t,        \
                         inv_freq, table_positions);                                                                  \
    }
INJECT_STRIDED(inject_kv_strided, Bf16Src)
INJECT_STRIDED(inject_kv_strided_fp8, Fp8Src)
