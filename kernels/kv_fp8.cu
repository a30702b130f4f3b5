// The fp8 paged cache (`--kv-cache-dtype fp8`, docs/design.md §2.2).
//
// Layout: per layer `[slots, kv_heads·head_dim]` e4m3 codes for K and for V
// (layers back to back, as the bf16 cache), a float scale per (slot, KV
// head) for each (`[layers, slots, kv_heads]`), each slot's RoPE position
// (`[slots]`, every layer writes the same), and per layer the key offsets o
// (`[layers, kv_dim]` f32, before RoPE) that keys are stored relative to.
// A key k at position p is kept as the codes of R(p)·k − R(p)·o and read
// back as code · scale + R(p)·o: channels a model's keys hold far from zero
// in every token (Qwen2.5's layer 0: −355 and +318) then cost nothing of
// the precision of the others. Null offsets (an uncalibrated cache) round
// keys as they are.
//
// The arithmetic is the CPU store's (crates/engine/src/fp8_cache.rs,
// crates/engine/src/cpu/kv_fp8.rs) operation for operation, each rounded
// as written (`__fmul_rn` and friends: no contraction into fused
// multiply-adds), so that both backends round the same floats to the same
// codes, and an injected key's codes are the forward pass's.

typedef unsigned char u8;

// e4m3 code of x: round to nearest even, saturating at ±448, NaN → 0x7f
// (fp8::f32_to_e4m3, on the bits).
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    const u32 bits = __float_as_uint(x), a = bits & 0x7fffffffu;
    const u32 sub = (u32)(int)__fsub_rn(__fadd_rn(__fmul_rn(__uint_as_float(a), 512.0f), 8388608.0f), 8388608.0f);
    const u32 normal = min(((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3), 0x7eu);
    const u32 code = a < 0x3c800000u ? sub : normal;  // below 2⁻⁶: subnormal
    return a > 0x7f800000u ? 0x7fu : (((bits >> 24) & 0x80u) | code);
}

// The codes of a and b, a's in the low byte. On sm_89 and newer the
// hardware converts both in one instruction (round to nearest even,
// saturating to ±448); `inferscale check` holds it to f32_to_e4m3 on every
// f32 bit pattern (`e4m3_encode_mismatches`).
__device__ __forceinline__ u32 e4m3x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(b), "f"(a));
    return two;
#else
    return f32_to_e4m3(a) | f32_to_e4m3(b) << 8;
#endif
}

// Eight e4m3 codes (the first in the low byte of w.x) as floats, exactly:
// on sm_89 and newer two at a time through the hardware's e4m3 → f16
// conversion (both conversions are exact), before that bit by bit.
__device__ __forceinline__ void e4m3x8_to_float(uint2 w, float* f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned short two = (unsigned short)((i < 2 ? w.x : w.y) >> (16 * (i & 1)));
        u32 h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
        asm("{\n.reg .f16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}"
            : "=f"(f[2 * i]), "=f"(f[2 * i + 1])
            : "r"(h2));
    }
#else
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = e4m3_to_float(((j < 4 ? w.x : w.y) >> (8 * (j & 3))) & 0xff);
#endif
}

// The scale of a head row whose largest magnitude is `amax` (fp8::scale_for).
__device__ __forceinline__ float fp8_scale(float amax) {
    return amax > 0.0f && isfinite(amax) ? __fdiv_rn(amax, 448.0f) : 1.0f;
}

// x / scale for the values of a head row whose largest magnitude is `amax`
// and whose scale is fp8_scale(amax), rounded as __fdiv_rn rounds it (the
// CPU's `x / scale`) at a fraction of its cost: the scale's correctly
// rounded reciprocal y once a row, then per value x·y and two corrections
// q + (x − s·q)·y, each fused (the sequence __fdiv_rn itself runs, less its
// reciprocal and its range check). The corrections are exact where nothing
// underflows or overflows: amax in [2⁻⁶⁰, 2¹⁰⁰), where a quotient small enough
// to stray lies far below e4m3's smallest code; any other row (zeros,
// infinities) divides. The sign is the dividend's, as a division's. `inferscale
// check` holds the codes to __fdiv_rn's (`fp8_divisor_mismatches`).
struct Fp8Divisor {
    float s, y;
    bool fast;
    __device__ __forceinline__ explicit Fp8Divisor(float amax)
        : s(fp8_scale(amax)), y(0.0f), fast(amax >= 0x1p-60f && amax < 0x1p100f) {
        if (fast) y = __frcp_rn(s);
    }
    __device__ __forceinline__ float operator()(float x) const {
        if (!fast) return __fdiv_rn(x, s);
        const float q0 = __fmul_rn(x, y);
        const float q1 = __fmaf_rn(__fmaf_rn(-s, q0, x), y, q0);
        return copysignf(__fmaf_rn(__fmaf_rn(-s, q1, x), y, q1), x);
    }
};

// RoPE of the pair (dimension i, i + rot/2) as the CPU's `Rope::rotate`.
__device__ __forceinline__ float2 rope_pair(float x1, float x2, float c, float s) {
    return make_float2(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)), __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

// Dimension d of a head's offset `o` rotated to the position whose cos/sin
// of pair index i = d mod rot/2 are (c, s); dimensions past `rot` are not
// rotated.
__device__ __forceinline__ float rotated_offset_at(const float* o, int d, int half, int rot, float c, float s) {
    if (d >= rot) return o[d];
    const int i = d < half ? d : d - half;
    const float2 r = rope_pair(o[i], o[i + half], c, s);
    return d < half ? r.x : r.y;
}

// The largest magnitude over `group` adjacent lanes (a power of two ≤ 32,
// aligned); every lane of the warp must call it.
__device__ __forceinline__ float group_max(float v, int group) {
    for (int o = group / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One token's key residuals and values, computed into shared memory
// (`kres`, `vals`: `[kv_cols]` f32 each), stored to cache slot `slot` of
// one layer: per KV head its scale, then its codes. `scales` is shared
// scratch of 2·kv_heads floats. Every thread of the block calls it.
__device__ void fp8_store_token(u8* kc, u8* vc, float* ks, float* vs, u32 slot, const float* kres, const float* vals,
                                int kv_cols, int head_dim, float* scales) {
    const int kv_heads = kv_cols / head_dim, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    __syncthreads();
    for (int r = warp; r < 2 * kv_heads; r += warps) {
        const float* x = (r < kv_heads ? kres : vals) + (r % kv_heads) * head_dim;
        float m = 0.0f;
        for (int c = lane; c < head_dim; c += 32) m = fmaxf(m, fabsf(x[c]));
        m = warp_max(m);
        if (lane == 0) scales[r] = fp8_scale(m);
    }
    __syncthreads();
    for (int c = threadIdx.x * 4; c < 2 * kv_cols; c += blockDim.x * 4) {
        const bool key = c < kv_cols;
        const int e = key ? c : c - kv_cols;
        const float* x = key ? kres : vals;
        const float s = scales[(key ? 0 : kv_heads) + e / head_dim];
        const u32 w = e4m3x2(__fdiv_rn(x[e], s), __fdiv_rn(x[e + 1], s)) |
                      e4m3x2(__fdiv_rn(x[e + 2], s), __fdiv_rn(x[e + 3], s)) << 16;
        *(u32*)((key ? kc : vc) + (size_t)slot * kv_cols + e) = w;
    }
    for (int r = threadIdx.x; r < 2 * kv_heads; r += blockDim.x)
        (r < kv_heads ? ks : vs)[(size_t)slot * kv_heads + r % kv_heads] = scales[r];
}

// A key row (head by head) already loaded as floats into `kres`, made its
// residual in place: rotated to `p` (when `rotate`), minus the offset
// rotated alike (`offsets`: the layer's `[kv_cols]`, or null for none).
__device__ void fp8_key_residual(float* kres, u32 p, bool rotate, const float* offsets, int kv_cols, int head_dim,
                                 int rot, const float* cos_t, const float* sin_t, const float* inv_freq,
                                 u32 table_positions) {
    const int half = rot / 2, kv_heads = kv_cols / head_dim;
    __syncthreads();
    for (int j = threadIdx.x; j < kv_heads * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        float* k = kres + h * head_dim;
        float c, s;
        rope_cos_sin(p, i, half, cos_t, sin_t, inv_freq, table_positions, &c, &s);
        const float2 r = rotate ? rope_pair(k[i], k[i + half], c, s) : make_float2(k[i], k[i + half]);
        float2 o = make_float2(0.0f, 0.0f);
        if (offsets) o = rope_pair(offsets[h * head_dim + i], offsets[h * head_dim + i + half], c, s);
        k[i] = __fsub_rn(r.x, o.x);
        k[i + half] = __fsub_rn(r.y, o.y);
    }
    const int tail = head_dim - rot;
    for (int j = threadIdx.x; j < kv_heads * tail; j += blockDim.x) {
        const int c = (j / tail) * head_dim + rot + j % tail;
        kres[c] = __fsub_rn(kres[c], offsets ? offsets[c] : 0.0f);
    }
}

// qkv_rope_write for an fp8 cache: Q rotated into out_q as qkv_rope_write
// rotates it (the same bits), K rotated in f32 and stored as the codes of its
// residual, V as codes; the slot's position recorded. One block per row;
// dynamic shared memory: (2·kv_cols + 2·kv_heads) floats.
extern "C" __global__ void qkv_rope_write_fp8(bf16* out_q, u8* kc, u8* vc, float* ks, float* vs, u32* kpos,
                                              const bf16* qkv, const u32* positions, const u32* slots, int q_cols,
                                              int kv_cols, int head_dim, int rot, const float* cos_t,
                                              const float* sin_t, const float* inv_freq, u32 table_positions,
                                              const float* offsets) {
    pdl_begin();
    extern __shared__ float fp8_row[];
    float *kres = fp8_row, *vals = kres + kv_cols, *scales = vals + kv_cols;
    const bf16* row = qkv + (size_t)blockIdx.x * (q_cols + 2 * kv_cols);
    bf16* q = out_q + (size_t)blockIdx.x * q_cols;
    const u32 p = positions[blockIdx.x], slot = slots[blockIdx.x];
    for (int c = threadIdx.x; c < kv_cols; c += blockDim.x) {
        kres[c] = __bfloat162float(row[q_cols + c]);
        vals[c] = __bfloat162float(row[q_cols + kv_cols + c]);
    }
    auto dst = [&](int h) { return q + h * head_dim; };
    rope_heads(row, dst, q_cols / head_dim, p, head_dim, rot, cos_t, sin_t, inv_freq, table_positions);
    if (threadIdx.x == 0) kpos[slot] = p;
    fp8_key_residual(kres, p, true, offsets, kv_cols, head_dim, rot, cos_t, sin_t, inv_freq, table_positions);
    fp8_store_token(kc, vc, ks, vs, slot, kres, vals, kv_cols, head_dim, scales);
}

// write_kv for an fp8 cache: row i of k (already rotated to positions[i])
// and v to slot slots[i] of one layer, the key as its residual's codes.
// One block per row; shared memory as qkv_rope_write_fp8.
extern "C" __global__ void write_kv_fp8(u8* kc, u8* vc, float* ks, float* vs, u32* kpos, const bf16* k,
                                        const bf16* v, const u32* positions, const u32* slots, int kv_cols,
                                        int head_dim, int rot, const float* cos_t, const float* sin_t,
                                        const float* inv_freq, u32 table_positions, const float* offsets) {
    extern __shared__ float fp8_row[];
    float *kres = fp8_row, *vals = kres + kv_cols, *scales = vals + kv_cols;
    const u32 p = positions[blockIdx.x], slot = slots[blockIdx.x];
    for (int c = threadIdx.x; c < kv_cols; c += blockDim.x) {
        kres[c] = __bfloat162float(k[(size_t)blockIdx.x * kv_cols + c]);
        vals[c] = __bfloat162float(v[(size_t)blockIdx.x * kv_cols + c]);
    }
    if (threadIdx.x == 0) kpos[slot] = p;
    fp8_key_residual(kres, p, false, offsets, kv_cols, head_dim, rot, cos_t, sin_t, inv_freq, table_positions);
    fp8_store_token(kc, vc, ks, vs, slot, kres, vals, kv_cols, head_dim, scales);
}

// The decoded K (offset added back) and V of slots[i] of one layer into
// row i of k and v (bf16). One block per row.
extern "C" __global__ void gather_kv_fp8(bf16* k, bf16* v, const u8* kc, const u8* vc, const float* ks,
                                         const float* vs, const u32* kpos, const u32* slots, int kv_cols,
                                         int head_dim, int rot, const float* cos_t, const float* sin_t,
                                         const float* inv_freq, u32 table_positions, const float* offsets) {
    const u32 slot = slots[blockIdx.x], p = kpos[slot];
    const int kv_heads = kv_cols / head_dim, half = rot / 2;
    for (int c = threadIdx.x; c < kv_cols; c += blockDim.x) {
        const int h = c / head_dim, d = c % head_dim;
        const size_t at = (size_t)slot * kv_cols + c, sc = (size_t)slot * kv_heads + h;
        float key = __fmul_rn(e4m3_to_float(kc[at]), ks[sc]);
        if (offsets) {
            float cs = 1.0f, sn = 0.0f;
            if (d < rot) rope_cos_sin(p, d < half ? d : d - half, half, cos_t, sin_t, inv_freq, table_positions, &cs, &sn);
            key = __fadd_rn(key, rotated_offset_at(offsets + h * head_dim, d, half, rot, cs, sn));
        }
        k[(size_t)blockIdx.x * kv_cols + c] = __float2bfloat16(key);
        v[(size_t)blockIdx.x * kv_cols + c] = __float2bfloat16(__fmul_rn(e4m3_to_float(vc[at]), vs[sc]));
    }
}

// copy_blocks for an fp8 cache: the codes and scales of whole blocks (src,
// dst) = (pairs[2i], pairs[2i+1]) in every layer, and their positions.
// Grid (pairs, layers); block_codes is a multiple of 16.
extern "C" __global__ void copy_blocks_fp8(u8* kc, u8* vc, float* ks, float* vs, u32* kpos, const u32* pairs,
                                           size_t layer_codes, size_t layer_scales, int block_codes,
                                           int block_scales, int block_size) {
    const u32 src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
    const size_t cb = blockIdx.y * layer_codes, sb = blockIdx.y * layer_scales;
    const uint4* kss = (const uint4*)(kc + cb + (size_t)src * block_codes);
    const uint4* vss = (const uint4*)(vc + cb + (size_t)src * block_codes);
    uint4* kd = (uint4*)(kc + cb + (size_t)dst * block_codes);
    uint4* vd = (uint4*)(vc + cb + (size_t)dst * block_codes);
    for (int c = threadIdx.x; c < block_codes / 16; c += blockDim.x) {
        kd[c] = kss[c];
        vd[c] = vss[c];
    }
    for (int c = threadIdx.x; c < block_scales; c += blockDim.x) {
        ks[sb + (size_t)dst * block_scales + c] = ks[sb + (size_t)src * block_scales + c];
        vs[sb + (size_t)dst * block_scales + c] = vs[sb + (size_t)src * block_scales + c];
    }
    if (blockIdx.y == 0)
        for (int c = threadIdx.x; c < block_size; c += blockDim.x)
            kpos[(size_t)dst * block_size + c] = kpos[(size_t)src * block_size + c];
}

// The codes of x[0..8] / d's scale, the first in the low byte of .x.
__device__ __forceinline__ uint2 e4m3x8(const float* x, const Fp8Divisor& d) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) w[j] = e4m3x2(d(x[2 * j]), d(x[2 * j + 1]));
    return make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);
}

// Four bf16 (a uint2) as floats.
__device__ __forceinline__ void unpack4(uint2 v, float* f) {
    const float2 a = __bfloat1622float2(*(const __nv_bfloat162*)&v.x), b = __bfloat1622float2(*(const __nv_bfloat162*)&v.y);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

// Injection into an fp8 cache. A lane owns 8 of a token's value dimensions
// (16-byte accesses) and 8 of its key dimensions: 4 rotated pairs (i,
// i + rot/2) — the first rot/8 lanes of a head — or 8 dimensions past `rot`,
// so that every lane encodes 16 values and none idles while others rotate.
// The loads of a group of INJECT_TOKENS tokens all go out before any store
// (inject_body's order); then per token and KV head the residual R(p)·k −
// R(p)·o in f32 (fp8_key_residual's arithmetic on the same floats: the
// forward pass's codes), the head's largest magnitude over the head_dim / 8
// adjacent lanes that hold it, and the codes. blockDim is a multiple of 32
// (every lane takes part in the shuffles); needs rot/2 a multiple of 4.
template <typename Src>
__device__ __forceinline__ void inject_fp8_body(u8* kc, u8* vc, float* ks, float* vs, u32* kpos, const float* offsets,
                                                size_t layer_codes, size_t layer_scales,
                                                const unsigned long long* table, u32 tokens, u32 chunks, u32 layer,
                                                u32 layers, int kv_dim, int head_dim, int rot, const float* cos_t,
                                                const float* sin_t, const float* inv_freq, u32 table_positions) {
    const Src src(table, (size_t)chunks * layers);
    const u32* meta = (const u32*)(table + Src::WORDS * (size_t)chunks * layers);
    const int half = rot / 2, group = head_dim / 8, pair_lanes = half / 4, kv_heads = kv_dim / head_dim;
    const float* o = offsets ? offsets + (size_t)layer * kv_dim : nullptr;
    u8* kl = kc + layer * layer_codes;
    u8* vl = vc + layer * layer_codes;
    float* ksl = ks + layer * layer_scales;
    float* vsl = vs + layer * layer_scales;
    for (u32 first = blockIdx.x * INJECT_TOKENS; first < tokens; first += gridDim.x * INJECT_TOKENS)
    for (int e0 = 0; e0 < kv_dim; e0 += blockDim.x * 8) {
        const int e = e0 + threadIdx.x * 8, lane = (e % head_dim) / 8;
        const bool active = e < kv_dim, pair = lane < pair_lanes;
        // The key dimensions: [kd, kd + 4) and their partners [kd + half,
        // kd + half + 4), or [kd, kd + 8); `second` is where the upper four are.
        const int kd = e - e % head_dim + (pair ? 4 * lane : rot + 8 * (lane - pair_lanes));
        const int second = pair ? kd + half : kd + 4;
        float ko[8] = {};  // the offsets of those dimensions, the same for every token
        if (o && active) {
            *(float4*)ko = *(const float4*)(o + kd);
            *(float4*)(ko + 4) = *(const float4*)(o + second);
        }
        uint4 vv[INJECT_TOKENS];
        uint2 klo[INJECT_TOKENS], khi[INJECT_TOKENS];
        u32 pos[INJECT_TOKENS], slot[INJECT_TOKENS];
#pragma unroll
        for (int i = 0; i < INJECT_TOKENS; i++) {
            const u32 t = first + i;
            if (t >= tokens) continue;
            pos[i] = meta[2 * tokens + t];
            slot[i] = meta[3 * tokens + t];
            if (!active) continue;
            const u32 chunk = meta[t], row = meta[tokens + t];
            const size_t cl = (size_t)chunk * layers + layer;
            vv[i] = src.load(false, cl, row, kv_dim, e, head_dim);
            klo[i] = src.load4(true, cl, row, kv_dim, kd, head_dim);
            khi[i] = src.load4(true, cl, row, kv_dim, second, head_dim);
        }
#pragma unroll
        for (int i = 0; i < INJECT_TOKENS; i++) {
            if (first + i >= tokens) break;  // the same for every lane
            float v8[8] = {}, k8[8] = {};
            if (active) {
                unpack8(vv[i], v8);
                unpack4(klo[i], k8);
                unpack4(khi[i], k8 + 4);
                if (pair) {
                    float cs[4], sn[4];
                    if (pos[i] < table_positions) {  // rope_cos_sin's table, 4 pairs in 2 loads
                        *(float4*)cs = *(const float4*)(cos_t + (size_t)pos[i] * half + 4 * lane);
                        *(float4*)sn = *(const float4*)(sin_t + (size_t)pos[i] * half + 4 * lane);
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            rope_cos_sin(pos[i], 4 * lane + j, half, cos_t, sin_t, inv_freq, table_positions, &cs[j],
                                         &sn[j]);
                    }
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float2 r = rope_pair(k8[j], k8[4 + j], cs[j], sn[j]);
                        const float2 ro = o ? rope_pair(ko[j], ko[4 + j], cs[j], sn[j]) : make_float2(0.0f, 0.0f);
                        k8[j] = __fsub_rn(r.x, ro.x);
                        k8[4 + j] = __fsub_rn(r.y, ro.y);
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++) k8[j] = __fsub_rn(k8[j], ko[j]);
                }
            }
            float km = 0.0f, vm = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                km = fmaxf(km, fabsf(k8[j]));
                vm = fmaxf(vm, fabsf(v8[j]));
            }
            const Fp8Divisor kdiv(group_max(km, group)), vdiv(group_max(vm, group));
            if (!active) continue;
            const size_t at = (size_t)slot[i] * kv_dim;
            *(uint2*)(vl + at + e) = e4m3x8(v8, vdiv);
            const uint2 kw = e4m3x8(k8, kdiv);
            if (pair) {
                *(u32*)(kl + at + kd) = kw.x;
                *(u32*)(kl + at + second) = kw.y;
            } else {
                *(uint2*)(kl + at + kd) = kw;
            }
            if (lane == 0) {
                ksl[(size_t)slot[i] * kv_heads + e / head_dim] = kdiv.s;
                vsl[(size_t)slot[i] * kv_heads + e / head_dim] = vdiv.s;
            }
            if (e == 0) kpos[slot[i]] = pos[i];
        }
    }
}

#define INJECT_PAGED_FP8(name, Src)                                                                                 \
    extern "C" __global__ void name(u8* kc, u8* vc, float* ks, float* vs, u32* kpos, const float* offsets,           \
                                    const unsigned long long* table, u32 tokens, u32 chunks, u32 layer0, u32 layers,  \
                                    size_t layer_codes, size_t layer_scales, int kv_dim, int head_dim, int rot,       \
                                    const float* cos_t, const float* sin_t, const float* inv_freq,                   \
                                    u32 table_positions) {                                                            \
        inject_fp8_body<Src>(kc, vc, ks, vs, kpos, offsets, layer_codes, layer_scales, table, tokens, chunks,        \
                             layer0 + blockIdx.y, layers, kv_dim, head_dim, rot, cos_t, sin_t, inv_freq,              \
                             table_positions);                                                                        \
    }
INJECT_PAGED_FP8(inject_kv_to_fp8, Bf16Src)
INJECT_PAGED_FP8(inject_kv_fp8_to_fp8, Fp8Src)

// `inferscale check`: over every f32 bit pattern, how many e4m3x2 codes
// other than f32_to_e4m3 does — counts[0] for non-NaN inputs, counts[1] for
// NaNs — and counts[2], the control, against f32_to_e4m3 with the pair's
// bytes swapped (which must differ). Each thread takes pairs (2i, 2i + 1).
extern "C" __global__ void e4m3_encode_mismatches(unsigned long long* counts) {
    unsigned long long ours = 0, nans = 0, swapped = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 31);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float a = __uint_as_float((u32)(2 * i)), b = __uint_as_float((u32)(2 * i + 1));
        const u32 hw = e4m3x2(a, b), ca = f32_to_e4m3(a), cb = f32_to_e4m3(b);
        const bool nan = isnan(a) || isnan(b);
        const u32 wrong = (hw & 0xff) != ca || (hw >> 8) != cb;
        (nan ? nans : ours) += wrong;
        swapped += hw != (cb | ca << 8);
    }
    atomicAdd(&counts[0], ours);
    atomicAdd(&counts[1], nans);
    atomicAdd(&counts[2], swapped);
}

// `inferscale check`: Fp8Divisor against __fdiv_rn over every f32 bit
// pattern x, each with a row maximum amax drawn from x's hash, log-uniform
// over Fp8Divisor's fast range and raised to |x| (the row holds x; an
// infinite x makes the row's maximum infinite). counts[0]: codes that
// differ; counts[1]: quotients of magnitude 2⁻¹⁰ or more (those that can
// code non-zero) that differ in any bit; counts[2], the control: codes of
// the uncorrected product x·y that differ where the fast path ran (which
// must happen). Each thread takes x = i, i + stride, ….
extern "C" __global__ void fp8_divisor_mismatches(unsigned long long* counts) {
    unsigned long long codes = 0, quotients = 0, uncorrected = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float x = __uint_as_float((u32)i);
        u32 h = (u32)i * 0x9e3779b9u;  // murmur3's finalizer of a Weyl step
        h ^= h >> 16, h *= 0x85ebca6bu, h ^= h >> 13, h *= 0xc2b2ae35u, h ^= h >> 16;
        float amax = __uint_as_float((127u - 60u + h % 160u) << 23 | h >> 9);  // [2⁻⁶⁰, 2¹⁰⁰)
        if (isinf(x)) amax = __int_as_float(0x7f800000);
        else if (!isnan(x)) amax = fmaxf(amax, fabsf(x));
        const Fp8Divisor d(amax);
        const float want = __fdiv_rn(x, d.s), got = d(x);
        const u32 code = e4m3x2(want, 0.0f) & 0xff;
        codes += (e4m3x2(got, 0.0f) & 0xff) != code;
        quotients += fabsf(want) >= 0x1p-10f && __float_as_uint(got) != __float_as_uint(want);
        uncorrected += d.fast && (e4m3x2(__fmul_rn(x, d.y), 0.0f) & 0xff) != code;
    }
    atomicAdd(&counts[0], codes);
    atomicAdd(&counts[1], quotients);
    atomicAdd(&counts[2], uncorrected);
}
