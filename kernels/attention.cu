// Attention: causal attention over the paged cache (prefill and decode, GQA,
// split over keys when there are few query rows) on the tensor cores, its
// split combine, and the bidirectional attention of encoders.

// Rows of a span attend to every row of the span. `row_span[2r..2r+2]` =
// (first row, rows) of row r's span. Grid (rows, heads); dynamic shared
// memory holds one score per key. Encoders are small: plain CUDA cores.
extern "C" __global__ void attention_bidirectional(bf16* out, const bf16* q, const bf16* k, const bf16* v,
                                                   const u32* row_span, int heads, int head_dim, float scale) {
    extern __shared__ float bidir_scores[];
    __shared__ float scratch[32];
    u32 r = blockIdx.x, h = blockIdx.y, start = row_span[2 * r], len = row_span[2 * r + 1];
    size_t cols = (size_t)heads * head_dim;
    const bf16* qr = q + r * cols + h * head_dim;
    for (u32 j = threadIdx.x; j < len; j += blockDim.x) {
        const bf16* kr = k + (start + j) * cols + h * head_dim;
        float dot = 0.0f;
        for (int c = 0; c < head_dim; c++) dot += __bfloat162float(qr[c]) * __bfloat162float(kr[c]);
        bidir_scores[j] = dot * scale;
    }
    __syncthreads();
    float m = NEG_INF;
    for (u32 j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, bidir_scores[j]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < len; j += blockDim.x) {
        float p = __expf(bidir_scores[j] - m);
        bidir_scores[j] = p;
        s += p;
    }
    s = block_sum(s, scratch);
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = 0; j < len; j++) acc += bidir_scores[j] * __bfloat162float(v[(start + j) * cols + h * head_dim + c]);
        out[r * cols + h * head_dim + c] = __float2bfloat16(acc / s);
    }
}

// Packed query rows per block (token × query head of one KV group) and keys per tile.
#define BR 64
#define BK 64
// Keys per tile of a warp walking its own quarter of a decode-like block's keys.
#define WK 16

__device__ __forceinline__ u32 ld_u32(const bf16* p) { return *(const u32*)p; }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(u32*)&v;
}

// One warp's share of a key tile: keys kt + kb .. kt + kb + NK of the tile
// of keys from kt in `Ks`/`Vs`, against the warp's 16 rows — scores on the tensor cores, the
// online softmax update of (m, l), and P·V into `o`. `vsc` (non-null over an
// fp8 cache): the tile's V rows are codes and row j's scale is vsc[j]; it
// multiplies P's column j instead (after the softmax sum), a few products a
// lane per tile where scaling V itself took one per value.
template <int D, int NK>
__device__ __forceinline__ void attend_tile(float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                            const u32 (&qa)[D / 16][4], const bf16* Ks, const bf16* Vs, u32 kt,
                                            int kb, u32 k_end, const u32 (&limit)[2], float scale, int lane,
                                            const float* vsc = nullptr) {
    constexpr int LK = D + 8;
    const int q4 = lane & 3;
    const u32 k0 = kt + kb;
    // Scores: K's rows are the B fragments of Qᵀ·K, two 8-key tiles per
    // ldmatrix (lanes 0–15 the first tile's rows, 16–31 the second's).
    float sc[NK / 8][4];
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt += 2) {
        const bf16* kp = Ks + (kb + nt * 8 + (lane & 7) + ((lane >> 4) << 3)) * LK + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, kp + kk * 16);
            mma_bf16_16816(sc[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            mma_bf16_16816(sc[nt + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b2, b3);
        }
    }

    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                u32 key = k0 + nt * 8 + q4 * 2 + e;
                float v = (key < k_end && key < limit[h]) ? sc[nt][2 * h + e] * scale : NEG_INF;
                sc[nt][2 * h + e] = v;
                mx[h] = fmaxf(mx[h], v);
            }
    float alpha[2], psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        float m_new = fmaxf(m[h], mx[h]);
        alpha[h] = m_new == NEG_INF ? 1.0f : __expf(m[h] - m_new);
        m[h] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float v = sc[nt][2 * h + e];
                float p = v == NEG_INF ? 0.0f : __expf(v - m[h]);
                sc[nt][2 * h + e] = p;
                psum[h] += p;
            }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], 1);
        psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], 2);
        l[h] = l[h] * alpha[h] + psum[h];
    }
    if (vsc) {
#pragma unroll
        for (int nt = 0; nt < NK / 8; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float w = vsc[kb + nt * 8 + q4 * 2 + e];
                sc[nt][e] *= w;
                sc[nt][2 + e] *= w;
            }
    }
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) {
        o[dn][0] *= alpha[0];
        o[dn][1] *= alpha[0];
        o[dn][2] *= alpha[1];
        o[dn][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < NK / 16; kk++) {
        u32 a0 = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), a1 = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
        u32 a2 = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        u32 a3 = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        const bf16* vrow = Vs + (kb + kk * 16 + (lane & 15)) * LK + (lane >> 4) * 8;
#pragma unroll
        for (int dn = 0; dn < D / 8; dn += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, vrow + dn * 8);
            mma_bf16_16816(o[dn], a0, a1, a2, a3, b0, b1);
            mma_bf16_16816(o[dn + 1], a0, a1, a2, a3, b2, b3);
        }
    }
}

// Where an fp8 cache's scales, slot positions and key offsets are (this
// layer's; null offsets: none), with the RoPE tables the offsets turn with.
// Unused (zeros) over a bf16 cache.
struct Fp8Read {
    const float* ks;
    const float* vs;
    const u32* kpos;
    const float* offsets;
    const float* cos_t;
    const float* sin_t;
    const float* inv_freq;
    u32 table_positions;
    int rot;
};

// Walks keys [begin, end) through two stages, a tile at a time: the block's
// tiles of BK (every thread copies; block barriers) or, with `per_warp`, the
// calling warp's own tiles of WK in its rows of the stages (its lanes copy;
// warp barriers). The next tile's copy (`copy(kt, stage, first row, keys,
// thread, threads)`) starts before this one's is waited for; `use(kt,
// stage)` then reads the landed tile. `guard`: a barrier before each copy
// too, where the stage copied into was read by the previous tile's `use`.
template <typename Copy, typename Use>
__device__ __forceinline__ void walk_keys(bool per_warp, bool guard, u32 begin, u32 end, Copy&& copy, Use&& use) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const u32 step = per_warp ? WK : BK;
    const int j0 = per_warp ? warp * WK : 0, t = per_warp ? lane : tid, nt = per_warp ? 32 : (int)blockDim.x;
    if (begin < end) copy(begin, 0, j0, (int)step, t, nt);
    int stage = 0;
    for (u32 kt = begin; kt < end; kt += step, stage ^= 1) {
        if (guard) per_warp ? __syncwarp() : __syncthreads();
        if (kt + step < end) {
            copy(kt + step, stage ^ 1, j0, (int)step, t, nt);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        per_warp ? __syncwarp() : __syncthreads();
        use(kt, stage);
    }
}

// Causal attention over the paged cache, FlashAttention-2 style: a block of
// four warps takes 64 packed rows (consecutive tokens × the query heads that
// share one KV head) of one sequence; each warp keeps its 16 rows' Q, scores
// and output in registers (mma.sync m16n8k16 fragments), walks the keys 64
// at a time through shared memory, and rescales with an online softmax in
// f32. Tiles are double-buffered: the next tile's K and V rows are copied
// with cp.async (coalesced, one key's row of this KV head per eight
// threads) while the tensor cores work on this one, since a decode step is
// bound by reading the cache and few blocks fit per SM. K and V stay
// row-major; V's fragments come through ldmatrix.trans. A block whose rows
// fit in 16 (a decode token: its G query heads) would leave three warps
// idle, so there the four warps share the 16 rows and split the keys
// instead — each a contiguous quarter, walked on its own (below) — each
// with its own softmax state, merged at the end. In a
// block of more rows, warps whose rows are all past the span only load.
// It writes O / l — or, when keys are split across blocks (grid z), the
// unnormalised O with its running max and sum for `attention_combine`.
//
// `meta`: spans as (q_start, q_len, context_len, table offset) × S, then at
// `works_off` (span, first packed row) per block, then the block tables at
// `tables_off`. A span's new tokens take cache positions context_len − q_len
// .. context_len and see every position up to their own — unless `row_ends`
// is set: then query row i sees cache entries 0 .. row_ends[i] (rows
// recomputed in place among injected ones, ascending within a span).
// Split z takes keys [z·keys_per_split, (z + 1)·keys_per_split).
//
// Over an fp8 cache (FP8; kv_fp8.cu), `kc`/`vc` are codes: the next tile's
// codes, scales and positions are copied with cp.async into one of two code
// stages while this one is decoded into the single bf16 stage (code · scale,
// plus for keys the head's offset rotated to the key's position) and
// attended as above.
template <int D, bool FP8>
__device__ void paged_attention(bf16* out, float* part_o, float* part_ml, const bf16* q, const bf16* kc,
                                const bf16* vc, const u32* meta, const u32* row_ends, u32 works_off,
                                u32 tables_off, int heads,
                                int kv_heads, int block_size, float scale, u32 keys_per_split, u32 n_tokens,
                                const Fp8Read& f8, unsigned char* smem) {
    constexpr int LK = D + 8, V8 = D / 8, STAGE = 2 * BK * LK;
    bf16* tiles = (bf16*)smem;  // 2 stages × (K [BK][LK], V [BK][LK]); fp8: one stage
    // fp8: after the bf16 stage, two stages of (K codes [BK][D], V codes
    // [BK][D], K scales [BK], V scales [BK], positions [BK]), then the
    // head's key offsets [D] and their partners [D] (see `decode`).
    constexpr int CODE_STAGE = 2 * BK * D + 3 * BK * 4;
    unsigned char* code_stages = smem + STAGE * 2;
    float* head_offsets = (float*)(code_stages + 2 * CODE_STAGE);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, q4 = lane & 3;
    const u32 g = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const u32* works = meta + works_off;
    const u32 s = works[2 * blockIdx.x], r0 = works[2 * blockIdx.x + 1];
    const u32 q_start = meta[4 * s], q_len = meta[4 * s + 1], ctx = meta[4 * s + 2];
    const u32* table = meta + tables_off + meta[4 * s + 3];
    const int G = heads / kv_heads;
    const size_t q_dim = (size_t)heads * D, kv_dim = (size_t)kv_heads * D;
    const u32 rows_total = q_len * G, past = ctx - q_len;
    const u32 r_last = min(r0 + BR, rows_total) - 1;
    const u32 k_limit = row_ends ? row_ends[q_start + r_last / G] : past + r_last / G + 1;
    // keys_per_split 0 (a decode graph, whose grid is fixed while context
    // lengths change): this span's keys evenly over the splits, in tiles,
    // at least two tiles a split (as `plan_attention` chooses); the splits
    // past the span's keys write empty partial results.
    const u32 kps = keys_per_split ? keys_per_split : max(((ctx + splits - 1) / splits + BK - 1) / BK * BK, (u32)(2 * BK));
    const u32 k_begin = z * kps, k_end = min(k_limit, k_begin + kps);

    // Decode-like: every warp takes the block's first 16 rows and a quarter
    // of each tile's keys.
    const bool split = rows_total - r0 <= 16;
    // This lane's two rows (fragment rows r and r + 8 of the warp's 16).
    u32 R[2], limit[2], head[2], qrow[2];
    bool valid[2];
    u32 qa[D / 16][4];
    for (int h = 0; h < 2; h++) {
        R[h] = r0 + (split ? 0 : warp * 16) + r + 8 * h;
        valid[h] = R[h] < rows_total;
        u32 t = valid[h] ? R[h] / G : 0;
        limit[h] = valid[h] ? (row_ends ? row_ends[q_start + t] : past + t + 1) : 0;
        head[h] = g * G + (valid[h] ? R[h] % G : 0);
        qrow[h] = q_start + t;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const bf16* qp = q + qrow[h] * q_dim + head[h] * D + kk * 16 + q4 * 2;
            qa[kk][h] = valid[h] ? ld_u32(qp) : 0u;
            qa[kk][2 + h] = valid[h] ? ld_u32(qp + 8) : 0u;
        }

    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    const bool active = split || r0 + warp * 16 < rows_total;
    // Decode-like blocks: each warp copies (and over fp8, decodes) and
    // attends its own contiguous quarter of the keys, [wb, we), 16 at a time
    // through its own rows of the stages, with only `__syncwarp` between.
    // No warp waits at a block barrier for another's copies, so one warp's
    // loads and decode overlap another's MMAs: four warps taking a quarter
    // of each shared tile in lockstep between block barriers left the fp8
    // kernel latency-bound. Quarters are whole tiles of 16 but the last.
    const u32 quarter = (k_end > k_begin ? k_end - k_begin + 4 * WK - 1 : 0) / (4 * WK) * WK;
    const u32 wb = min(k_end, k_begin + warp * quarter), we = min(k_end, wb + quarter);
    // The cache slot of this span's key `key` (< k_end), through its block table.
    auto slot_of = [&](u32 key) { return (size_t)table[key / block_size] * block_size + key % block_size; };
    // Starts copying keys [kt, kt + n) into rows j0 .. j0 + n of `stage`,
    // as thread t of nt (the block's, or one warp's); keys past the end read
    // as zeros.
    auto load = [&](u32 kt, int stage, int j0, int n, int t, int nt) {
        bf16* Ks = tiles + stage * STAGE;
        bf16* Vs = Ks + BK * LK;
        for (int i = t; i < n * V8; i += nt) {
            int j = i / V8, c8 = i % V8;
            u32 key = kt + j;
            bool full = key < k_end;
            size_t off = 0;
            if (full) off = slot_of(key) * kv_dim + g * D + c8 * 8;
            cp_async16(Ks + (j0 + j) * LK + c8 * 8, kc + off, full);
            cp_async16(Vs + (j0 + j) * LK + c8 * 8, vc + off, full);
        }
        cp_async_commit();
    };
    if constexpr (FP8) {
        const unsigned char* kcodes = (const unsigned char*)kc;
        const unsigned char* vcodes = (const unsigned char*)vc;
        // Starts copying the codes of keys [kt, kt + n) into rows j0 .. j0 + n
        // of code stage `st`, as thread t of nt (the block's, or one warp's);
        // keys past the end read as zeros.
        auto load_codes = [&](u32 kt, int st, int j0, int n, int t, int nt) {
            unsigned char* Kc = code_stages + st * CODE_STAGE;
            unsigned char* Vc = Kc + BK * D;
            float* ksc = (float*)(Vc + BK * D);
            float* vsc = ksc + BK;
            u32* pos = (u32*)(vsc + BK);
            constexpr int C16 = D / 16;
            for (int i = t; i < n * C16; i += nt) {
                int j = i / C16, c16 = i % C16;
                u32 key = kt + j;
                bool full = key < k_end;
                size_t off = 0;
                if (full) off = slot_of(key) * kv_dim + g * D + c16 * 16;
                cp_async16(Kc + (j0 + j) * D + c16 * 16, kcodes + off, full);
                cp_async16(Vc + (j0 + j) * D + c16 * 16, vcodes + off, full);
            }
            for (int j = t; j < n; j += nt) {
                u32 key = kt + j;
                bool full = key < k_end;
                size_t slot = full ? slot_of(key) : 0;
                cp_async4(ksc + j0 + j, f8.ks + slot * kv_heads + g, full);
                cp_async4(vsc + j0 + j, f8.vs + slot * kv_heads + g, full);
                cp_async4(pos + j0 + j, f8.kpos + slot, full);
            }
            cp_async_commit();
        };
        // Code stage `st` decoded into the bf16 stage, 8 dimensions of one key
        // an item: for keys code · scale plus the head's offset turned to the
        // key's position; V's codes as they are (`attend_tile` scales P's
        // columns instead). Unlike the cache's writes this need not match the
        // CPU's roundings bit for bit (the tile is rounded to bf16), so it
        // contracts to FMAs.
        //
        // A thread's items all have the same 8 dimensions, its keys S apart
        // (S = 128 / V8 when the block decodes a tile together, 32 / V8 when
        // a warp decodes its own 16 keys). Rather than read cos/sin from the
        // table for every key (four times the bytes of its codes, and loads
        // the kernel waited on), each thread keeps its 8 dimensions of the
        // offset turned to the position its next key should have, and steps
        // them S positions an item: a sequence's keys sit at consecutive
        // positions, and a thread's next tile starts where its last item's
        // step lands, so the table is read once per RELOAD_TILES tiles
        // (bounding the drift of repeated products) and wherever a key is not
        // where expected.
        constexpr int RELOAD_TILES = 16;
        const int d_first = (tid % V8) * 8;
        const int S = split ? 32 / V8 : 128 / V8;
        const int j_first = split ? warp * WK + lane / V8 : tid / V8, items = (split ? WK : BK) / S;
        const int rot = f8.rot, half = rot / 2;
        const bool rotates = f8.offsets && d_first < rot;
        const int i_first = d_first < half ? d_first : d_first - half;
        // Dimension d of the offset turned to a position whose band has
        // (c, s) is u = offsets[d]·c + partner[d]·s: partner holds the other
        // element of d's rotated pair, negated in the first half, and 0 past
        // `rot`. With its companion v = partner[d]·c − offsets[d]·s, a turn
        // by (wc, ws) is u' = wc·u + ws·v, v' = wc·v − ws·u: a thread steps
        // its own dimensions without its pairs' partners.
        float* partner = head_offsets + D;
        for (int c = tid; c < D; c += blockDim.x) {
            const float* o = f8.offsets ? f8.offsets + g * D : nullptr;
            head_offsets[c] = f8.offsets ? o[c] : 0.0f;
            partner[c] = !f8.offsets || c >= rot ? 0.0f : c < half ? -o[c + half] : o[c - half];
        }
        __syncthreads();
        // (u, v) at position zp, where this thread's next key should be;
        // (wc, ws): the step of S positions. A thread whose dimensions are
        // not rotated keeps u = its offsets, v = 0, and never steps.
        float u[8], v[8], wc[8], ws[8];
#pragma unroll
        for (int e = 0; e < 8; e++) u[e] = head_offsets[d_first + e], v[e] = 0.0f;
        auto from_table = [&](u32 p) {
            float c[8], sn[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                rope_cos_sin(p, i_first + e, half, f8.cos_t, f8.sin_t, f8.inv_freq, f8.table_positions, &c[e], &sn[e]);
                const float a = head_offsets[d_first + e], b = partner[d_first + e];
                u[e] = fmaf(a, c[e], b * sn[e]);
                v[e] = fmaf(b, c[e], -(a * sn[e]));
            }
        };
        u32 zp = 0xffffffffu;  // no key there: the first key reads the table
        int tiles_since_table = 0;
        if (rotates) {
#pragma unroll
            for (int e = 0; e < 8; e++)
                rope_cos_sin(S, i_first + e, half, f8.cos_t, f8.sin_t, f8.inv_freq, f8.table_positions, &wc[e], &ws[e]);
        }
        auto decode = [&](int st) {
            const unsigned char* Kc = code_stages + st * CODE_STAGE;
            const unsigned char* Vc = Kc + BK * D;
            const float* ksc = (const float*)(Vc + BK * D);
            const u32* pos = (const u32*)(ksc + 2 * BK);
            if (rotates && ++tiles_since_table >= RELOAD_TILES) {
                zp = pos[j_first];
                from_table(zp);
                tiles_since_table = 0;
            }
#pragma unroll 2
            for (int n = 0; n < items; n++) {
                const int j = j_first + n * S, d0 = d_first;
                const uint2 kw = *(const uint2*)(Kc + j * D + d0), vw = *(const uint2*)(Vc + j * D + d0);
                const float ks = ksc[j];
                float kf[8], vf[8];
                e4m3x8_to_float(kw, kf);
                e4m3x8_to_float(vw, vf);
                if (rotates && pos[j] != zp) {
                    zp = pos[j];
                    from_table(zp);
                }
#pragma unroll
                for (int e = 0; e < 8; e++) kf[e] = fmaf(kf[e], ks, u[e]);
                if (rotates) {
                    // On to the next item's key, S positions on.
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        const float un = fmaf(wc[e], u[e], ws[e] * v[e]);
                        v[e] = fmaf(wc[e], v[e], -(ws[e] * u[e]));
                        u[e] = un;
                    }
                    zp += S;
                }
                *(uint4*)(tiles + j * LK + d0) = pack8(kf);
                *(uint4*)(tiles + BK * LK + j * LK + d0) = pack8(vf);
            }
        };
        // V's scales of code stage `st`, for `attend_tile`.
        auto v_scales = [&](int st) { return (const float*)(code_stages + st * CODE_STAGE + 2 * BK * D) + BK; };
        if (split) {
            // The warp's quarter (above). The guard keeps a copy from landing
            // in the code stage whose V scales the previous tile's P read.
            bf16* Kq = tiles + warp * WK * LK;
            walk_keys(true, true, wb, we, load_codes, [&](u32 kt, int st) {
                decode(st);
                __syncwarp();
                attend_tile<D, WK>(o, m, l, qa, Kq, Kq + BK * LK, kt, 0, we, limit, scale, lane,
                                   v_scales(st) + warp * WK);
            });
        } else {
            walk_keys(false, true, k_begin, k_end, load_codes, [&](u32 kt, int st) {
                decode(st);
                __syncthreads();
                if (active)
                    attend_tile<D, BK>(o, m, l, qa, tiles, tiles + BK * LK, kt, 0, k_end, limit, scale, lane,
                                       v_scales(st));
            });
        }
    } else if (split) {
        // The warp's quarter (above), through its rows of the two stages.
        walk_keys(true, true, wb, we, load, [&](u32 kt, int st) {
            const bf16* Ks = tiles + st * STAGE + warp * WK * LK;
            attend_tile<D, WK>(o, m, l, qa, Ks, Ks + BK * LK, kt, 0, we, limit, scale, lane);
        });
    } else {
        walk_keys(false, true, k_begin, k_end, load, [&](u32 kt, int st) {
            const bf16* Ks = tiles + st * STAGE;
            if (active) attend_tile<D, BK>(o, m, l, qa, Ks, Ks + BK * LK, kt, 0, k_end, limit, scale, lane);
        });
    }

    if (split) {
        // Merge the four warps' partial softmax states into warp 0's.
        constexpr int W = D / 2 + 4;  // per lane: o, then m[2], l[2]
        float* red = (float*)smem;    // [4 warps][32 lanes][W], over the tiles
        __syncthreads();
        float* mine = red + (warp * 32 + lane) * W;
#pragma unroll
        for (int dn = 0; dn < D / 8; dn++)
#pragma unroll
            for (int e = 0; e < 4; e++) mine[dn * 4 + e] = o[dn][e];
        mine[D / 2] = m[0];
        mine[D / 2 + 1] = m[1];
        mine[D / 2 + 2] = l[0];
        mine[D / 2 + 3] = l[1];
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mm = NEG_INF;
            for (int w = 0; w < 4; w++) mm = fmaxf(mm, red[(w * 32 + lane) * W + D / 2 + h]);
            float wt[4], ll = 0.0f;
            for (int w = 0; w < 4; w++) {
                const float* other = red + (w * 32 + lane) * W;
                float mw = other[D / 2 + h];
                wt[w] = mw == NEG_INF ? 0.0f : __expf(mw - mm);
                ll += other[D / 2 + 2 + h] * wt[w];
            }
#pragma unroll
            for (int dn = 0; dn < D / 8; dn++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float acc = 0.0f;
                    for (int w = 0; w < 4; w++) acc += red[(w * 32 + lane) * W + dn * 4 + 2 * h + e] * wt[w];
                    o[dn][2 * h + e] = acc;
                }
            m[h] = mm;
            l[h] = ll;
        }
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (!valid[h]) continue;
        if (splits == 1) {
            float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            bf16* dst = out + qrow[h] * q_dim + head[h] * D + q4 * 2;
#pragma unroll
            for (int dn = 0; dn < D / 8; dn++)
                *(__nv_bfloat162*)(dst + dn * 8) = __floats2bfloat162_rn(o[dn][2 * h] * inv, o[dn][2 * h + 1] * inv);
        } else {
            size_t idx = ((size_t)z * n_tokens + qrow[h]) * heads + head[h];
            float* dst = part_o + idx * D + q4 * 2;
#pragma unroll
            for (int dn = 0; dn < D / 8; dn++) {
                dst[dn * 8] = o[dn][2 * h];
                dst[dn * 8 + 1] = o[dn][2 * h + 1];
            }
            if (q4 == 0) {
                part_ml[2 * idx] = m[h];
                part_ml[2 * idx + 1] = l[h];
            }
        }
    }
}

#define PAGED_ATTENTION(D)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) paged_attention_d##D(                                       \
        bf16* out, float* part_o, float* part_ml, const bf16* q, const bf16* kc, const bf16* vc, const u32* meta, \
        const u32* row_ends, u32 works_off, u32 tables_off, int heads, int kv_heads, int block_size, float scale, \
        u32 keys_per_split, u32 n_tokens) {                                                                       \
        extern __shared__ __align__(128) unsigned char paged_smem[];                                              \
        pdl_begin();                                                                                              \
        paged_attention<D, false>(out, part_o, part_ml, q, kc, vc, meta, row_ends, works_off, tables_off, heads,  \
                                  kv_heads, block_size, scale, keys_per_split, n_tokens, Fp8Read{}, paged_smem);  \
    }

PAGED_ATTENTION(64)
PAGED_ATTENTION(128)

// The same over an fp8 cache: its codes, and where its scales, positions
// and (this layer's, or null) key offsets are, with the RoPE tables they
// turn with.
#define PAGED_ATTENTION_FP8(D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(128) paged_attention_fp8_d##D(                                   \
        bf16* out, float* part_o, float* part_ml, const bf16* q, const u8* kc, const u8* vc, const u32* meta,     \
        const u32* row_ends, u32 works_off, u32 tables_off, int heads, int kv_heads, int block_size, float scale, \
        u32 keys_per_split, u32 n_tokens, const float* ks, const float* vs, const u32* kpos,                     \
        const float* offsets, const float* cos_t, const float* sin_t, const float* inv_freq,                     \
        u32 table_positions, int rot) {                                                                           \
        extern __shared__ __align__(128) unsigned char paged_smem[];                                              \
        pdl_begin();                                                                                              \
        const Fp8Read f8{ks, vs, kpos, offsets, cos_t, sin_t, inv_freq, table_positions, rot};                    \
        paged_attention<D, true>(out, part_o, part_ml, q, (const bf16*)kc, (const bf16*)vc, meta, row_ends,       \
                                 works_off, tables_off, heads, kv_heads, block_size, scale, keys_per_split,       \
                                 n_tokens, f8, paged_smem);                                                       \
    }

PAGED_ATTENTION_FP8(64)
PAGED_ATTENTION_FP8(128)

// Merges key splits: row (token, head) = blockIdx.x, one thread per
// dimension. The splits' (max, sum) pairs are read by as many threads at
// once and their weights kept in shared memory (`splits` floats, dynamic),
// so that the pass over the partial outputs is loads without a dependency
// between them: reading split z's weight before split z's output, one split
// after another, made this kernel a chain of `splits` memory latencies.
// Every (split, row) entry was written by paged_attention (zeros where a
// split saw no key), so empty splits weigh 0 and add nothing.
extern "C" __global__ void attention_combine(bf16* out, const float* part_o, const float* part_ml, u32 rows,
                                             int splits, int head_dim) {
    pdl_begin();
    extern __shared__ float weight[];
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    float mx = NEG_INF;
    for (int z = threadIdx.x; z < splits; z += blockDim.x) mx = fmaxf(mx, part_ml[2 * ((size_t)z * rows + row)]);
    mx = block_max(mx, scratch);
    float part_l = 0.0f;
    for (int z = threadIdx.x; z < splits; z += blockDim.x) {
        const size_t idx = (size_t)z * rows + row;
        const float lz = part_ml[2 * idx + 1];
        const float w = lz == 0.0f ? 0.0f : __expf(part_ml[2 * idx] - mx);
        weight[z] = w;
        part_l += lz * w;
    }
    // The sum's barriers also publish `weight`.
    const float l = block_sum(part_l, scratch);
    float acc = 0.0f;
#pragma unroll 8
    for (int z = 0; z < splits; z++) acc += part_o[((size_t)z * rows + row) * head_dim + threadIdx.x] * weight[z];
    out[row * head_dim + threadIdx.x] = __float2bfloat16(l > 0.0f ? acc / l : 0.0f);
}
