//! The backend trait: the tensor operations one Llama-family forward pass
//! needs, and nothing about models.
//!
//! Tensors are 2-D, row-major `[rows, cols]` (tokens × features, or a weight
//! `[out, in]`). Metadata that steers kernels (positions, cache slots,
//! per-sequence attention spans) stays on the host in plain slices; a device
//! backend uploads it once per forward.

use inferscale_model::HostTensor;

use crate::error::{EngineError, Result};
use crate::rope::Rope;

/// What the paged cache holds per element (`--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The backend's own precision (f32 on the CPU, bf16 on CUDA).
    #[default]
    Native,
    /// e4m3 codes with a scale per (token, KV head); keys relative to a
    /// per-layer channel offset rotated with them (docs/design.md §2.2,
    /// [`crate::fp8_cache`]). A quarter of the CPU's bytes.
    Fp8,
}

impl KvCacheDtype {
    /// Bytes one token's K and V take in every layer of a cache of this
    /// dtype, `native` bytes per element where it is [`KvCacheDtype::Native`]
    /// (fp8: a byte per element, an f32 scale per head row, and the slot's
    /// position, which reads need to rotate its key's offset).
    pub fn bytes_per_token(self, num_layers: usize, num_kv_heads: usize, head_dim: usize, native: usize) -> usize {
        match self {
            KvCacheDtype::Native => 2 * num_layers * num_kv_heads * head_dim * native,
            KvCacheDtype::Fp8 => 2 * num_layers * num_kv_heads * (head_dim + 4) + 4,
        }
    }
}

/// Shape of the paged KV store a backend allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvCacheDtype,
}

impl KvSpec {
    /// Elements of one token's K (or V) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Token slots per layer.
    pub fn capacity(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Checks that every slot lies in the store, before a backend touches any.
    pub fn check_slots(&self, slots: &[u32]) -> Result<()> {
        match slots.iter().find(|&&s| s as usize >= self.capacity()) {
            Some(s) => Err(EngineError::Shape(format!("KV slot {s} beyond the cache's {}", self.capacity()))),
            None => Ok(()),
        }
    }

    /// [`KvSpec::check_slots`], and that `layer` exists.
    pub fn check(&self, layer: usize, slots: &[u32]) -> Result<()> {
        if layer >= self.num_layers {
            return Err(EngineError::Shape(format!("KV layer {layer} of {}", self.num_layers)));
        }
        self.check_slots(slots)
    }
}

pub use crate::shape::matrix_dims;

/// Prints a backend profiler's table to stderr: per op, its count, total
/// and mean time and share, slowest first, under `inferscale {backend}
/// profile ({clock} time per op, {phase}; … ms in all)`. `totals` maps each
/// op to (calls, milliseconds).
pub fn print_op_profile(
    backend: &str,
    clock: &str,
    phase: Option<&str>,
    totals: &std::collections::BTreeMap<&'static str, (usize, f64)>,
) {
    let total: f64 = totals.values().map(|v| v.1).sum();
    let phase = phase.map(|p| format!(", {p}")).unwrap_or_default();
    eprintln!("inferscale {backend} profile ({clock} time per op{phase}; {total:.3} ms in all):");
    eprintln!("{:<20} {:>9} {:>12} {:>10} {:>7}", "op", "count", "total ms", "mean µs", "share");
    let mut rows: Vec<_> = totals.iter().collect();
    rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    for (op, (n, ms)) in rows {
        eprintln!("{op:<20} {n:>9} {ms:>12.3} {:>10.2} {:>6.1}%", ms * 1e3 / *n as f64, 100.0 * ms / total.max(1e-9));
    }
}

/// One sequence's part of a batched attention call.
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan<'a> {
    /// First row of this sequence's queries in the batch.
    pub q_start: usize,
    /// Number of new query rows (tokens being computed now).
    pub q_len: usize,
    /// Tokens in the cache after this step, new ones included. The new tokens
    /// take positions `context_len - q_len .. context_len`; each attends to
    /// every cached position up to and including its own.
    pub context_len: usize,
    pub block_table: &'a [u32],
    /// For rows that are not the cache's last `q_len` entries — tokens
    /// recomputed in place among injected ones (`crate::blend`) — how many
    /// cache entries each row sees: its own index + 1, ascending, at most
    /// `context_len`. `None`: row `r` sees `context_len − q_len + r + 1`.
    pub row_ends: Option<&'a [u32]>,
}

impl SeqSpan<'_> {
    /// How many cache entries (from index 0) row `r` of the span attends to.
    pub fn row_end(&self, r: usize) -> usize {
        match self.row_ends {
            Some(ends) => ends[r] as usize,
            None => self.context_len - self.q_len + r + 1,
        }
    }

    /// How many of rows `r0..r1` see no more than `key` cache entries —
    /// those for which entry `key` lies in their future (rows' ends ascend).
    pub fn rows_ending_by(&self, r0: usize, r1: usize, key: usize) -> usize {
        match self.row_ends {
            Some(ends) => ends[r0..r1].partition_point(|&e| e as usize <= key),
            None => (key + 1).saturating_sub(self.context_len - self.q_len + r0 + 1).min(r1 - r0),
        }
    }

    /// Checks the span's own consistency: `q_len` rows fit the context, and
    /// `row_ends`, when set, has one entry per row, ascending, each in
    /// `1..=context_len`. Backends check the rest (rows, blocks).
    pub fn check(&self) -> Result<()> {
        if self.q_len > self.context_len {
            return Err(EngineError::Shape(format!("{} new rows in a context of {}", self.q_len, self.context_len)));
        }
        if let Some(ends) = self.row_ends {
            let ordered = ends.windows(2).all(|w| w[0] < w[1]);
            let inside =
                ends.first().is_none_or(|&e| e >= 1) && ends.last().is_none_or(|&e| e as usize <= self.context_len);
            if ends.len() != self.q_len || !ordered || !inside {
                return Err(EngineError::Shape(format!(
                    "row ends of a span of {} rows in a context of {}: {} ends, ascending {ordered}, inside {inside}",
                    self.q_len,
                    self.context_len,
                    ends.len()
                )));
            }
        }
        Ok(())
    }
}

/// Geometry of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier of q·k, normally `1/sqrt(head_dim)`.
    pub scale: f32,
}

/// Where a forward's new rows go: their positions and their cache slots.
#[derive(Debug, Clone, Copy)]
pub struct NewRows<'a> {
    pub positions: &'a [u32],
    pub slots: &'a [u32],
}

/// One chunk of pre-RoPE KV to write into the cache: per layer `k[l]` and
/// `v[l]` of shape `[n, kv_heads·head_dim]`, token `i` going to cache slot
/// `slots[i]` with its key rotated to `positions[i]`.
pub struct InjectChunk<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub positions: &'a [u32],
    pub slots: &'a [u32],
}

/// A backend's upload of stored KV that any thread may call
/// ([`Backend::host_tier_upload`], [`Backend::device_tier_upload`]): stored
/// KV tensors in, the backend's tensors (in the tier it places them in) out.
pub type KvUpload<T> = std::sync::Arc<dyn Fn(&[&HostTensor]) -> Result<Vec<T>> + Send + Sync>;

pub use crate::fp8::Fp8Kv;

/// A backend's upload of fp8 KV as stored, kept as fp8 where it is placed
/// ([`Backend::host_tier_upload_fp8`], [`Backend::device_tier_upload_fp8`]).
pub type KvUploadFp8<T> = std::sync::Arc<dyn Fn(&Fp8Kv<'_>) -> Result<Vec<T>> + Send + Sync>;

/// Tensor operations over some device: uploads, the layers' ops, and
/// reading results back. Implementations know nothing of models.
pub trait Tensors: Send + Sync + 'static {
    type Tensor: Send + Sync;

    fn name(&self) -> &'static str;

    /// Waits until all queued work is done (device backends queue work
    /// asynchronously; timing a region needs this at both ends).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Runs `f` — a forward pass, an injection — where the backend's
    /// operations are best issued from. Device backends run it as is; the
    /// CPU backend runs it on one of its worker threads, so that the dozen
    /// parallel operations of each layer fork and join inside the thread
    /// pool rather than each waking the pool from outside and putting the
    /// caller to sleep until it is done.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Starts a new phase of the backend's own per-op profiling, if it has
    /// any and it is on (the CUDA backend's `INFERSCALE_CUDA_PROFILE=1`):
    /// what was measured so far is reported under the previous phase.
    /// Benchmarks mark their timed regions with it.
    fn profile_phase(&self, _name: &str) {}

    /// Copies a weight to the device, in whatever layout the backend's
    /// matrix kernels want (only `linear` and `embedding` read weights).
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;

    /// Copies an activation-like tensor (e.g. stored KV) to the device as a
    /// plain row-major matrix, usable by every op.
    fn upload_rows(&self, t: &HostTensor) -> Result<Self::Tensor>;

    /// Copies a tensor back as row-major f32.
    fn to_host(&self, t: &Self::Tensor) -> Result<HostTensor>;

    /// `(rows, cols)`.
    fn dims(&self, t: &Self::Tensor) -> (usize, usize);

    /// Rows of `table` picked by `ids`.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;

    /// RMSNorm of each row, times `weight`.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;

    /// `x · wᵀ (+ bias)`: `x [n, in]`, `w [out, in]`, result `[n, out]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Tensor, bias: Option<&Self::Tensor>) -> Result<Self::Tensor>;

    /// Rotates each `head_dim` slice of row `i` to `positions[i]` in place.
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, positions: &[u32], rope: &Rope) -> Result<()>;

    /// LayerNorm of each row: `(x − mean) / sqrt(var + eps) · weight + bias`.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;

    /// GELU (the exact, erf-based form), elementwise.
    fn gelu(&self, x: &Self::Tensor) -> Result<Self::Tensor>;

    /// `silu(a) * b` elementwise, where each row of `gate_up` is `[a | b]`
    /// (the fused gate and up projections); the result has half the columns.
    fn silu_mul(&self, gate_up: &Self::Tensor) -> Result<Self::Tensor>;

    /// `silu_mul(linear(x, w, bias))`: the MLP's gate and up projections and
    /// its activation, which devices fuse where it pays (a decode step's few
    /// rows).
    fn linear_silu_mul(&self, x: &Self::Tensor, w: &Self::Tensor, bias: Option<&Self::Tensor>) -> Result<Self::Tensor> {
        self.silu_mul(&self.linear(x, w, bias)?)
    }

    /// Consecutive column blocks of `x` of the given widths (e.g. Q, K and V
    /// out of one fused projection), as separate tensors.
    fn split_cols(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;

    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;

    /// `x += y`, then RMSNorm of each row of `x` times `weight`: a residual
    /// add and the norm after it, one kernel on devices.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, eps)
    }

    /// The listed rows of `x`, in order.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;

    /// Per row of `x`, the column of its largest value (the lowest on
    /// ties): greedy sampling without copying logits to the host. The
    /// default reads the rows back; device backends reduce in place.
    fn argmax_rows(&self, x: &Self::Tensor) -> Result<Vec<u32>> {
        let h = self.to_host(x)?;
        let (rows, cols) = self.dims(x);
        Ok((0..rows).map(|r| crate::sampling::argmax(&h.data[r * cols..(r + 1) * cols])).collect())
    }

    /// Per row, `Σ (a − b)²` over its columns (`a` and `b` of one shape):
    /// how far recomputed KV moved from the injected KV it replaces, which
    /// ranks the tokens kv+blend keeps recomputing. The default reads both
    /// back; device backends reduce in place.
    fn row_sq_distance(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Vec<f32>> {
        let (rows, cols) = self.dims(a);
        if self.dims(b) != (rows, cols) {
            return Err(EngineError::Shape(format!("row distance of {:?} and {:?}", (rows, cols), self.dims(b))));
        }
        let (a, b) = (self.to_host(a)?, self.to_host(b)?);
        Ok(a.data
            .chunks_exact(cols.max(1))
            .zip(b.data.chunks_exact(cols.max(1)))
            .map(|(x, y)| x.iter().zip(y).map(|(x, y)| (x - y) * (x - y)).sum())
            .collect())
    }

    /// kv+blend's question-aware rank: for each row of `k` (rotated keys,
    /// `[n, kv_heads·head_dim]`), the attention the rows of `q` (rotated
    /// queries, `[m, heads·head_dim]`) pay it, each row and head's softmax
    /// taken over `k`'s rows alone, summed ([`attention_mass`]).
    /// The default reads both back; device backends reduce in place.
    fn attention_mass(&self, q: &Self::Tensor, k: &Self::Tensor, shape: AttentionShape) -> Result<Vec<f32>> {
        let (qc, kc) = (self.dims(q).1, self.dims(k).1);
        if qc != shape.num_heads * shape.head_dim || kc != shape.num_kv_heads * shape.head_dim {
            return Err(EngineError::Shape(format!("attention mass of q width {qc}, k width {kc} for {shape:?}")));
        }
        let (q, k) = (self.to_host(q)?, self.to_host(k)?);
        Ok(attention_mass(&q.data, &k.data, shape))
    }

    /// Stacks tensors of equal width row-wise.
    fn concat_rows(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor>;

    /// Bidirectional attention without a cache (encoders): rows
    /// `start..start + len` of each span attend to every row of that span.
    /// `q`, `k`, `v` and the result are `[n, heads·head_dim]` (no GQA).
    fn attention_bidirectional(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        shape: AttentionShape,
        spans: &[(usize, usize)],
    ) -> Result<Self::Tensor>;
}

/// The paged KV cache: its store, writes of computed and injected K and
/// V, reads for attention and for kv+blend's ranking, block copies.
pub trait PagedKv: Tensors {
    /// Paged K and V for every layer.
    type KvStore: Send;

    /// Bytes one K or V element takes in the cache (sizes the block pool).
    fn kv_bytes_per_value(&self) -> usize;

    /// A layer's attention inputs from its fused QKV projection (rows
    /// `[Q | K | V]`, widths from `shape`): Q and K rotated to
    /// `rows.positions`, K and V written to `rows.slots` of `layer`; returns
    /// Q. Exactly `split_cols`, two `rope`s and `write_kv`, which devices
    /// fuse into one kernel.
    fn qkv_rope_write(
        &self,
        qkv: &Self::Tensor,
        shape: AttentionShape,
        rope: &Rope,
        rows: NewRows<'_>,
        store: &mut Self::KvStore,
        layer: usize,
    ) -> Result<Self::Tensor> {
        let d = shape.head_dim;
        let widths = [shape.num_heads * d, shape.num_kv_heads * d, shape.num_kv_heads * d];
        let [mut q, mut k, v]: [Self::Tensor; 3] = self
            .split_cols(qkv, &widths)?
            .try_into()
            .map_err(|_| EngineError::Shape("split_cols returned the wrong number of parts".into()))?;
        self.rope(&mut q, d, rows.positions, rope)?;
        self.rope(&mut k, d, rows.positions, rope)?;
        self.write_kv(store, layer, &k, &v, rows, rope)?;
        Ok(q)
    }

    /// A store of `spec`; a backend without a cache of `spec.dtype` refuses.
    fn new_kv_store(&self, spec: KvSpec) -> Result<Self::KvStore>;

    /// Sets the per-layer key offsets (`[kv_heads·head_dim]` each, before
    /// RoPE) of a store that keeps keys relative to them (fp8), and the
    /// rotation it turns them with. Calibrate before the first write: keys
    /// written earlier were stored against other offsets. Stores of native
    /// precision keep keys exactly and ignore it (the default).
    fn calibrate_kv(&self, _store: &mut Self::KvStore, _offsets: &[Vec<f32>], _rope: &Rope) -> Result<()> {
        Ok(())
    }

    /// Writes row `i` of `k` and `v` (`[n, kv_heads·head_dim]`, keys
    /// already rotated to `rows.positions[i]` by `rope`) to cache slot
    /// `rows.slots[i]` of `layer`. A store of native precision needs only
    /// the slots; an fp8 store rounds each key relative to its offset
    /// rotated to the key's position.
    fn write_kv(
        &self,
        store: &mut Self::KvStore,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        rows: NewRows<'_>,
        rope: &Rope,
    ) -> Result<()>;

    /// Re-rotates pre-RoPE keys to their target positions and scatters K and
    /// V into the cache, for every layer and chunk in one call (one fused
    /// launch on devices that can).
    fn inject_kv(&self, store: &mut Self::KvStore, chunks: &[InjectChunk<'_, Self::Tensor>], rope: &Rope)
    -> Result<()>;

    /// The K and V stored at `slots` of `layer` (`[n, kv_heads·head_dim]` each).
    fn gather_kv(&self, store: &Self::KvStore, layer: usize, slots: &[u32]) -> Result<(Self::Tensor, Self::Tensor)>;

    /// Copies whole blocks `(src, dst)` in every layer (copy-on-write of a shared prefix).
    fn copy_blocks(&self, store: &mut Self::KvStore, pairs: &[(u32, u32)]) -> Result<()>;

    /// Causal attention of `q [n, heads·head_dim]` over the paged cache of
    /// `layer`, one span per sequence. Returns `[n, heads·head_dim]`.
    fn attention(
        &self,
        q: &Self::Tensor,
        store: &Self::KvStore,
        layer: usize,
        shape: AttentionShape,
        spans: &[SeqSpan<'_>],
    ) -> Result<Self::Tensor>;

    /// The batch size a replayed decode step of `rows` sequences runs at
    /// (the engine pads the batch up to it), or `None` where the backend
    /// replays no captured steps — the default — or `rows` is past its
    /// largest graph.
    fn decode_graph_rows(&self, _rows: usize) -> Option<usize> {
        None
    }

    /// A decode step (one new token per sequence, `step` padded to
    /// [`PagedKv::decode_graph_rows`]) run as a captured graph: the first
    /// time a batch size is seen, `forward` runs as is (its result is this
    /// step's) and is then captured; later steps of that size copy `step`'s
    /// rows into the graph's inputs and replay it, with no launch of their
    /// own. `forward` must run the model with the backend and store it is
    /// given. Returns the logits of the first `step.rows` rows. Device
    /// backends implement it where launches, not bytes, bound a step.
    fn run_decode_graph(
        &self,
        _graphs: &mut DecodeGraphs,
        _store: &mut Self::KvStore,
        _step: &DecodeStep<'_>,
        _forward: &mut StepForward<'_, Self>,
    ) -> Result<Self::Tensor> {
        Err(EngineError::Backend { backend: self.name(), reason: "no captured decode steps".into() })
    }
}

/// The forward pass a decode graph runs (and records): the model on the
/// backend and store it is handed, returning the step's logits.
pub type StepForward<'f, B> = dyn FnMut(&B, &mut <B as PagedKv>::KvStore) -> Result<<B as Tensors>::Tensor> + 'f;

/// What a captured decode step reads that changes from one step to the
/// next: one row per sequence (its new token, position and cache slot) and
/// each sequence's cache, padded to the graph's batch size.
#[derive(Debug, Clone, Copy)]
pub struct DecodeStep<'a> {
    /// Rows that are real sequences (the rest pad the batch).
    pub rows: usize,
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub slots: &'a [u32],
    pub spans: &'a [SeqSpan<'a>],
}

/// A backend's captured decode steps, owned by the engine whose KV store
/// they address (they are dropped with it), and how they were used.
#[derive(Default)]
pub struct DecodeGraphs {
    /// The backend's own state, opaque to the engine.
    pub state: Option<Box<dyn std::any::Any + Send>>,
    /// Graphs captured so far (a batch size's first step, or a recapture).
    pub captured: u64,
    /// Steps replayed from a graph.
    pub replayed: u64,
}

/// Where a memory's stored KV lives between requests: the device, a host
/// tier the injection reads directly, and uploads any thread may run.
pub trait KvTiers: PagedKv {
    /// Copies stored KV (each a plain row-major matrix) into the backend's
    /// host tier — memory off the device that `inject_kv` reads directly,
    /// for shards that do not fit beside the model — in one allocation.
    /// Backends without such a tier place them as `upload_rows` does.
    fn upload_rows_host_tier(&self, ts: &[&HostTensor]) -> Result<Vec<Self::Tensor>> {
        ts.iter().map(|t| self.upload_rows(t)).collect()
    }

    /// Takes `t` over as stored KV: a memory shard's pre-RoPE K or V, kept
    /// across requests and read by `inject_kv`. A backend may run an
    /// injection asynchronously with the work queued after it; for such a
    /// backend, a kept tensor's memory is released only after every
    /// injection that read it. Backends that inject synchronously keep `t`
    /// as it is.
    fn keep_kv(&self, t: Self::Tensor) -> Result<Self::Tensor> {
        Ok(t)
    }

    /// Whether `upload_rows_host_tier` puts tensors anywhere else than
    /// `upload_rows` does (a device backend's host memory).
    fn has_host_tier(&self) -> bool {
        false
    }

    /// `upload_rows_host_tier` as a value any thread may own and call
    /// (`None`: only the backend's own thread may upload). Filling pinned
    /// memory — its allocation and the conversion into it — is host work:
    /// the memory's disk readers do it, so that the thread driving the
    /// device does not.
    fn host_tier_upload(&self) -> Option<KvUpload<Self::Tensor>> {
        None
    }

    /// Like [`Backend::host_tier_upload`], for fp8 records kept as fp8 in
    /// the host tier — half of bf16's bytes there and on the bus — and
    /// dequantized by [`Backend::inject_kv`] as it writes the cache. `None`:
    /// fp8 records are decoded on the host and uploaded as any others.
    fn host_tier_upload_fp8(&self) -> Option<KvUploadFp8<Self::Tensor>> {
        None
    }

    /// Like [`Backend::host_tier_upload`], into device memory, for a backend
    /// with a host tier: KV read from disk that the memory's cache places in
    /// its device tier while that has room. The upload waits for its own
    /// copy only (a stream of its own), not for the device's other work.
    /// `None`: such reads go to the host tier.
    fn device_tier_upload(&self) -> Option<KvUpload<Self::Tensor>> {
        None
    }

    /// [`Backend::device_tier_upload`] for fp8 records, kept as fp8 in
    /// device memory and dequantized by [`Backend::inject_kv`]. `None`: fp8
    /// records bound for the device are decoded and go through
    /// [`Backend::device_tier_upload`].
    fn device_tier_upload_fp8(&self) -> Option<KvUploadFp8<Self::Tensor>> {
        None
    }

    /// Bytes `t` holds where it lives (a tensor kept as fp8 holds about
    /// half of bf16's): what the KV cache counts against its
    /// budgets.
    fn stored_bytes(&self, t: &Self::Tensor) -> usize {
        let (rows, cols) = self.dims(t);
        rows * cols * self.kv_bytes_per_value()
    }
}

/// Fact retrieval's inner products and top-k over a user's embeddings.
pub trait Retrieval: Tensors {
    /// A user's fact embeddings, where [`Backend::top_k`] searches them
    /// (device memory on a GPU backend).
    type Embeddings: Send + Sync;

    /// Uploads `rows` (`[n, dim]` row-major unit vectors) for [`Backend::top_k`].
    fn upload_embeddings(&self, rows: &[f32], dim: usize) -> Result<Self::Embeddings>;

    /// The indices of the `k` rows of `e` with the largest inner product
    /// with `query` (all rows if fewer), highest first, ties to the lower
    /// index: exactly [`crate::retrieval::top_k_host`]'s order, with scores
    /// summed in f32.
    fn top_k(&self, e: &Self::Embeddings, query: &[f32], k: usize) -> Result<Vec<u32>>;
}

/// A backend: every part of it, for the engine's generic code. Its parts
/// are implemented separately ([`Tensors`], [`PagedKv`], [`KvTiers`],
/// [`Retrieval`]); a type that implements all four is a backend.
pub trait Backend: Tensors + PagedKv + KvTiers + Retrieval {}

impl<T: Tensors + PagedKv + KvTiers + Retrieval> Backend for T {}

/// For each row of `k` (`[n, kv_heads·head_dim]`, rotated keys), the
/// attention the rows of `q` (`[m, heads·head_dim]`, rotated queries) pay
/// it: per query row and head, the softmax of `scale · q·k` over `k`'s rows
/// alone, summed over rows and heads. kv+blend's question-aware rank, on
/// the host (the default of [`Backend::attention_mass`], and the reference
/// the device's is checked against).
pub fn attention_mass(q: &[f32], k: &[f32], shape: AttentionShape) -> Vec<f32> {
    let AttentionShape { num_heads, num_kv_heads, head_dim: d, scale } = shape;
    let (qw, kw) = (num_heads * d, num_kv_heads * d);
    let (m, n) = (q.len() / qw.max(1), k.len() / kw.max(1));
    let per_kv = (num_heads / num_kv_heads.max(1)).max(1);
    let mut mass = vec![0f32; n];
    let mut p = vec![0f32; n];
    for r in 0..m {
        for h in 0..num_heads {
            let qh = &q[r * qw + h * d..][..d];
            let g = h / per_kv;
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = scale * dot(qh, &k[j * kw + g * d..][..d]);
            }
            let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for pj in p.iter_mut() {
                *pj = (*pj - max).exp();
                sum += *pj;
            }
            for (mj, pj) in mass.iter_mut().zip(&p) {
                *mj += pj / sum;
            }
        }
    }
    mass
}

/// `a · b`, in eight lanes (so that it vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}
