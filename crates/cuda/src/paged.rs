//! The CUDA backend's paged KV cache ([`PagedKv`]): the store, writes of
//! computed and injected K and V, gathers, block copies and paged
//! attention.

use std::sync::atomic::AtomicBool;

use cudarc::driver::LaunchConfig;
use half::bf16;
use inferscale_engine::Result;
use inferscale_engine::backend::{
    AttentionShape, DecodeGraphs, DecodeStep, InjectChunk, KvCacheDtype, KvSpec, NewRows, PagedKv, SeqSpan, StepForward,
};
use inferscale_engine::rope::Rope;

use crate::backend::*;
use crate::error::CudaError;
use crate::kernels::{ATTN_KEYS, ATTN_ROWS, ATTN_THREADS, attention_fp8_smem_bytes, attention_smem_bytes};

impl PagedKv for CudaBackend {
    type KvStore = CudaKvStore;

    fn kv_bytes_per_value(&self) -> usize {
        2
    }

    fn qkv_rope_write(
        &self,
        qkv: &CudaTensor,
        shape: AttentionShape,
        rope: &Rope,
        rows: NewRows<'_>,
        store: &mut CudaKvStore,
        layer: usize,
    ) -> Result<CudaTensor> {
        match store.cache {
            KvBuffers::Bf16 { .. } => self.fused_qkv_rope_write(qkv, shape, rope, rows, store, layer),
            KvBuffers::Fp8(_) => self.fp8_qkv_rope_write(qkv, shape, rope, rows, store, layer),
        }
    }

    fn new_kv_store(&self, spec: KvSpec) -> Result<CudaKvStore> {
        if spec.head_dim != 64 && spec.head_dim != 128 {
            return Err(CudaError::Unsupported(format!(
                "head_dim {}: the CUDA attention kernels are built for 64 and 128",
                spec.head_dim
            ))
            .into());
        }
        let layer_elems = spec.capacity() * spec.kv_dim();
        let total = layer_elems * spec.num_layers;
        let cache = match spec.dtype {
            KvCacheDtype::Native => KvBuffers::Bf16 {
                k: self.stream.alloc_zeros::<bf16>(total.max(1)).cu()?,
                v: self.stream.alloc_zeros::<bf16>(total.max(1)).cu()?,
            },
            KvCacheDtype::Fp8 => KvBuffers::Fp8(Box::new(self.new_fp8_cache(spec)?)),
        };
        let ready =
            (0..spec.num_layers).map(|_| self.ctx.new_event(None)).collect::<std::result::Result<_, _>>().cu()?;
        let pending = (0..spec.num_layers).map(|_| AtomicBool::new(false)).collect();
        Ok(CudaKvStore { spec, cache, layer_elems, ready, pending, stream: self.stream.clone() })
    }

    fn calibrate_kv(&self, store: &mut CudaKvStore, offsets: &[Vec<f32>], rope: &Rope) -> Result<()> {
        self.calibrate_fp8(store, offsets, rope)
    }

    fn write_kv(
        &self,
        store: &mut CudaKvStore,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        rows: NewRows<'_>,
        rope: &Rope,
    ) -> Result<()> {
        if let KvBuffers::Fp8(_) = store.cache {
            return self.fp8_write_kv(store, layer, k, v, rows, rope);
        }
        let _span = self.span("write_kv");
        let slots = rows.slots;
        let kv_dim = store.spec.kv_dim();
        store.spec.check(layer, slots)?;
        if k.rows != slots.len() || v.rows != slots.len() || k.cols != kv_dim || v.cols != kv_dim {
            return Err(shape_err(format!("write_kv: {} slots for K [{}, {}]", slots.len(), k.rows, k.cols)));
        }
        let (kc, vc) = self.layer_ptrs(store, layer)?;
        let s = self.meta(slots)?;
        let (kp, vp, sp, d) = (self.tp(k), self.tp(v), self.ptr(&s), kv_dim as i32);
        self.launch(&self.k.write_kv, Self::rows_cfg(slots.len(), 256), &[&kc, &vc, &kp, &vp, &sp, &d])
    }

    fn inject_kv(&self, store: &mut CudaKvStore, chunks: &[InjectChunk<'_, CudaTensor>], rope: &Rope) -> Result<()> {
        self.inject(store, chunks, rope)
    }

    fn gather_kv(&self, store: &CudaKvStore, layer: usize, slots: &[u32]) -> Result<(CudaTensor, CudaTensor)> {
        if let KvBuffers::Fp8(_) = store.cache {
            return self.fp8_gather_kv(store, layer, slots);
        }
        let _span = self.span("gather_kv");
        store.spec.check(layer, slots)?;
        let kv_dim = store.spec.kv_dim();
        let (k, v) = (self.tensor(slots.len(), kv_dim)?, self.tensor(slots.len(), kv_dim)?);
        let (kc, vc) = self.layer_ptrs(store, layer)?;
        let s = self.meta(slots)?;
        let (kp, vp, sp, d) = (self.tp(&k), self.tp(&v), self.ptr(&s), kv_dim as i32);
        self.launch(&self.k.gather_kv, Self::rows_cfg(slots.len(), 256), &[&kp, &vp, &kc, &vc, &sp, &d])?;
        Ok((k, v))
    }

    fn copy_blocks(&self, store: &mut CudaKvStore, pairs: &[(u32, u32)]) -> Result<()> {
        let _span = self.span("copy_blocks");
        let spec = store.spec;
        if let Some(p) = pairs.iter().find(|(s, d)| *s as usize >= spec.num_blocks || *d as usize >= spec.num_blocks) {
            return Err(shape_err(format!("copy_blocks: block pair {p:?} of {}", spec.num_blocks)));
        }
        if let KvBuffers::Fp8(_) = store.cache {
            return self.fp8_copy_blocks(store, pairs);
        }
        self.await_all_layers(store)?;
        let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
        let dev = self.stream.clone_htod(if flat.is_empty() { &[0u32][..] } else { &flat }).cu()?;
        let (kc, vc) = self.kv_ptrs(store)?;
        let pp = self.ptr(&dev);
        let (le, be) = (store.layer_elems, (spec.block_size * spec.kv_dim()) as i32);
        let cfg = LaunchConfig {
            grid_dim: (pairs.len() as u32, spec.num_layers as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(&self.k.copy_blocks, cfg, &[&kc, &vc, &pp, &le, &be])
    }

    fn decode_graph_rows(&self, rows: usize) -> Option<usize> {
        self.graph_rows(rows)
    }

    fn run_decode_graph(
        &self,
        graphs: &mut DecodeGraphs,
        store: &mut CudaKvStore,
        step: &DecodeStep<'_>,
        forward: &mut StepForward<'_, Self>,
    ) -> Result<CudaTensor> {
        self.decode_graph(graphs, store, step, forward)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        store: &CudaKvStore,
        layer: usize,
        shape: AttentionShape,
        spans: &[SeqSpan<'_>],
    ) -> Result<CudaTensor> {
        let _span = self.span("attention");
        let spec = store.spec;
        let d = shape.head_dim;
        spec.check(layer, &[])?;
        if d != spec.head_dim
            || shape.num_kv_heads != spec.num_kv_heads
            || !shape.num_heads.is_multiple_of(shape.num_kv_heads)
        {
            return Err(shape_err("attention: shape disagrees with the KV store".into()));
        }
        if q.cols != shape.num_heads * d {
            return Err(shape_err(format!("attention: q width {} for {} heads", q.cols, shape.num_heads)));
        }
        if let Some(c) = &self.capture {
            // A decode graph's step: its plan was uploaded before the
            // capture (one work per sequence), and the kernel sizes each
            // sequence's key splits from its own context length.
            if spans.len() != c.rows || q.rows != c.rows || shape.num_heads / shape.num_kv_heads > ATTN_ROWS {
                return Err(shape_err(format!(
                    "attention: a decode graph of {} rows for {} spans",
                    c.rows,
                    spans.len()
                )));
            }
            let plan = AttnLaunch {
                meta: self.ptr(&c.plan),
                row_ends: 0,
                works_off: c.works_off,
                tables_off: c.tables_off,
                works: c.rows,
                splits: c.splits,
                keys_per_split: 0,
            };
            return self.launch_attention(q, store, layer, shape, &plan);
        }
        let plan = plan_attention(spans, shape, q.rows, spec, 2 * self.sm_count)?;
        let meta = self.meta(&plan.meta)?;
        // Per query row, the cache entries it sees, only when some span's
        // rows are scattered (kv+blend); the kernel derives them otherwise.
        let row_ends = if spans.iter().any(|s| s.row_ends.is_some()) {
            let mut ends = vec![0u32; q.rows];
            for s in spans {
                for r in 0..s.q_len {
                    ends[s.q_start + r] = s.row_end(r) as u32;
                }
            }
            Some(self.meta(&ends)?)
        } else {
            None
        };
        let launch = AttnLaunch {
            meta: self.ptr(&meta),
            row_ends: row_ends.as_ref().map_or(0, |e| self.ptr(e)),
            works_off: plan.works_off,
            tables_off: plan.tables_off,
            works: plan.works,
            splits: plan.splits,
            keys_per_split: plan.keys_per_split,
        };
        self.launch_attention(q, store, layer, shape, &launch)
    }
}

/// Where one paged-attention launch finds its metadata, and its grid.
struct AttnLaunch {
    meta: u64,
    /// 0: rows end where the kernel derives.
    row_ends: u64,
    works_off: usize,
    tables_off: usize,
    works: usize,
    splits: usize,
    /// 0: each span's keys split evenly over `splits` (decode graphs).
    keys_per_split: usize,
}

impl CudaBackend {
    fn launch_attention(
        &self,
        q: &CudaTensor,
        store: &CudaKvStore,
        layer: usize,
        shape: AttentionShape,
        plan: &AttnLaunch,
    ) -> Result<CudaTensor> {
        let (d, spec) = (shape.head_dim, store.spec);
        let out = self.tensor(q.rows, q.cols)?;
        let rows = q.rows * shape.num_heads;
        // Partial results only when keys are split across blocks.
        let (part_o, part_ml) = if plan.splits > 1 {
            // SAFETY: the kernel writes every (split, row) entry before the combine reads it.
            unsafe {
                (
                    Some(self.stream.alloc::<f32>(plan.splits * rows * d).cu()?),
                    Some(self.stream.alloc::<f32>(plan.splits * rows * 2).cu()?),
                )
            }
        } else {
            (None, None)
        };
        let (o, qp, mp, ep) = (self.tp(&out), self.tp(q), plan.meta, plan.row_ends);
        let po = part_o.as_ref().map_or(0, |p| self.ptr(p));
        let pm = part_ml.as_ref().map_or(0, |p| self.ptr(p));
        let (wo, to) = (plan.works_off as u32, plan.tables_off as u32);
        let (h, kvh, bs) = (shape.num_heads as i32, shape.num_kv_heads as i32, spec.block_size as i32);
        let (kps, nt) = (plan.keys_per_split as u32, q.rows as u32);
        let grid_dim = (plan.works as u32, shape.num_kv_heads as u32, plan.splits as u32);
        let block_dim = (ATTN_THREADS, 1, 1);
        match store.cache {
            KvBuffers::Bf16 { .. } => {
                let (kc, vc) = self.layer_ptrs(store, layer)?;
                let cfg = LaunchConfig { grid_dim, block_dim, shared_mem_bytes: attention_smem_bytes(d) as u32 };
                let f = if d == 64 { &self.k.paged_attention_d64 } else { &self.k.paged_attention_d128 };
                self.launch_pdl(
                    f,
                    cfg,
                    &[&o, &po, &pm, &qp, &kc, &vc, &mp, &ep, &wo, &to, &h, &kvh, &bs, &shape.scale, &kps, &nt],
                )?;
            }
            KvBuffers::Fp8(_) => {
                let (l, t) = (self.fp8_layer(store, layer)?, self.offset_tables(store));
                let cfg = LaunchConfig { grid_dim, block_dim, shared_mem_bytes: attention_fp8_smem_bytes(d) as u32 };
                let f = if d == 64 { &self.k.paged_attention_fp8_d64 } else { &self.k.paged_attention_fp8_d128 };
                self.launch_pdl(
                    f,
                    cfg,
                    &[
                        &o,
                        &po,
                        &pm,
                        &qp,
                        &l.k,
                        &l.v,
                        &mp,
                        &ep,
                        &wo,
                        &to,
                        &h,
                        &kvh,
                        &bs,
                        &shape.scale,
                        &kps,
                        &nt,
                        &l.k_scale,
                        &l.v_scale,
                        &l.positions,
                        &l.offsets,
                        &t.cos,
                        &t.sin,
                        &t.inv_freq,
                        &t.positions,
                        &t.rot,
                    ],
                )?;
            }
        }
        if plan.splits > 1 {
            let (r, s, hd) = (rows as u32, plan.splits as i32, d as i32);
            let cfg = LaunchConfig { shared_mem_bytes: (4 * plan.splits) as u32, ..Self::rows_cfg(rows, d as u32) };
            self.launch_pdl(&self.k.attention_combine, cfg, &[&o, &po, &pm, &r, &s, &hd])?;
        }
        Ok(out)
    }
}

/// How one attention call is cut into blocks (see `paged_attention` in
/// kernels/attention.cu for the layout of `meta`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct AttentionPlan {
    pub meta: Vec<u32>,
    pub works_off: usize,
    pub tables_off: usize,
    pub works: usize,
    pub splits: usize,
    pub keys_per_split: usize,
}

/// Packs the spans into 64-row works and, when that leaves the device
/// under-filled (few query rows: decode, short questions), splits each
/// sequence's keys so that about `target` blocks run (at least two key
/// tiles per split, which the kernel's double buffering overlaps). The
/// kernel's registers and shared memory fit two blocks per multiprocessor,
/// so the caller asks for two per multiprocessor: one wave (measured on the
/// H200: four or eight per multiprocessor, in two or more waves, were slower
/// at 5,000 keys).
pub(crate) fn plan_attention(
    spans: &[SeqSpan<'_>],
    shape: AttentionShape,
    rows: usize,
    spec: KvSpec,
    target: usize,
) -> Result<AttentionPlan> {
    let group = shape.num_heads / shape.num_kv_heads;
    let mut meta = Vec::with_capacity(4 * spans.len());
    let mut works = Vec::new();
    let mut tables = Vec::new();
    let mut max_ctx = 0;
    for (i, s) in spans.iter().enumerate() {
        s.check()?;
        let blocks_needed = s.context_len.div_ceil(spec.block_size);
        if s.q_len == 0 || s.q_len > s.context_len || s.q_start + s.q_len > rows || s.block_table.len() < blocks_needed
        {
            return Err(shape_err(format!(
                "attention span {i}: {} new of {} tokens at row {} ({} rows, {} blocks)",
                s.q_len,
                s.context_len,
                s.q_start,
                rows,
                s.block_table.len()
            )));
        }
        if let Some(b) = s.block_table[..blocks_needed].iter().find(|&&b| b as usize >= spec.num_blocks) {
            return Err(shape_err(format!("attention span {i}: block {b} of {}", spec.num_blocks)));
        }
        meta.extend([s.q_start as u32, s.q_len as u32, s.context_len as u32, tables.len() as u32]);
        tables.extend_from_slice(&s.block_table[..blocks_needed]);
        for r0 in (0..s.q_len * group).step_by(ATTN_ROWS) {
            works.extend([i as u32, r0 as u32]);
        }
        max_ctx = max_ctx.max(s.context_len);
    }
    let n_works = works.len() / 2;
    let blocks = n_works * shape.num_kv_heads;
    let mut splits = if blocks >= target { 1 } else { target.div_ceil(blocks.max(1)) };
    splits = splits.min(max_ctx.div_ceil(2 * ATTN_KEYS)).max(1);
    let keys_per_split = max_ctx.div_ceil(splits).div_ceil(ATTN_KEYS) * ATTN_KEYS;
    let splits = max_ctx.div_ceil(keys_per_split.max(1)).max(1);
    let works_off = meta.len();
    meta.extend(works);
    let tables_off = meta.len();
    meta.extend(tables);
    Ok(AttentionPlan { meta, works_off, tables_off, works: n_works, splits, keys_per_split })
}
