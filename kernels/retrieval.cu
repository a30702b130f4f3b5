// Exact top-k retrieval over a user's fact embeddings: one GEMV for the
// scores, then one block sorting them, on the device; the order is the
// host reference's (crates/engine/src/retrieval.rs): highest score first,
// ties to the lower row.

// scores[r] = Σ_d emb[r, d] · query[d] in f32: one warp per row, lanes
// strided over the dimension, a butterfly sum.
extern "C" __global__ void inner_products(float* scores, const float* emb, const float* query, int rows, int dim) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= rows) return;
    const float* e = emb + (size_t)warp * dim;
    float s = 0.0f;
    for (int d = lane; d < dim; d += 32) s += e[d] * query[d];
    s = warp_sum(s);
    if (lane == 0) scores[warp] = s;
}

// Whether (a, ia) goes before (b, ib) in retrieval order.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

// The first k rows of `scores` in retrieval order, into ids: one block
// bitonic-sorts (score, row) pairs in shared memory, padded to `n`, a power
// of two (dynamic shared memory of 8·n bytes); padding ranks last.
extern "C" __global__ void top_k_sorted(u32* ids, const float* scores, int rows, int n, int k) {
    extern __shared__ __align__(16) unsigned char topk_smem[];
    float* key = (float*)topk_smem;
    int* row = (int*)(key + n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        key[i] = i < rows ? scores[i] : NEG_INF;
        row[i] = i < rows ? i : 0x7fffffff;
    }
    for (int size = 2; size <= n; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
                const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                // Runs of `size` alternate direction until the last merge,
                // where every run is in retrieval order.
                const bool forward = (lo & size) == 0;
                if (forward == ranks_before(key[hi], row[hi], key[lo], row[lo])) {
                    const float tk = key[lo];
                    const int tr = row[lo];
                    key[lo] = key[hi];
                    row[lo] = row[hi];
                    key[hi] = tk;
                    row[hi] = tr;
                }
            }
        }
    __syncthreads();
    for (int i = threadIdx.x; i < k; i += blockDim.x) ids[i] = (u32)row[i];
}
