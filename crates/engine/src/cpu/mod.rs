//! The CPU backend: f32 everywhere, GEMMs from the `gemm` crate (runtime
//! dispatch to AVX2/AVX-512 kernels), rayon across rows and heads.
//!
//! This is the reference backend: every other backend is checked against it.

mod attention;
mod attn_kernel;
mod kv_fp8;
mod kv_store;
mod matmul;
mod packed;
mod profile;
mod vmath;

use inferscale_model::HostTensor;
use rayon::prelude::*;

use kv_store::LayerChunk;

use crate::backend::{
    AttentionShape, InjectChunk, KvSpec, KvTiers, NewRows, PagedKv, Retrieval, SeqSpan, Tensors, matrix_dims,
};
use crate::error::{EngineError, Result};
use crate::retrieval::{HostEmbeddings, top_k_host};
use crate::rope::Rope;

pub use kv_store::CpuKvStore;
pub use matmul::matmul_bt;
pub use packed::PackedMatrix;

/// A row-major f32 matrix. Weights uploaded as matrices are kept only in
/// the packed layout of the matrix kernel (`data` is then empty).
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
    packed: Option<PackedMatrix>,
}

impl CpuTensor {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor { rows, cols, data: vec![0.0; rows * cols], packed: None }
    }
}

/// The CPU backend. Threads come from rayon's global pool.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

fn shape_err(what: String) -> EngineError {
    EngineError::Shape(what)
}
impl Tensors for CpuBackend {
    type Tensor = CpuTensor;

    fn name(&self) -> &'static str {
        "cpu"
    }

    /// On a rayon worker: every parallel operation inside `f` then forks
    /// and joins within the pool. Issued from a thread outside it, each of
    /// a forward's ~300 operations would cost two futex round trips (wake
    /// the workers, then sleep until they finish), tens of µs apiece under
    /// a hypervisor.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        rayon::scope(|_| f())
    }

    fn profile_phase(&self, name: &str) {
        profile::phase(name);
    }

    fn upload(&self, t: &HostTensor) -> Result<CpuTensor> {
        let (rows, cols) = matrix_dims(t)?;
        if t.shape.len() == 2 {
            let packed = PackedMatrix::pack(rows, cols, &t.data);
            return Ok(CpuTensor { rows, cols, data: Vec::new(), packed: Some(packed) });
        }
        Ok(CpuTensor { rows, cols, data: t.data.clone(), packed: None })
    }

    fn upload_rows(&self, t: &HostTensor) -> Result<CpuTensor> {
        let (rows, cols) = matrix_dims(t)?;
        Ok(CpuTensor { rows, cols, data: t.data.clone(), packed: None })
    }

    fn to_host(&self, t: &CpuTensor) -> Result<HostTensor> {
        let data = match &t.packed {
            Some(p) => p.unpack(),
            None => t.data.clone(),
        };
        Ok(HostTensor { shape: vec![t.rows, t.cols], data })
    }

    fn dims(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        let _t = profile::span("embedding");
        let mut out = CpuTensor::zeros(ids.len(), table.cols);
        for (row, &id) in out.data.chunks_exact_mut(table.cols).zip(ids) {
            let id = id as usize;
            if id >= table.rows {
                return Err(EngineError::TokenOutOfRange { id: id as u32, vocab: table.rows });
            }
            match &table.packed {
                Some(p) => p.row(id, row),
                None => row.copy_from_slice(&table.data[id * table.cols..(id + 1) * table.cols]),
            }
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let _t = profile::span("rms_norm");
        if weight.data.len() != x.cols {
            return Err(shape_err(format!("rms_norm weight {} for width {}", weight.data.len(), x.cols)));
        }
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        out.data.par_chunks_mut(x.cols).zip(x.data.par_chunks(x.cols)).for_each(|(o, r)| {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / x.cols as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), w) in o.iter_mut().zip(r).zip(&weight.data) {
                *o = w * (v * inv);
            }
        });
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        let _t = profile::span("linear");
        if x.cols != w.cols {
            return Err(shape_err(format!("linear: x [{}, {}] · w [{}, {}]ᵀ", x.rows, x.cols, w.rows, w.cols)));
        }
        let mut out = CpuTensor::zeros(x.rows, w.rows);
        match &w.packed {
            Some(p) => p.matmul(&x.data, x.rows, &mut out.data),
            None => matmul_bt(&mut out.data, &x.data, &w.data, x.rows, w.rows, x.cols),
        }
        if let Some(b) = bias {
            if b.data.len() != w.rows {
                return Err(shape_err(format!("bias of {} for {} outputs", b.data.len(), w.rows)));
            }
            out.data.par_chunks_mut(w.rows).for_each(|row| {
                for (o, b) in row.iter_mut().zip(&b.data) {
                    *o += b;
                }
            });
        }
        Ok(out)
    }

    fn rope(&self, x: &mut CpuTensor, head_dim: usize, positions: &[u32], rope: &Rope) -> Result<()> {
        let _t = profile::span("rope");
        if positions.len() != x.rows || !x.cols.is_multiple_of(head_dim) || rope.dim() > head_dim {
            return Err(shape_err(format!(
                "rope: {} positions for [{}, {}] with head_dim {head_dim}",
                positions.len(),
                x.rows,
                x.cols
            )));
        }
        x.data.par_chunks_mut(x.cols).zip(positions).for_each(|(row, &p)| {
            let (mut cos, mut sin) = (Vec::with_capacity(head_dim / 2), Vec::with_capacity(head_dim / 2));
            rope.cos_sin(p, &mut cos, &mut sin);
            for head in row.chunks_exact_mut(head_dim) {
                rope.rotate(head, &cos, &sin);
            }
        });
        Ok(())
    }

    fn layer_norm(&self, x: &CpuTensor, weight: &CpuTensor, bias: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let _t = profile::span("layer_norm");
        if weight.data.len() != x.cols || bias.data.len() != x.cols {
            return Err(shape_err(format!("layer_norm weight/bias for width {}", x.cols)));
        }
        let mut out = CpuTensor::zeros(x.rows, x.cols);
        out.data.par_chunks_mut(x.cols).zip(x.data.par_chunks(x.cols)).for_each(|(o, r)| {
            let n = x.cols as f32;
            let mean = r.iter().sum::<f32>() / n;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + eps).sqrt();
            for (((o, v), w), b) in o.iter_mut().zip(r).zip(&weight.data).zip(&bias.data) {
                *o = (v - mean) * inv * w + b;
            }
        });
        Ok(out)
    }

    fn gelu(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let _t = profile::span("gelu");
        let mut out = x.clone();
        out.data.par_chunks_mut(4096).for_each(|c| {
            for v in c {
                *v = 0.5 * *v * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
            }
        });
        Ok(out)
    }

    fn silu_mul(&self, gate_up: &CpuTensor) -> Result<CpuTensor> {
        let _t = profile::span("silu_mul");
        if !gate_up.cols.is_multiple_of(2) {
            return Err(shape_err(format!("silu_mul of an odd width {}", gate_up.cols)));
        }
        let half = gate_up.cols / 2;
        let mut out = CpuTensor::zeros(gate_up.rows, half);
        let rows_per_task = (4096 / half.max(1)).max(1);
        out.data
            .par_chunks_mut(half * rows_per_task)
            .zip(gate_up.data.par_chunks(gate_up.cols * rows_per_task))
            .for_each(|(o, x)| {
                for (o, x) in o.chunks_exact_mut(half).zip(x.chunks_exact(gate_up.cols)) {
                    let (g, u) = x.split_at(half);
                    vmath::silu_mul(o, g, u);
                }
            });
        Ok(out)
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        let _t = profile::span("split_cols");
        if widths.iter().sum::<usize>() != x.cols {
            return Err(shape_err(format!("split_cols {widths:?} of width {}", x.cols)));
        }
        let mut parts: Vec<CpuTensor> = widths.iter().map(|&w| CpuTensor::zeros(x.rows, w)).collect();
        for (r, row) in x.data.chunks_exact(x.cols).enumerate() {
            let mut at = 0;
            for p in parts.iter_mut() {
                p.data[r * p.cols..(r + 1) * p.cols].copy_from_slice(&row[at..at + p.cols]);
                at += p.cols;
            }
        }
        Ok(parts)
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        let _t = profile::span("add_assign");
        if x.data.len() != y.data.len() {
            return Err(shape_err("add_assign shapes differ".into()));
        }
        x.data.par_chunks_mut(4096).zip(y.data.par_chunks(4096)).for_each(|(a, b)| {
            for (a, b) in a.iter_mut().zip(b) {
                *a += b;
            }
        });
        Ok(())
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let _t = profile::span("select_rows");
        let mut out = CpuTensor::zeros(rows.len(), x.cols);
        for (o, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            if r >= x.rows {
                return Err(shape_err(format!("row {r} of {}", x.rows)));
            }
            o.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&CpuTensor]) -> Result<CpuTensor> {
        let _t = profile::span("concat_rows");
        let cols = parts.first().map_or(0, |t| t.cols);
        if parts.iter().any(|t| t.cols != cols) {
            return Err(shape_err("concat_rows of different widths".into()));
        }
        let mut data = Vec::with_capacity(parts.iter().map(|t| t.data.len()).sum());
        for t in parts {
            data.extend_from_slice(&t.data);
        }
        Ok(CpuTensor { rows: parts.iter().map(|t| t.rows).sum(), cols, data, packed: None })
    }

    fn attention_bidirectional(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        shape: AttentionShape,
        spans: &[(usize, usize)],
    ) -> Result<CpuTensor> {
        let _t = profile::span("attention_bidirectional");
        attention::bidirectional(q, k, v, shape, spans)
    }
}

impl PagedKv for CpuBackend {
    type KvStore = CpuKvStore;

    fn kv_bytes_per_value(&self) -> usize {
        4
    }

    fn new_kv_store(&self, spec: KvSpec) -> Result<CpuKvStore> {
        Ok(CpuKvStore::new(spec))
    }

    fn calibrate_kv(&self, store: &mut CpuKvStore, offsets: &[Vec<f32>], rope: &Rope) -> Result<()> {
        let spec = store.spec;
        match &mut store.fp8 {
            Some(f) => f.calibrate(spec, offsets, rope),
            None => Ok(()),
        }
    }

    fn write_kv(
        &self,
        store: &mut CpuKvStore,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        rows: NewRows<'_>,
        rope: &Rope,
    ) -> Result<()> {
        let _t = profile::span("write_kv");
        let s = store.spec;
        let width = s.kv_dim();
        let slots = rows.slots;
        s.check(layer, slots)?;
        let n = slots.len();
        if k.cols != width || v.cols != width || k.rows != n || v.rows != n || rows.positions.len() != n {
            return Err(shape_err(format!(
                "write_kv: k [{}, {}], v [{}, {}], {n} slots, {} positions, layer {layer}",
                k.rows,
                k.cols,
                v.rows,
                v.cols,
                rows.positions.len()
            )));
        }
        if let Some(f) = &mut store.fp8 {
            f.write(s, layer, &k.data, &v.data, slots, rows.positions, rope);
            return Ok(());
        }
        for (i, &slot) in slots.iter().enumerate() {
            let slot = slot as usize;
            for h in 0..s.num_kv_heads {
                let dst = store.offset(slot, h);
                let src = i * width + h * s.head_dim;
                store.k[layer][dst..dst + s.head_dim].copy_from_slice(&k.data[src..src + s.head_dim]);
                store.v[layer][dst..dst + s.head_dim].copy_from_slice(&v.data[src..src + s.head_dim]);
            }
        }
        Ok(())
    }

    fn inject_kv(&self, store: &mut CpuKvStore, chunks: &[InjectChunk<'_, CpuTensor>], rope: &Rope) -> Result<()> {
        let _t = profile::span("inject_kv");
        let s = store.spec;
        let width = s.kv_dim();
        for (ci, c) in chunks.iter().enumerate() {
            s.check_slots(c.slots)?;
            let n = c.positions.len();
            let bad = c.k.len() != s.num_layers
                || c.v.len() != s.num_layers
                || c.slots.len() != n
                || c.k.iter().chain(c.v).any(|t| t.rows != n || t.cols != width);
            if bad {
                return Err(shape_err(format!(
                    "inject_kv chunk {ci}: {} K / {} V layers for {} layers, {n} positions, {} slots, width {width}",
                    c.k.len(),
                    c.v.len(),
                    s.num_layers,
                    c.slots.len()
                )));
            }
        }
        // cos/sin once per token, shared by every layer.
        let tables: Vec<(Vec<f32>, Vec<f32>)> = chunks
            .iter()
            .map(|c| {
                let (mut cos, mut sin) = (Vec::new(), Vec::new());
                for &p in c.positions {
                    rope.cos_sin(p, &mut cos, &mut sin);
                }
                (cos, sin)
            })
            .collect();
        let layer_chunks = |layer: usize| -> Vec<LayerChunk<'_>> {
            chunks
                .iter()
                .zip(&tables)
                .map(|(c, (cos, sin))| LayerChunk {
                    k: &c.k[layer].data,
                    v: &c.v[layer].data,
                    slots: c.slots,
                    cos,
                    sin,
                })
                .collect()
        };
        if let Some(f) = &mut store.fp8 {
            for c in chunks {
                f.set_positions(c.slots, c.positions);
            }
            f.inject(s, (0..s.num_layers).map(layer_chunks).collect(), rope);
            return Ok(());
        }
        store.k.par_iter_mut().zip(store.v.par_iter_mut()).enumerate().for_each(|(layer, (kl, vl))| {
            kv_store::inject_layer(s, kl, vl, &layer_chunks(layer), rope);
        });
        Ok(())
    }

    fn gather_kv(&self, store: &CpuKvStore, layer: usize, slots: &[u32]) -> Result<(CpuTensor, CpuTensor)> {
        let _t = profile::span("gather_kv");
        let s = store.spec;
        let width = s.kv_dim();
        s.check(layer, slots)?;
        let mut k = CpuTensor::zeros(slots.len(), width);
        let mut v = CpuTensor::zeros(slots.len(), width);
        if let Some(f) = &store.fp8 {
            f.gather(s, layer, slots, &mut k.data, &mut v.data);
            return Ok((k, v));
        }
        for (i, &slot) in slots.iter().enumerate() {
            for h in 0..s.num_kv_heads {
                let src = store.offset(slot as usize, h);
                let dst = i * width + h * s.head_dim;
                k.data[dst..dst + s.head_dim].copy_from_slice(&store.k[layer][src..src + s.head_dim]);
                v.data[dst..dst + s.head_dim].copy_from_slice(&store.v[layer][src..src + s.head_dim]);
            }
        }
        Ok((k, v))
    }

    fn copy_blocks(&self, store: &mut CpuKvStore, pairs: &[(u32, u32)]) -> Result<()> {
        let _t = profile::span("copy_blocks");
        let s = store.spec;
        let block = s.block_size * s.head_dim;
        if let Some(p) = pairs.iter().find(|(a, b)| *a as usize >= s.num_blocks || *b as usize >= s.num_blocks) {
            return Err(shape_err(format!("copy_blocks {p:?} beyond {} blocks", s.num_blocks)));
        }
        if let Some(f) = &mut store.fp8 {
            f.copy_blocks(s, pairs);
            return Ok(());
        }
        for buf in store.k.iter_mut().chain(store.v.iter_mut()) {
            for h in 0..s.num_kv_heads {
                for &(src, dst) in pairs {
                    let src = (h * s.num_blocks + src as usize) * block;
                    let dst = (h * s.num_blocks + dst as usize) * block;
                    buf.copy_within(src..src + block, dst);
                }
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuTensor,
        store: &CpuKvStore,
        layer: usize,
        shape: AttentionShape,
        spans: &[SeqSpan<'_>],
    ) -> Result<CpuTensor> {
        let _t = profile::span("attention");
        attention::paged_attention(q, store, layer, shape, spans)
    }
}

impl KvTiers for CpuBackend {
    fn host_tier_upload(&self) -> Option<crate::backend::KvUpload<CpuTensor>> {
        Some(std::sync::Arc::new(|ts: &[&HostTensor]| ts.iter().map(|t| CpuBackend.upload_rows(t)).collect()))
    }

    /// The CPU computes in f32: fp8 records are dequantized as they are
    /// placed, on the reader's thread (the same values as decoding them).
    fn host_tier_upload_fp8(&self) -> Option<crate::backend::KvUploadFp8<CpuTensor>> {
        Some(std::sync::Arc::new(|kv: &crate::fp8::Fp8Kv<'_>| {
            kv.decode()?.iter().map(|t| CpuBackend.upload_rows(t)).collect()
        }))
    }
}

impl Retrieval for CpuBackend {
    type Embeddings = HostEmbeddings;

    fn upload_embeddings(&self, rows: &[f32], dim: usize) -> Result<HostEmbeddings> {
        HostEmbeddings::new(rows.to_vec(), dim)
    }

    fn top_k(&self, e: &HostEmbeddings, query: &[f32], k: usize) -> Result<Vec<u32>> {
        let _t = profile::span("top_k");
        top_k_host(e, query, k)
    }
}
