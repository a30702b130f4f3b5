//! KV injection into the paged cache, from device memory or from the host
//! tier.
//!
//! A shard whose facts' KV does not fit beside the model keeps it in pinned
//! host memory (the host tier). Under unified addressing that memory has
//! the same address on the device, so the injection kernel reads it over
//! the bus directly — no staging buffer.
//!
//! Injection of stored KV overlaps the question's prefill after it: the
//! kernel runs on a second stream in groups of layers, each group recording
//! its layers' `ready` events, and the main stream waits for layer l only
//! when the prefill first touches layer l. From the host tier the bus
//! transfer (≈ 5 MB per layer at k = 50 on an 8B model) thus hides behind
//! the question's GEMMs (≈ 0.2 ms per layer) except for the first group;
//! from device memory the injection runs beside the first layers' GEMMs
//! instead of before them (sharing HBM bandwidth with them).
//!
//! The side stream reads the stored tensors out of the main stream's order,
//! while their memory is freed in it. So stored KV is *kept*
//! ([`KeptRows`], [`PinnedBuf`]): its release first waits for the event
//! recorded after the last side-stream injection. Tensors that were not
//! kept (an op's output handed straight to `inject_kv`) are injected with
//! one launch on the main stream.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PinnedHostSlice};
use half::bf16;
use inferscale_engine::Result;
use inferscale_engine::backend::{Fp8Kv, InjectChunk, KvTiers, matrix_dims};
use inferscale_engine::fp8::Fp8Tensor;
use inferscale_engine::rope::{Rope, TABLE_POSITIONS};
use inferscale_model::HostTensor;
use rayon::prelude::*;

use crate::backend::{Cu, CudaBackend, CudaKvStore, CudaTensor, KvBuffers, Storage, shape_err};
use crate::error::CudaError;

/// Tokens per block of `inject_kv` (`INJECT_TOKENS` in kernels/kv.cu).
pub(crate) const INJECT_TOKENS: usize = 4;

/// Most layers one side-stream launch covers: a group's layers are ready
/// only when the whole group is, so groups stay short.
const MAX_GROUP_LAYERS: usize = 4;

/// Blocks per layer of a host-tier launch. Its loads wait on the bus for
/// microseconds; a block per token group would fill every multiprocessor
/// with waiting warps and starve the prefill it is meant to overlap. Sixteen
/// blocks keep ≈ 300 KB of loads in flight, several times what the bus's
/// bandwidth-latency product asks.
const HOST_TIER_BLOCKS: usize = 16;

/// One pinned host allocation holding several tensors (a fact's K and V of
/// every layer). Dropped, it goes back to its [`PinnedPool`]; the pool
/// waits for the backend's injection fence before the buffer is written
/// or freed again (host memory is not freed in stream order), so it is
/// never reused under a kernel still reading it.
pub(crate) struct PinnedBuf {
    slice: Option<PinnedHostSlice<bf16>>,
    base: u64,
    pool: Arc<PinnedPool>,
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.take() {
            self.pool.put(slice);
        }
    }
}

/// Host-tier allocations kept for reuse. Allocating pinned memory pins
/// every page and freeing it unpins them and waits for the device:
/// milliseconds for a fact of an 8B model (16 MB), paid on every eviction
/// and every read when a busy host tier turns over. Buffers come in size
/// classes of [`POOL_GRANULE`] values, so that a fact of 120 tokens can
/// take the buffer of one of 117; the pool keeps at most
/// [`POOL_MAX_BYTES`] of free buffers (past it, a dropped buffer is freed).
pub(crate) struct PinnedPool {
    ctx: Arc<CudaContext>,
    /// The event recorded after each injection (`CudaBackend::inject_fence`).
    fence: Arc<CudaEvent>,
    free: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    by_class: std::collections::HashMap<usize, Vec<PinnedHostSlice<bf16>>>,
    bytes: usize,
}

/// Size classes of host-tier buffers, in bf16 values (1 MiB).
const POOL_GRANULE: usize = 1 << 19;
/// Free buffers the pool keeps, at most.
const POOL_MAX_BYTES: usize = 2 << 30;

impl PinnedPool {
    pub(crate) fn new(ctx: Arc<CudaContext>, fence: Arc<CudaEvent>) -> Self {
        PinnedPool { ctx, fence, free: Mutex::new(PoolState::default()) }
    }

    /// A buffer of at least `len` values: a free one of its class once no
    /// injection can still read it, else a new allocation.
    fn take(&self, len: usize) -> Result<PinnedHostSlice<bf16>> {
        let class = len.max(1).div_ceil(POOL_GRANULE) * POOL_GRANULE;
        let reused = {
            let mut st = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let got = st.by_class.get_mut(&class).and_then(Vec::pop);
            if got.is_some() {
                st.bytes -= class * 2;
            }
            got
        };
        if let Some(slice) = reused {
            // The buffer was dropped after the injections that read it were
            // queued; the fence's latest record follows them on the side stream.
            self.fence.synchronize().cu()?;
            return Ok(slice);
        }
        // PORTABLE | DEVICEMAP: readable by kernels of any context; not
        // write-combined, since exporting a shard reads it back on the CPU.
        // SAFETY: every element is written by `to_host_tier` before anything reads it.
        unsafe { self.ctx.alloc_pinned_with_flags::<bf16>(class, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) }
            .cu()
    }

    /// Keeps `slice` for reuse, or frees it past the pool's bound.
    fn put(&self, slice: PinnedHostSlice<bf16>) {
        let class = slice.len();
        let mut st = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if st.bytes + class * 2 <= POOL_MAX_BYTES {
            st.bytes += class * 2;
            st.by_class.entry(class).or_default().push(slice);
            return;
        }
        drop(st);
        // Freed now: first let every injection that may read it finish. A
        // destructor has no one to report to; a failed wait leaves the
        // context in an error state that the next call reports.
        let _ = self.fence.synchronize();
        drop(slice);
    }
}

/// Stored KV in device memory ([`inferscale_engine::backend::Backend::keep_kv`]).
/// Its memory is freed on the main stream (stream-ordered), after that
/// stream has been made to wait for the injection fence: no side-stream
/// injection still reading it can see it reused. The wait is queued, not
/// taken on the host.
pub(crate) struct KeptRows<T: DeviceRepr = bf16> {
    pub(crate) slice: CudaSlice<T>,
    fence: Arc<CudaEvent>,
}

impl<T: DeviceRepr> Drop for KeptRows<T> {
    fn drop(&mut self) {
        // Runs before `slice` is dropped (and so freed on its stream). As
        // above, a failed wait surfaces at the next call.
        let _ = self.slice.stream().wait(&self.fence);
    }
}

/// A tensor's rows inside a [`PinnedBuf`].
pub(crate) struct HostRows {
    buf: Arc<PinnedBuf>,
    offset: usize,
    len: usize,
}

impl HostRows {
    /// The address kernels read (same on host and device under unified addressing).
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.base + (self.offset * 2) as u64
    }

    /// The values as f32. Kernels only ever read host-tier memory, so no
    /// device work has to finish first.
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        // SAFETY: `offset..offset + len` lies in the allocation, which lives
        // as long as `self.buf`, and nothing writes it after `to_host_tier`.
        let s = unsafe { std::slice::from_raw_parts((self.buf.base as *const bf16).add(self.offset), self.len) };
        s.par_iter().with_min_len(1 << 14).map(|x| x.to_f32()).collect()
    }
}

/// A chunk as a launch table lists it: its first row to write, K and V per
/// layer, positions, slots.
pub(crate) type TableChunk<'a> = (usize, &'a [CudaTensor], &'a [CudaTensor], &'a [u32], &'a [u32]);

/// Where one fp8 tensor's parts lie in its record's allocation, in bytes
/// ([`Fp8Layout`]): its codes (`[rows, cols]`), its KV heads' scales (f32)
/// and, for a key, its channels' offsets (bf16).
#[derive(Clone, Copy)]
pub(crate) struct Fp8Parts {
    pub(crate) codes: usize,
    pub(crate) scales: usize,
    pub(crate) offsets: Option<usize>,
    len: usize,
    heads: usize,
}

impl Fp8Parts {
    /// Bytes of the tensor's scales and offsets (`cols` wide).
    pub(crate) fn param_bytes(&self, cols: usize) -> usize {
        4 * self.heads + self.offsets.map_or(0, |_| 2 * cols)
    }
}

/// A tensor's fp8 parts inside a [`PinnedBuf`] of the host tier.
pub(crate) struct HostFp8Rows {
    buf: Arc<PinnedBuf>,
    pub(crate) parts: Fp8Parts,
}

impl HostFp8Rows {
    /// The codes' address (same on host and device).
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.base + self.parts.codes as u64
    }

    /// The scales' address.
    pub(crate) fn scales_ptr(&self) -> u64 {
        self.buf.base + self.parts.scales as u64
    }

    /// The offsets' address (keys only).
    pub(crate) fn offsets_ptr(&self) -> Option<u64> {
        self.parts.offsets.map(|o| self.buf.base + o as u64)
    }

    /// The values as f32, `cols` to a row.
    pub(crate) fn to_host(&self, cols: usize) -> Result<HostTensor> {
        let (base, p) = (self.buf.base as *const u8, &self.parts);
        // SAFETY: every part lies in the allocation, which lives as long as
        // `self.buf`, and nothing writes it after `to_host_tier_fp8`.
        let at = |at: usize, len: usize| unsafe { std::slice::from_raw_parts(base.add(at), len) };
        let offsets = p.offsets.map(|o| at(o, 2 * cols));
        Ok(Fp8Tensor { codes: at(p.codes, p.len), scales: at(p.scales, 4 * p.heads), offsets }.decode(cols, p.heads))
    }
}

/// A tensor's fp8 parts inside one device allocation of the device tier,
/// laid out as in the host tier ([`to_device_tier_fp8`]); freed as kept
/// device memory is.
pub(crate) struct DeviceFp8Rows {
    buf: Arc<KeptRows<u8>>,
    pub(crate) parts: Fp8Parts,
}

impl DeviceFp8Rows {
    /// The allocation, and the tensor's parts in it.
    pub(crate) fn parts(&self) -> (&CudaSlice<u8>, Fp8Parts) {
        (&self.buf.slice, self.parts)
    }

    /// The values as f32, `cols` to a row, its parts copied back on `stream`.
    pub(crate) fn to_host(&self, stream: &Arc<CudaStream>, cols: usize) -> Result<HostTensor> {
        let p = &self.parts;
        let copy = |at: usize, len: usize| stream.clone_dtoh(&self.buf.slice.slice(at..at + len)).cu();
        let (codes, scales) = (copy(p.codes, p.len)?, copy(p.scales, 4 * p.heads)?);
        let offsets = p.offsets.map(|o| copy(o, 2 * cols)).transpose()?;
        Ok(Fp8Tensor { codes: &codes, scales: &scales, offsets: offsets.as_deref() }.decode(cols, p.heads))
    }
}

/// Layer ranges of the side-stream launches: one layer, one layer, then
/// doubling up to [`MAX_GROUP_LAYERS`] — the first layers are needed first.
pub(crate) fn layer_groups(layers: usize) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let (mut at, mut size) = (0, 1);
    while at < layers {
        let end = (at + size).min(layers);
        groups.push(at..end);
        at = end;
        if groups.len() >= 2 {
            size = (size * 2).min(MAX_GROUP_LAYERS);
        }
    }
    groups
}

impl CudaBackend {
    /// `t` as stored KV: device memory is kept ([`KeptRows`]), host-tier
    /// memory is already fenced.
    pub(crate) fn kept(&self, t: CudaTensor) -> CudaTensor {
        let CudaTensor { data, rows, cols } = t;
        let data = match data {
            Storage::Device(slice) => Storage::Kept(KeptRows { slice, fence: self.inject_fence.clone() }),
            other => other,
        };
        CudaTensor { data, rows, cols }
    }

    /// Copies tensors into one pinned host allocation of the host tier.
    pub(crate) fn to_host_tier(&self, ts: &[&HostTensor]) -> Result<Vec<CudaTensor>> {
        to_host_tier(&self.pinned_pool, ts)
    }

    /// [`CudaBackend::to_host_tier`] for any thread: the context binds
    /// itself to the calling thread for an allocation.
    pub(crate) fn host_tier_uploader(&self) -> inferscale_engine::backend::KvUpload<CudaTensor> {
        let pool = self.pinned_pool.clone();
        Arc::new(move |ts: &[&HostTensor]| to_host_tier(&pool, ts))
    }

    /// The host-tier upload of fp8 records as they are stored, for any thread.
    pub(crate) fn host_tier_uploader_fp8(&self) -> inferscale_engine::backend::KvUploadFp8<CudaTensor> {
        let pool = self.pinned_pool.clone();
        Arc::new(move |kv: &Fp8Kv<'_>| to_host_tier_fp8(&pool, kv))
    }

    /// Device-tier uploads for any thread (a disk reader): bf16 tensors
    /// kept as the device memory of an ingest's encodings is, copied on
    /// the backend's upload stream, which only that copy waits for.
    pub(crate) fn device_tier_uploader(&self) -> inferscale_engine::backend::KvUpload<CudaTensor> {
        let (stream, fence) = (self.upload.clone(), self.inject_fence.clone());
        Arc::new(move |ts: &[&HostTensor]| to_device_tier(&stream, &fence, ts))
    }

    /// The device-tier upload of fp8 records as they are stored.
    pub(crate) fn device_tier_uploader_fp8(&self) -> inferscale_engine::backend::KvUploadFp8<CudaTensor> {
        let (stream, fence) = (self.upload.clone(), self.inject_fence.clone());
        Arc::new(move |kv: &Fp8Kv<'_>| to_device_tier_fp8(&stream, &fence, kv))
    }

    /// The table of one `inject_kv` launch over `chunks` — bf16 tensors
    /// (`fp8` false) or fp8 codes with scales, never both — and its tokens.
    pub(crate) fn kind_table(&self, chunks: &[TableChunk<'_>], fp8: bool) -> (Vec<u32>, usize) {
        let total = chunks.iter().map(|c| c.4.len()).sum();
        let tensors = chunks.iter().flat_map(|c| c.1.iter().zip(c.2));
        let (mut k, mut v, mut ks, mut vs, mut ko) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (kt, vt) in tensors {
            k.push(self.tp(kt));
            v.push(self.tp(vt));
            if let (Some(a), Some(b), Some(o)) = (self.scales_ptr(kt), self.scales_ptr(vt), self.offsets_ptr(kt)) {
                ks.push(a);
                vs.push(b);
                ko.push(o);
            }
        }
        let arrays: Vec<&[u64]> = match fp8 {
            true => vec![&k, &v, &ks, &vs, &ko],
            false => vec![&k, &v],
        };
        let table = table_words(&arrays, chunks.iter().map(|c| (c.0, c.3, c.4)), total);
        (table, total)
    }

    /// [`inferscale_engine::backend::Backend::inject_kv`]: layer groups on
    /// the side stream, overlapping what follows, when every chunk is stored
    /// KV (kept or in the host tier); else one launch on the main stream.
    pub(crate) fn inject(
        &self,
        store: &mut CudaKvStore,
        chunks: &[InjectChunk<'_, CudaTensor>],
        rope: &Rope,
    ) -> Result<()> {
        let spec = store.spec;
        let (layers, kv_dim) = (spec.num_layers, spec.kv_dim());
        let total: usize = chunks.iter().map(|c| c.slots.len()).sum();
        if total == 0 {
            return Ok(());
        }
        check_inject_dims(rope, spec.head_dim)?;
        let (mut hosted, mut stored) = (false, true);
        // bf16 chunks and fp8 chunks: one launch (per layer group) each.
        let mut kinds: [Vec<_>; 2] = [Vec::new(), Vec::new()];
        for (ci, c) in chunks.iter().enumerate() {
            let n = c.slots.len();
            if c.k.len() != layers || c.v.len() != layers || c.positions.len() != n {
                return Err(shape_err(format!("inject_kv: chunk {ci} has {} layers, {n} slots", c.k.len())));
            }
            spec.check_slots(c.slots)?;
            let fp8 = c.k.first().is_some_and(CudaTensor::is_fp8);
            for (l, (k, v)) in c.k.iter().zip(c.v).enumerate() {
                if [k, v].iter().any(|x| x.rows != n || x.cols != kv_dim || x.is_fp8() != fp8) {
                    return Err(shape_err(format!(
                        "inject_kv: chunk {ci} layer {l} is [{}, {}]{}",
                        k.rows,
                        k.cols,
                        if fp8 { ", not all fp8" } else { "" }
                    )));
                }
                hosted |= k.in_host_tier() || v.in_host_tier();
                stored &= k.is_stored() && v.is_stored();
            }
            kinds[usize::from(fp8)].push((0, c.k, c.v, c.positions, c.slots));
        }
        // Into an fp8 cache: its own kernels (they encode what they rotate).
        let dest = match &store.cache {
            KvBuffers::Bf16 { k, v } => InjectDest::Bf16 { k: self.ptr(k), v: self.ptr(v) },
            KvBuffers::Fp8(c) => InjectDest::Fp8 {
                k: self.ptr(&c.k),
                v: self.ptr(&c.v),
                k_scale: self.ptr(&c.k_scale),
                v_scale: self.ptr(&c.v_scale),
                positions: self.ptr(&c.positions),
                offsets: c.offsets_ptr(self),
                layer_scales: spec.capacity() * spec.num_kv_heads,
            },
        };
        Self::mark_written(store);
        let to_fp8 = matches!(dest, InjectDest::Fp8 { .. });
        // (kernel, table, tokens, chunks, fp8) of each kind present.
        let launches: Vec<(&cudarc::driver::CudaFunction, Vec<u32>, usize, u32, bool)> = kinds
            .iter()
            .zip([false, true])
            .filter(|(cs, _)| !cs.is_empty())
            .map(|(cs, fp8)| {
                let (table, n) = self.kind_table(cs, fp8);
                let kernel = match (fp8, to_fp8) {
                    (false, false) => &self.k.inject_kv,
                    (true, false) => &self.k.inject_kv_fp8,
                    (false, true) => &self.k.inject_kv_to_fp8,
                    (true, true) => &self.k.inject_kv_fp8_to_fp8,
                };
                (kernel, table, n, cs.len() as u32, fp8)
            })
            .collect();
        let r = self.rope_tables(rope)?;
        let nl = layers as u32;
        let (le, d, hd, rot) = (store.layer_elems, kv_dim as i32, spec.head_dim as i32, rope.dim() as i32);
        let (cs, sn, inv, tp) = (self.ptr(&r.cos), self.ptr(&r.sin), self.ptr(&r.inv_freq), TABLE_POSITIONS as u32);
        // The fp8 kernels reduce over a head's lanes: whole warps.
        let threads = if to_fp8 { (kv_dim / 8).div_ceil(32) * 32 } else { kv_dim / 8 };
        let cfg = |blocks: usize, group: usize| LaunchConfig {
            grid_dim: (blocks as u32, group as u32, 1),
            block_dim: (threads.clamp(32, 256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // One launch: the destination's arguments, then the table's and the rotation's.
        let launch = |stream: &CudaStream, kernel, cfg, tb: u64, tt: u32, nc: u32, l0: u32| -> Result<()> {
            match &dest {
                InjectDest::Bf16 { k, v } => self.launch_on(
                    stream,
                    kernel,
                    cfg,
                    &[k, v, &tb, &tt, &nc, &l0, &nl, &le, &d, &hd, &rot, &cs, &sn, &inv, &tp],
                ),
                InjectDest::Fp8 { k, v, k_scale, v_scale, positions, offsets, layer_scales } => self.launch_on(
                    stream,
                    kernel,
                    cfg,
                    &[
                        k,
                        v,
                        k_scale,
                        v_scale,
                        positions,
                        offsets,
                        &tb,
                        &tt,
                        &nc,
                        &l0,
                        &nl,
                        &le,
                        layer_scales,
                        &d,
                        &hd,
                        &rot,
                        &cs,
                        &sn,
                        &inv,
                        &tp,
                    ],
                ),
            }
        };
        if !stored {
            let _span = self.span("inject_kv");
            self.await_all_layers(store)?;
            for (kernel, table, n, nc, _) in &launches {
                let table_dev = self.stream.clone_htod(table).cu()?;
                let (tb, tt) = (self.ptr(&table_dev), *n as u32);
                launch(&self.stream, kernel, cfg(n.div_ceil(INJECT_TOKENS), layers), tb, tt, *nc, 0)?;
            }
            return Ok(());
        }
        // Stored KV. The table goes up first (a copy from pageable memory
        // may wait for its stream's queued work, which the join below would
        // make the main stream's); the kernels start after everything queued
        // so far (the slots may have been read by an earlier step). Over the
        // bus a few blocks per layer saturate the link; from device memory
        // one block per multiprocessor and layer moves a layer in
        // microseconds without crowding out the prefill's GEMMs.
        let tables = launches
            .iter()
            .map(|(_, table, _, _, _)| self.side.clone_htod(table).cu())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.side.join(&self.stream).cu()?;
        for g in layer_groups(layers) {
            let l0 = g.start as u32;
            for ((kernel, _, n, nc, fp8), table_dev) in launches.iter().zip(&tables) {
                let (tb, tt) = (self.ptr(table_dev), *n as u32);
                // fp8 loads are half as wide: twice the blocks keep as many
                // bytes in flight on the bus.
                let host_blocks = if *fp8 { 2 * HOST_TIER_BLOCKS } else { HOST_TIER_BLOCKS };
                let blocks = n.div_ceil(INJECT_TOKENS).min(if hosted { host_blocks } else { self.sm_count });
                launch(&self.side, kernel, cfg(blocks, g.len()), tb, tt, *nc, l0)?;
            }
            for l in g {
                store.ready[l].record(&self.side).cu()?;
                store.pending[l].store(true, Ordering::Release);
            }
        }
        self.inject_fence.record(&self.side).cu()
    }
}

/// The cache an injection writes: bf16 values, or fp8 codes with their
/// scales, the slots' positions and the key offsets (0: none; all layers').
enum InjectDest {
    Bf16 { k: u64, v: u64 },
    Fp8 { k: u64, v: u64, k_scale: u64, v_scale: u64, positions: u64, offsets: u64, layer_scales: usize },
}

/// How a tier keeps an fp8 record in one allocation: its scales, then its
/// key offsets, each padded to 16 bytes, then each tensor's codes (no
/// decoding: half the bytes of bf16).
struct Fp8Layout {
    offsets_at: usize,
    codes_at: usize,
    /// Bytes of the allocation.
    total: usize,
}

impl Fp8Layout {
    fn of(kv: &Fp8Kv<'_>) -> Result<Self> {
        kv.check()?;
        let offsets_at = kv.scales.len().next_multiple_of(16);
        let codes_at = offsets_at + kv.offsets.len().next_multiple_of(16);
        Ok(Fp8Layout { offsets_at, codes_at, total: codes_at + kv.codes.len() })
    }

    /// Writes the record's parts at their places in `out` (`total` bytes).
    fn fill(&self, kv: &Fp8Kv<'_>, out: &mut [u8]) {
        out[..kv.scales.len()].copy_from_slice(kv.scales);
        out[self.offsets_at..self.offsets_at + kv.offsets.len()].copy_from_slice(kv.offsets);
        let codes = &mut out[self.codes_at..self.total];
        codes.par_chunks_mut(1 << 16).zip(kv.codes.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
    }

    /// The record's tensors, each made by `rows` from its parts.
    fn tensors(&self, kv: &Fp8Kv<'_>, rows: impl Fn(Fp8Parts) -> Storage) -> Vec<CudaTensor> {
        let per = kv.rows * kv.cols;
        (0..kv.tensors())
            .map(|i| CudaTensor {
                data: rows(Fp8Parts {
                    codes: self.codes_at + i * per,
                    scales: 4 * i * kv.heads,
                    offsets: (i < kv.layers).then(|| self.offsets_at + 2 * i * kv.cols),
                    len: per,
                    heads: kv.heads,
                }),
                rows: kv.rows,
                cols: kv.cols,
            })
            .collect()
    }
}

/// Copies an fp8 record's parts, as stored, into one pinned host
/// allocation of the host tier ([`Fp8Layout`]).
fn to_host_tier_fp8(pool: &Arc<PinnedPool>, kv: &Fp8Kv<'_>) -> Result<Vec<CudaTensor>> {
    let layout = Fp8Layout::of(kv)?;
    let total = layout.total;
    let mut slice = pool.take(total.div_ceil(2))?;
    let host = slice.as_mut_slice().cu()?;
    // SAFETY: `host` is `total.div_ceil(2)` bf16 values, at least `total` bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr() as *mut u8, total) };
    layout.fill(kv, bytes);
    let base = slice.as_mut_ptr().cu()? as u64;
    let buf = Arc::new(PinnedBuf { slice: Some(slice), base, pool: pool.clone() });
    Ok(layout.tensors(kv, |parts| Storage::HostFp8(HostFp8Rows { buf: buf.clone(), parts })))
}

/// Copies an fp8 record's parts, as stored, into one device allocation of
/// the device tier, laid out as in the host tier ([`Fp8Layout`]). The copy
/// runs on `stream`, which is synchronised before the tensors are returned;
/// the allocation is freed on it after the injection fence.
fn to_device_tier_fp8(stream: &Arc<CudaStream>, fence: &Arc<CudaEvent>, kv: &Fp8Kv<'_>) -> Result<Vec<CudaTensor>> {
    let layout = Fp8Layout::of(kv)?;
    let mut host = vec![0u8; layout.total];
    layout.fill(kv, &mut host);
    // SAFETY: the copy below writes every byte.
    let mut slice = unsafe { stream.alloc::<u8>(layout.total.max(1)) }.cu()?;
    stream.memcpy_htod(&host, &mut slice.slice_mut(..layout.total)).cu()?;
    stream.synchronize().cu()?;
    let buf = Arc::new(KeptRows { slice, fence: fence.clone() });
    Ok(layout.tensors(kv, |parts| Storage::DeviceFp8(DeviceFp8Rows { buf: buf.clone(), parts })))
}

/// Copies tensors into device memory of the device tier as bf16, each kept
/// ([`KeptRows`]), on `stream` (synchronised before they are returned).
fn to_device_tier(stream: &Arc<CudaStream>, fence: &Arc<CudaEvent>, ts: &[&HostTensor]) -> Result<Vec<CudaTensor>> {
    let mut out = Vec::with_capacity(ts.len());
    for t in ts {
        let (rows, cols) = matrix_dims(t)?;
        let host: Vec<bf16> = t.data.par_iter().with_min_len(1 << 14).map(|&x| bf16::from_f32(x)).collect();
        let slice = stream.clone_htod(if host.is_empty() { &[bf16::ZERO][..] } else { &host }).cu()?;
        out.push((slice, rows, cols));
    }
    stream.synchronize().cu()?;
    Ok(out
        .into_iter()
        .map(|(slice, rows, cols)| CudaTensor {
            data: Storage::Kept(KeptRows { slice, fence: fence.clone() }),
            rows,
            cols,
        })
        .collect())
}

/// Copies tensors into one pinned host allocation of the host tier, taken
/// from `pool` (see [`PinnedBuf`]).
fn to_host_tier(pool: &Arc<PinnedPool>, ts: &[&HostTensor]) -> Result<Vec<CudaTensor>> {
    let dims = ts.iter().map(|t| matrix_dims(t)).collect::<Result<Vec<_>>>()?;
    let total: usize = dims.iter().map(|(r, c)| r * c).sum();
    let mut slice = pool.take(total)?;
    let host = slice.as_mut_slice().cu()?;
    let mut at = 0;
    for t in ts {
        host[at..at + t.data.len()]
            .par_iter_mut()
            .zip(&t.data)
            .with_min_len(1 << 14)
            .for_each(|(d, &x)| *d = bf16::from_f32(x));
        at += t.data.len();
    }
    let base = slice.as_mut_ptr().cu()? as u64;
    let buf = Arc::new(PinnedBuf { slice: Some(slice), base, pool: pool.clone() });
    let mut offset = 0;
    let mut out = Vec::with_capacity(ts.len());
    for (rows, cols) in dims {
        let len = rows * cols;
        out.push(CudaTensor { data: Storage::Host(HostRows { buf: buf.clone(), offset, len }), rows, cols });
        offset += len;
    }
    Ok(out)
}

/// What the injection kernels' 16-byte accesses and pairwise rotation need.
pub(crate) fn check_inject_dims(rope: &Rope, head_dim: usize) -> Result<()> {
    if !(rope.dim() / 2).is_multiple_of(8) || !head_dim.is_multiple_of(8) {
        return Err(CudaError::Unsupported(format!(
            "inject_kv: rotated dims {} / head_dim {head_dim} must be multiples of 16 / 8",
            rope.dim()
        ))
        .into());
    }
    Ok(())
}

/// The `table` argument of `inject_kv` (kernels/kv.cu), as u32 words for
/// one upload: each of `arrays` in turn — every (chunk, layer)'s K pointer,
/// then every V pointer, and for fp8 every K scale pointer, every V scale
/// pointer and every K offset pointer (64-bit, low word first; `[c·layers + l]` is chunk c,
/// layer l) — then four arrays of `total` entries: chunk index, row within
/// the chunk, position, slot. `chunks` yields each chunk's first row to
/// write (0 for all of it), and the positions and slots of the rows from
/// there.
pub(crate) fn table_words<'a>(
    arrays: &[&[u64]],
    chunks: impl Iterator<Item = (usize, &'a [u32], &'a [u32])>,
    total: usize,
) -> Vec<u32> {
    let pointers: usize = arrays.iter().map(|a| a.len()).sum();
    let mut table = vec![0u32; 2 * pointers + 4 * total];
    let (words, meta) = table.split_at_mut(2 * pointers);
    for (i, p) in arrays.iter().flat_map(|a| a.iter()).enumerate() {
        words[2 * i..2 * i + 2].copy_from_slice(&[*p as u32, (p >> 32) as u32]);
    }
    let mut t = 0;
    for (ci, (first, positions, slots)) in chunks.enumerate() {
        for (row, (&p, &s)) in positions.iter().zip(slots).enumerate() {
            meta[t] = ci as u32;
            meta[total + t] = (first + row) as u32;
            meta[2 * total + t] = p;
            meta[3 * total + t] = s;
            t += 1;
        }
    }
    table
}

impl KvTiers for CudaBackend {
    fn upload_rows_host_tier(&self, ts: &[&HostTensor]) -> Result<Vec<CudaTensor>> {
        self.to_host_tier(ts)
    }

    fn keep_kv(&self, t: CudaTensor) -> Result<CudaTensor> {
        Ok(self.kept(t))
    }

    fn has_host_tier(&self) -> bool {
        true
    }

    fn host_tier_upload(&self) -> Option<inferscale_engine::backend::KvUpload<CudaTensor>> {
        Some(self.host_tier_uploader())
    }

    fn host_tier_upload_fp8(&self) -> Option<inferscale_engine::backend::KvUploadFp8<CudaTensor>> {
        Some(self.host_tier_uploader_fp8())
    }

    fn device_tier_upload(&self) -> Option<inferscale_engine::backend::KvUpload<CudaTensor>> {
        Some(self.device_tier_uploader())
    }

    fn device_tier_upload_fp8(&self) -> Option<inferscale_engine::backend::KvUploadFp8<CudaTensor>> {
        Some(self.device_tier_uploader_fp8())
    }

    fn stored_bytes(&self, t: &CudaTensor) -> usize {
        match &t.data {
            Storage::HostFp8(h) => t.len() + h.parts.param_bytes(t.cols),
            Storage::DeviceFp8(d) => t.len() + d.parts.param_bytes(t.cols),
            _ => t.len() * 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inject_table_matches_the_kernels_layout() {
        let (k, v) = ([0x1_0000_0010, 0x3_0000_0030, 5, 7], [0x2_0000_0020, 0x4_0000_0040, 6, 8]);
        let (p0, s0, p1, s1) = ([10, 11], [100, 101], [20], [200]);
        let chunks = || [(0, &p0[..], &s0[..]), (0, &p1[..], &s1[..])].into_iter();
        let t = table_words(&[&k, &v], chunks(), 3);
        let word = |i: usize| t[2 * i] as u64 | (t[2 * i + 1] as u64) << 32;
        // The kernel reads 64-bit K pointers at [c·L + l], V pointers after them.
        assert_eq!((0..4).map(word).collect::<Vec<_>>(), [0x1_0000_0010, 0x3_0000_0030, 5, 7]);
        assert_eq!((4..8).map(word).collect::<Vec<_>>(), [0x2_0000_0020, 0x4_0000_0040, 6, 8]);
        // Then chunk, row, position and slot of each of the 3 tokens.
        assert_eq!(&t[16..], &[0, 0, 1, 0, 1, 0, 10, 11, 20, 100, 101, 200]);
        // fp8: the K and V scale pointers follow V's, then the same tokens.
        let (ks, vs) = ([9, 10, 11, 12], [13, 14, 15, 16]);
        let t8 = table_words(&[&k, &v, &ks, &vs], chunks(), 3);
        assert_eq!(&t8[..16], &t[..16], "K and V pointers first, as for bf16");
        let word8 = |i: usize| t8[2 * i] as u64 | (t8[2 * i + 1] as u64) << 32;
        assert_eq!((8..16).map(word8).collect::<Vec<_>>(), [9, 10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(&t8[32..], &[0, 0, 1, 0, 1, 0, 10, 11, 20, 100, 101, 200]);
    }

    #[test]
    fn layer_groups_cover_every_layer_once_small_ones_first() {
        assert_eq!(layer_groups(1), vec![Range { start: 0, end: 1 }]);
        assert_eq!(layer_groups(3), [0..1, 1..2, 2..3]);
        assert_eq!(layer_groups(7), [0..1, 1..2, 2..4, 4..7]);
        for layers in 1..100 {
            let g = layer_groups(layers);
            assert_eq!(g.first().map(|r| r.start), Some(0));
            assert!(g.windows(2).all(|w| w[0].end == w[1].start), "{g:?}");
            assert_eq!(g.last().map(|r| r.end), Some(layers));
            assert!(g.iter().all(|r| !r.is_empty() && r.len() <= MAX_GROUP_LAYERS));
        }
        // 1, 1, 2, 4, then six groups of 4.
        assert_eq!(layer_groups(32).len(), 4 + 6);
    }
}
