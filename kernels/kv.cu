// RoPE, the paged KV cache, and KV injection.
//
// Cache layout: per layer, `[slots, kv_heads·head_dim]` bf16 (slot =
// block · block_size + offset), K and V in separate buffers holding every
// layer back to back. Rotation follows HF's rotate_half: dimension i pairs
// with i + rot/2, for i < rot/2; dimensions from rot on are not rotated.

// In place: one thread per (row, head, pair).
extern "C" __global__ void rope_apply(bf16* x, const u32* positions, int cols, int head_dim, int rot,
                                      const float* cos_t, const float* sin_t, const float* inv_freq,
                                      u32 table_positions) {
    int half = rot / 2;
    int pairs = (cols / head_dim) * half;
    u32 p = positions[blockIdx.x];
    bf16* row = x + (size_t)blockIdx.x * cols;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
        int h = j / half, i = j % half;
        float c, s;
        rope_cos_sin(p, i, half, cos_t, sin_t, inv_freq, table_positions, &c, &s);
        bf16* v = row + h * head_dim;
        float x1 = __bfloat162float(v[i]), x2 = __bfloat162float(v[i + half]);
        v[i] = __float2bfloat16(x1 * c - x2 * s);
        v[i + half] = __float2bfloat16(x2 * c + x1 * s);
    }
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
// grid (pairs, layers).
extern "C" __global__ void copy_blocks(bf16* kc, bf16* vc, const u32* pairs, size_t layer_elems, int block_elems) {
    size_t base = blockIdx.y * layer_elems;
    size_t src = base + (size_t)pairs[2 * blockIdx.x] * block_elems;
    size_t dst = base + (size_t)pairs[2 * blockIdx.x + 1] * block_elems;
    for (int c = threadIdx.x; c < block_elems; c += blockDim.x) {
        kc[dst + c] = kc[src + c];
        vc[dst + c] = vc[src + c];
    }
}

// The fused injection: for every injected token t (grid x) and layer l
// (grid y), rotate the stored pre-RoPE key to positions[t] and write it and
// the value to slot slots[t] of layer l. `meta` holds four arrays of T
// entries: chunk index, row within the chunk, position, slot. Chunk c's
// layer-l tensors are at k_ptrs[c·L + l] / v_ptrs[c·L + l] (`[rows, kv_dim]`).
//
// One thread per 8 dimensions (16-byte loads and stores): a thread whose
// dimensions lie in the first half of a head's rotated part rotates them
// together with their partners rot/2 further on; every thread copies its
// 8 values of V. Needs rot/2 and head_dim multiples of 8.
extern "C" __global__ void inject_kv(bf16* kc, bf16* vc, const u32* meta, u32 tokens, const bf16* const* k_ptrs,
                                     const bf16* const* v_ptrs, size_t layer_elems, int kv_dim, int head_dim,
                                     int rot, const float* cos_t, const float* sin_t, const float* inv_freq,
                                     u32 table_positions) {
    u32 t = blockIdx.x, layer = blockIdx.y, layers = gridDim.y;
    u32 chunk = meta[t], row = meta[tokens + t], pos = meta[2 * tokens + t], slot = meta[3 * tokens + t];
    const bf16* k = k_ptrs[(size_t)chunk * layers + layer] + (size_t)row * kv_dim;
    const bf16* v = v_ptrs[(size_t)chunk * layers + layer] + (size_t)row * kv_dim;
    size_t dst = layer * layer_elems + (size_t)slot * kv_dim;
    int half = rot / 2;
    for (int e = threadIdx.x * 8; e < kv_dim; e += blockDim.x * 8) {
        *(uint4*)(vc + dst + e) = *(const uint4*)(v + e);
        int c = e % head_dim;
        if (c >= rot) {
            *(uint4*)(kc + dst + e) = *(const uint4*)(k + e);
        } else if (c < half) {
            uint4 lo = *(const uint4*)(k + e), hi = *(const uint4*)(k + e + half);
            __nv_bfloat162* l2 = (__nv_bfloat162*)&lo;
            __nv_bfloat162* h2 = (__nv_bfloat162*)&hi;
            float cs[8], sn[8];
            if (pos < table_positions) {
                const float4* ct = (const float4*)(cos_t + (size_t)pos * half + c);
                const float4* st = (const float4*)(sin_t + (size_t)pos * half + c);
                *(float4*)cs = ct[0];
                *(float4*)(cs + 4) = ct[1];
                *(float4*)sn = st[0];
                *(float4*)(sn + 4) = st[1];
            } else {
                for (int i = 0; i < 8; i++) {
                    float a = (float)pos * inv_freq[c + i];
                    cs[i] = cosf(a);
                    sn[i] = sinf(a);
                }
            }
            for (int i = 0; i < 4; i++) {
                float2 x1 = __bfloat1622float2(l2[i]), x2 = __bfloat1622float2(h2[i]);
                float c0 = cs[2 * i], c1 = cs[2 * i + 1], s0 = sn[2 * i], s1 = sn[2 * i + 1];
                l2[i] = __floats2bfloat162_rn(x1.x * c0 - x2.x * s0, x1.y * c1 - x2.y * s1);
                h2[i] = __floats2bfloat162_rn(x2.x * c0 + x1.x * s0, x2.y * c1 + x1.y * s1);
            }
            *(uint4*)(kc + dst + e) = lo;
            *(uint4*)(kc + dst + e + half) = hi;
        }
    }
}
