//! [`CudaBackend`]: the engine's backend trait on one CUDA device.
//!
//! Activations and weights are bf16 with f32 accumulation (cuBLAS GEMMs with
//! `CUBLAS_COMPUTE_32F`; our kernels reduce in f32). Everything runs on one
//! stream, so ordering is the stream's and temporaries are freed
//! stream-ordered when dropped. Per-forward metadata (positions, slots,
//! block tables) is uploaded once and reused while it is unchanged, so the
//! 30-odd layers of a forward share one copy.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice};
use half::bf16;
use inferscale_engine::backend::{AttentionShape, KvSpec, Tensors, matrix_dims};
use inferscale_engine::rope::{Rope, TABLE_POSITIONS};
use inferscale_engine::{EngineError, Result};
use inferscale_model::HostTensor;
use rayon::prelude::*;

use crate::error::CudaError;
use crate::gemm::{GemvOut, Kernels as GemmKernels, Operands, Ran, Shape as GemmShape, TUNED_ROWS, Tuner};
use crate::graphs::Capture;
use crate::kernels::Kernels;
use crate::paged_fp8::Fp8Cache;
use crate::profile::{Profiler, Span};
use crate::tier::{DeviceFp8Rows, HostFp8Rows, HostRows, KeptRows, PinnedPool};

/// Converts any CUDA-side error into the engine's.
pub(crate) trait Cu<T> {
    fn cu(self) -> Result<T>;
}

impl<T, E: Into<CudaError>> Cu<T> for std::result::Result<T, E> {
    fn cu(self) -> Result<T> {
        self.map_err(|e| EngineError::from(e.into()))
    }
}

pub(crate) fn shape_err(what: String) -> EngineError {
    EngineError::Shape(what)
}

/// A row-major bf16 matrix on the device, or — for stored KV in the host
/// tier — in pinned host memory that kernels read over the bus (see
/// `tier.rs`). Every op's output lives on the device.
pub struct CudaTensor {
    pub(crate) data: Storage,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

pub(crate) enum Storage {
    Device(CudaSlice<bf16>),
    /// Stored KV in device memory ([`Backend::keep_kv`]).
    Kept(KeptRows),
    Host(HostRows),
    /// Stored KV in the host tier as fp8 codes with per-head scales: only
    /// injection and `to_host` read it.
    HostFp8(HostFp8Rows),
    /// The same in device memory (a read the device tier had room for).
    DeviceFp8(DeviceFp8Rows),
}

impl CudaTensor {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether this tensor lives in the host tier.
    pub fn in_host_tier(&self) -> bool {
        matches!(self.data, Storage::Host(_) | Storage::HostFp8(_))
    }

    /// Whether this tensor holds fp8 codes (with scales) rather than bf16.
    pub fn is_fp8(&self) -> bool {
        matches!(self.data, Storage::HostFp8(_) | Storage::DeviceFp8(_))
    }

    /// Whether this tensor is stored KV whose release waits for side-stream
    /// injections (kept device memory or the host tier).
    pub(crate) fn is_stored(&self) -> bool {
        matches!(self.data, Storage::Kept(_) | Storage::Host(_) | Storage::HostFp8(_) | Storage::DeviceFp8(_))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Paged K and V: one buffer each, `[layers, slots, kv_heads·head_dim]`,
/// bf16 or fp8 codes with their scales (`paged_fp8.rs`).
///
/// Injection from the host tier runs on a second stream, layer by layer, so
/// that the bus transfer overlaps the prefill after it; `ready[l]` marks
/// layer l's part done and `pending[l]` says the main stream has yet to wait
/// for it. Every op that touches a layer of the store waits first.
pub struct CudaKvStore {
    pub(crate) spec: KvSpec,
    pub(crate) cache: KvBuffers,
    /// Elements (bf16 values or fp8 codes) of one layer of K.
    pub(crate) layer_elems: usize,
    pub(crate) ready: Vec<CudaEvent>,
    pub(crate) pending: Vec<AtomicBool>,
    /// The main stream, which frees the buffers.
    pub(crate) stream: Arc<CudaStream>,
}

/// What a [`CudaKvStore`] keeps its K and V in.
pub(crate) enum KvBuffers {
    Bf16 { k: CudaSlice<bf16>, v: CudaSlice<bf16> },
    Fp8(Box<Fp8Cache>),
}

impl Drop for CudaKvStore {
    /// The buffers are freed in the main stream's order: it first waits for
    /// any injection still writing them from the side stream.
    fn drop(&mut self) {
        for (ready, pending) in self.ready.iter().zip(&self.pending) {
            if pending.swap(false, Ordering::AcqRel) {
                // Nothing to report to in a destructor; a failed wait leaves
                // the device in an error state the next call reports.
                let _ = self.stream.wait(ready);
            }
        }
    }
}

impl CudaKvStore {
    pub fn spec(&self) -> KvSpec {
        self.spec
    }
}

/// cuBLAS handle. The handle is bound to our one stream and only used under
/// the mutex, which is all cuBLAS asks of a handle shared between threads.
pub(crate) struct Blas(pub(crate) CudaBlas);
// SAFETY: see above — never used by two threads at once.
unsafe impl Send for Blas {}

/// A model's RoPE tables on the device, keyed by its frequencies.
pub(crate) struct DeviceRope {
    inv_freq_host: Vec<f32>,
    dim: usize,
    pub(crate) cos: CudaSlice<f32>,
    pub(crate) sin: CudaSlice<f32>,
    pub(crate) inv_freq: CudaSlice<f32>,
}

/// Recently uploaded metadata arrays, reused while the host copy is equal.
#[derive(Default)]
struct MetaCache {
    entries: Vec<(Vec<u32>, Arc<CudaSlice<u32>>)>,
}

const META_ENTRIES: usize = 8;

/// The CUDA backend on one device. Clones share the device state (stream,
/// cuBLAS handle, compiled kernels, uploaded tables), so several engines on
/// one GPU compile the kernels once.
#[derive(Clone)]
pub struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    blas: Arc<Mutex<Blas>>,
    pub(crate) k: Arc<Kernels>,
    pub(crate) sm_count: usize,
    device_name: String,
    ropes: Arc<Mutex<Vec<Arc<DeviceRope>>>>,
    meta: Arc<Mutex<MetaCache>>,
    pub(crate) profiler: Option<Arc<Profiler>>,
    /// Set only on the clone a decode graph is captured with (`graphs.rs`):
    /// where that step's metadata lives on the device.
    pub(crate) capture: Option<Arc<Capture>>,
    /// Pinned host memory that `to_host` copies through.
    staging: Arc<Mutex<Option<PinnedHostSlice<bf16>>>>,
    /// Where injections of stored KV run (non-blocking, so it never
    /// serialises with the main stream), and the event recorded after each:
    /// the memory they read (host tier, kept device KV) is freed only once
    /// it has passed.
    pub(crate) side: Arc<CudaStream>,
    pub(crate) inject_fence: Arc<CudaEvent>,
    /// Device-tier uploads from disk readers' threads: their copies wait
    /// for nothing else queued on the device.
    pub(crate) upload: Arc<CudaStream>,
    /// Host-tier buffers for reuse (`tier.rs`).
    pub(crate) pinned_pool: Arc<PinnedPool>,
    /// Per-shape GEMM choices for few rows (`gemm.rs`); `None` without libcublasLt.
    pub(crate) tuner: Option<Arc<Mutex<Tuner>>>,
    /// Whether `launch_pdl` launches early (`launch.rs`).
    pub(crate) pdl: bool,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles the kernels and creates the cuBLAS handle.
    pub fn new(ordinal: usize) -> crate::Result<Self> {
        for (lib, what) in [("cuda", "the NVIDIA driver"), ("nvrtc", "NVRTC"), ("cublas", "cuBLAS")] {
            if !crate::kernels::library_present(lib) {
                return Err(CudaError::Unsupported(format!(
                    "lib{lib}.so ({what}) not found: install it or add its directory to LD_LIBRARY_PATH"
                )));
            }
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream: cudarc's cross-stream event tracking would only add work.
        // SAFETY: nothing here uses a second stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let k = Kernels::load(&ctx)?;
        let pdl = crate::launch::pdl_enabled(ctx.compute_capability()?.0);
        let blas = CudaBlas::new(stream.clone())?;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as usize;
        let device_name = ctx.name()?;
        let profiler = Profiler::from_env(&ctx, &stream);
        let side = ctx.new_stream()?;
        let upload = ctx.new_stream()?;
        let inject_fence = Arc::new(ctx.new_event(None)?);
        let pinned_pool = Arc::new(PinnedPool::new(ctx.clone(), inject_fence.clone()));
        let tuner = if crate::kernels::library_present("cublasLt") {
            Some(Arc::new(Mutex::new(Tuner::new(&stream)?)))
        } else {
            None
        };
        Ok(CudaBackend {
            ctx,
            stream,
            blas: Arc::new(Mutex::new(Blas(blas))),
            k: Arc::new(k),
            sm_count,
            device_name,
            ropes: Arc::new(Mutex::new(Vec::new())),
            meta: Arc::new(Mutex::new(MetaCache::default())),
            profiler,
            capture: None,
            staging: Arc::new(Mutex::new(None)),
            side,
            upload,
            pinned_pool,
            inject_fence,
            tuner,
            pdl,
        })
    }

    /// This backend issuing to `stream` through `blas`, with `capture`'s
    /// metadata and no profiling: what a decode graph is recorded with.
    pub(crate) fn for_capture(&self, stream: Arc<CudaStream>, blas: Arc<Mutex<Blas>>, capture: Capture) -> Self {
        CudaBackend { stream, blas, capture: Some(Arc::new(capture)), profiler: None, ..self.clone() }
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Brackets an op with profiling events when profiling is on.
    pub(crate) fn span(&self, name: &'static str) -> Option<Span<'_>> {
        self.profiler.as_ref().map(|p| p.span(name))
    }

    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// The address kernels read `t` at (host-tier memory is mapped into the
    /// device's address space at the same address).
    pub(crate) fn tp(&self, t: &CudaTensor) -> u64 {
        match &t.data {
            Storage::Device(s) => self.ptr(s),
            Storage::Kept(k) => self.ptr(&k.slice),
            Storage::Host(h) => h.ptr(),
            Storage::HostFp8(h) => h.ptr(),
            Storage::DeviceFp8(d) => {
                let (slice, parts) = d.parts();
                self.ptr(slice) + parts.codes as u64
            }
        }
    }

    /// Where the per-head scales of an fp8 tensor are (`None`: not fp8).
    pub(crate) fn scales_ptr(&self, t: &CudaTensor) -> Option<u64> {
        match &t.data {
            Storage::HostFp8(h) => Some(h.scales_ptr()),
            Storage::DeviceFp8(d) => {
                let (slice, parts) = d.parts();
                Some(self.ptr(slice) + parts.scales as u64)
            }
            _ => None,
        }
    }

    /// Where the channel offsets of an fp8 key tensor are (`None`: not an
    /// fp8 key).
    pub(crate) fn offsets_ptr(&self, t: &CudaTensor) -> Option<u64> {
        match &t.data {
            Storage::HostFp8(h) => h.offsets_ptr(),
            Storage::DeviceFp8(d) => {
                let (slice, parts) = d.parts();
                parts.offsets.map(|o| self.ptr(slice) + o as u64)
            }
            _ => None,
        }
    }

    /// Makes the main stream wait for a side-stream injection into `layer`.
    pub(crate) fn await_layer(&self, store: &CudaKvStore, layer: usize) -> Result<()> {
        match store.pending.get(layer) {
            Some(p) if p.swap(false, Ordering::AcqRel) => self.stream.wait(&store.ready[layer]).cu(),
            _ => Ok(()),
        }
    }

    pub(crate) fn await_all_layers(&self, store: &CudaKvStore) -> Result<()> {
        (0..store.pending.len()).try_for_each(|l| self.await_layer(store, l))
    }

    fn alloc(&self, n: usize) -> Result<CudaSlice<bf16>> {
        // SAFETY: every caller writes all `n` elements before anything reads them.
        unsafe { self.stream.alloc::<bf16>(n.max(1)) }.cu()
    }

    pub(crate) fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor { data: Storage::Device(self.alloc(rows * cols)?), rows, cols })
    }

    /// `data` on the device, reusing a recent upload of equal contents.
    pub(crate) fn meta(&self, data: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        if let Some(c) = &self.capture {
            // A graph replays its copies' sources, so a capture may read
            // only the buffers its step's inputs are copied into.
            return c.input(data).ok_or_else(|| {
                CudaError::Unsupported("a decode graph's forward reads metadata that is not among its inputs".into())
                    .into()
            });
        }
        let mut cache = lock(&self.meta);
        if let Some(i) = cache.entries.iter().position(|(h, _)| h.as_slice() == data) {
            let e = cache.entries.remove(i);
            let dev = e.1.clone();
            cache.entries.push(e);
            return Ok(dev);
        }
        let dev = Arc::new(self.stream.clone_htod(if data.is_empty() { &[0u32][..] } else { data }).cu()?);
        if cache.entries.len() == META_ENTRIES {
            cache.entries.remove(0);
        }
        cache.entries.push((data.to_vec(), dev.clone()));
        Ok(dev)
    }

    pub(crate) fn rope_tables(&self, rope: &Rope) -> Result<Arc<DeviceRope>> {
        let mut ropes = lock(&self.ropes);
        if let Some(r) = ropes.iter().find(|r| r.dim == rope.dim() && r.inv_freq_host == rope.inv_freq()) {
            return Ok(r.clone());
        }
        let (cos, sin) = rope.tables();
        let r = Arc::new(DeviceRope {
            inv_freq_host: rope.inv_freq().to_vec(),
            dim: rope.dim(),
            cos: self.stream.clone_htod(cos).cu()?,
            sin: self.stream.clone_htod(sin).cu()?,
            inv_freq: self.stream.clone_htod(rope.inv_freq()).cu()?,
        });
        ropes.push(r.clone());
        Ok(r)
    }

    fn to_device(&self, t: &HostTensor) -> Result<CudaTensor> {
        let (rows, cols) = matrix_dims(t)?;
        let host: Vec<bf16> = t.data.par_iter().map(|&x| bf16::from_f32(x)).collect();
        let data = self.stream.clone_htod(if host.is_empty() { &[bf16::ZERO][..] } else { &host }).cu()?;
        Ok(CudaTensor { data: Storage::Device(data), rows, cols })
    }

    /// Layer `layer` of a bf16 store's K and V, once any injection into it is done.
    pub(crate) fn layer_ptrs(&self, store: &CudaKvStore, layer: usize) -> Result<(u64, u64)> {
        self.await_layer(store, layer)?;
        let (k, v) = self.kv_ptrs(store)?;
        let off = (layer * store.layer_elems * 2) as u64;
        Ok((k + off, v + off))
    }

    /// Where a bf16 store's K and V begin (the ops that take a bf16 cache
    /// refuse an fp8 one).
    pub(crate) fn kv_ptrs(&self, store: &CudaKvStore) -> Result<(u64, u64)> {
        match &store.cache {
            KvBuffers::Bf16 { k, v } => Ok((self.ptr(k), self.ptr(v))),
            KvBuffers::Fp8(_) => Err(shape_err("a bf16 op on an fp8 KV cache".into())),
        }
    }
}

impl Tensors for CudaBackend {
    type Tensor = CudaTensor;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().cu()?;
        self.side.synchronize().cu()
    }

    fn upload(&self, t: &HostTensor) -> Result<CudaTensor> {
        self.to_device(t)
    }

    fn upload_rows(&self, t: &HostTensor) -> Result<CudaTensor> {
        self.to_device(t)
    }

    fn profile_phase(&self, name: &str) {
        if let Some(p) = &self.profiler {
            p.phase(name);
        }
    }

    fn to_host(&self, t: &CudaTensor) -> Result<HostTensor> {
        let _span = self.span("to_host");
        match &t.data {
            Storage::Host(h) => return Ok(HostTensor { shape: vec![t.rows, t.cols], data: h.to_f32() }),
            Storage::HostFp8(h) => return h.to_host(t.cols),
            Storage::DeviceFp8(d) => return d.to_host(&self.stream, t.cols),
            _ => {}
        }
        let n = t.len();
        // Through a pinned buffer: a pageable copy is staged by the driver
        // and takes ~10× longer for the logits of a large vocabulary.
        let mut staging = lock(&self.staging);
        if staging.as_ref().is_none_or(|s| s.len() < n) {
            // SAFETY: the buffer is only read after the copy into it completed (`as_slice` waits).
            let buf = unsafe { self.ctx.alloc_pinned_with_flags::<bf16>(n.max(1 << 18), 0) }.cu()?;
            *staging = Some(buf);
        }
        let buf = staging.as_mut().ok_or_else(|| shape_err("staging buffer".into()))?;
        let host = &mut buf.as_mut_slice().cu()?[..n];
        if n > 0 {
            // SAFETY: `host` is n elements of pinned memory, the source n live
            // device elements; the stream is synchronised before `host` is read.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(host, self.tp(t), self.stream.cu_stream()) }.cu()?;
            self.stream.synchronize().cu()?;
        }
        let data = if n >= 1 << 16 {
            host[..n].par_iter().map(|x| x.to_f32()).collect()
        } else {
            host[..n].iter().map(|x| x.to_f32()).collect()
        };
        Ok(HostTensor { shape: vec![t.rows, t.cols], data })
    }

    fn dims(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn embedding(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        let _span = self.span("embedding");
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(EngineError::TokenOutOfRange { id, vocab: table.rows });
        }
        let out = self.tensor(ids.len(), table.cols)?;
        let dev = self.meta(ids)?;
        let (o, t, i, c) = (self.tp(&out), self.tp(table), self.ptr(&dev), table.cols as i32);
        self.launch_pdl(&self.k.embedding_gather, Self::rows_cfg(ids.len(), 256), &[&o, &t, &i, &c])?;
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        let _span = self.span("rms_norm");
        if weight.len() != x.cols {
            return Err(shape_err(format!("rms_norm weight {} for width {}", weight.len(), x.cols)));
        }
        let out = self.tensor(x.rows, x.cols)?;
        let (o, xi, w, c) = (self.tp(&out), self.tp(x), self.tp(weight), x.cols as i32);
        if x.cols.is_multiple_of(8) && x.cols <= 8 * 1024 {
            let threads = (x.cols / 8).div_ceil(32) * 32;
            self.launch_pdl(&self.k.rms_norm_v8, Self::rows_cfg(x.rows, threads as u32), &[&o, &xi, &w, &c, &eps])?;
        } else {
            self.launch(&self.k.rms_norm, Self::rows_cfg(x.rows, 256), &[&o, &xi, &w, &c, &eps])?;
        }
        Ok(out)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaTensor, bias: Option<&CudaTensor>) -> Result<CudaTensor> {
        let _span = self.span("linear");
        if x.cols != w.cols {
            return Err(shape_err(format!("linear: x [{}, {}] · w [{}, {}]ᵀ", x.rows, x.cols, w.rows, w.cols)));
        }
        if let Some(b) = bias
            && b.len() != w.rows
        {
            return Err(shape_err(format!("bias of {} for {} outputs", b.len(), w.rows)));
        }
        let out = self.tensor(x.rows, w.rows)?;
        if x.rows > 0 {
            let cublas = || -> Result<()> {
                let (alpha, beta) = (1.0f32, 0.0f32);
                let blas = lock(&self.blas);
                // Column-major view: out (w.rows × n) = wᵀᵀ · x, with w stored [out, in].
                // SAFETY: the pointers address live buffers of the sizes given.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *blas.0.handle(),
                        cublasOperation_t::CUBLAS_OP_T,
                        cublasOperation_t::CUBLAS_OP_N,
                        w.rows as i32,
                        x.rows as i32,
                        x.cols as i32,
                        (&alpha) as *const f32 as *const c_void,
                        self.tp(w) as *const c_void,
                        cudaDataType_t::CUDA_R_16BF,
                        w.cols as i32,
                        self.tp(x) as *const c_void,
                        cudaDataType_t::CUDA_R_16BF,
                        x.cols as i32,
                        (&beta) as *const f32 as *const c_void,
                        self.tp(&out) as *mut c_void,
                        cudaDataType_t::CUDA_R_16BF,
                        w.rows as i32,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .cu()?;
                Ok(())
            };
            let ours = |split| self.gemv(&out, x, w, bias, split, GemvOut::Product);
            let ran = match &self.tuner {
                Some(t) if x.rows <= TUNED_ROWS => {
                    let shape = GemmShape { rows: x.rows, n: w.rows, k: x.cols };
                    let ops = Operands { x: self.tp(x), w: self.tp(w), out: self.tp(&out) };
                    let ours = self.gemv_applies(x, w).then_some(&ours as &dyn Fn(u32) -> Result<()>);
                    lock(t).run(&self.ctx, &self.stream, shape, ops, GemmKernels { cublas: &cublas, ours })?
                }
                _ => {
                    cublas()?;
                    Ran::Library
                }
            };
            if ran == Ran::Ours {
                return Ok(out);
            }
        }
        if let Some(b) = bias {
            let (o, bi, n, c) = (self.tp(&out), self.tp(b), out.len(), w.rows as i32);
            self.launch_pdl(&self.k.add_bias, self.elementwise_cfg(n), &[&o, &bi, &n, &c])?;
        }
        Ok(out)
    }

    fn rope(&self, x: &mut CudaTensor, head_dim: usize, positions: &[u32], rope: &Rope) -> Result<()> {
        let _span = self.span("rope");
        if positions.len() != x.rows
            || !x.cols.is_multiple_of(head_dim)
            || rope.dim() > head_dim
            || !rope.dim().is_multiple_of(4)
        {
            return Err(shape_err(format!(
                "rope: {} positions for [{}, {}] with head_dim {head_dim}",
                positions.len(),
                x.rows,
                x.cols
            )));
        }
        let r = self.rope_tables(rope)?;
        let pos = self.meta(positions)?;
        let (xp, pp, c, hd, rot) = (self.tp(x), self.ptr(&pos), x.cols as i32, head_dim as i32, rope.dim() as i32);
        let (cs, sn, inv, tp) = (self.ptr(&r.cos), self.ptr(&r.sin), self.ptr(&r.inv_freq), TABLE_POSITIONS as u32);
        self.launch(&self.k.rope_apply, Self::rows_cfg(x.rows, 128), &[&xp, &pp, &c, &hd, &rot, &cs, &sn, &inv, &tp])
    }

    fn layer_norm(&self, x: &CudaTensor, weight: &CudaTensor, bias: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        let _span = self.span("layer_norm");
        if weight.len() != x.cols || bias.len() != x.cols {
            return Err(shape_err(format!("layer_norm weight/bias for width {}", x.cols)));
        }
        let out = self.tensor(x.rows, x.cols)?;
        let (o, xi, w, b, c) = (self.tp(&out), self.tp(x), self.tp(weight), self.tp(bias), x.cols as i32);
        self.launch(&self.k.layer_norm, Self::rows_cfg(x.rows, 256), &[&o, &xi, &w, &b, &c, &eps])?;
        Ok(out)
    }

    fn gelu(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let _span = self.span("gelu");
        let out = self.tensor(x.rows, x.cols)?;
        let (o, xi, n) = (self.tp(&out), self.tp(x), x.len());
        self.launch(&self.k.gelu, self.elementwise_cfg(n), &[&o, &xi, &n])?;
        Ok(out)
    }

    fn silu_mul(&self, gate_up: &CudaTensor) -> Result<CudaTensor> {
        let _span = self.span("silu_mul");
        if !gate_up.cols.is_multiple_of(2) {
            return Err(shape_err(format!("silu_mul of an odd width {}", gate_up.cols)));
        }
        let half = gate_up.cols / 2;
        if !half.is_multiple_of(2) {
            return Err(shape_err(format!("silu_mul: half width {half} must be even")));
        }
        let out = self.tensor(gate_up.rows, half)?;
        let (o, g, h) = (self.tp(&out), self.tp(gate_up), half as i32);
        self.launch_pdl(&self.k.silu_mul, Self::row_blocks_cfg(gate_up.rows, half / 2), &[&o, &g, &h])?;
        Ok(out)
    }

    fn linear_silu_mul(&self, x: &CudaTensor, w: &CudaTensor, bias: Option<&CudaTensor>) -> Result<CudaTensor> {
        // Fused where our kernel is the tuned choice for the gate and up
        // projections' shape (few rows); else the two ops.
        match self.gemv_choice(x, w) {
            Some(split) if w.rows.is_multiple_of(2) => {
                let _span = self.span("linear_silu_mul");
                let out = self.tensor(x.rows, w.rows / 2)?;
                self.gemv(&out, x, w, bias, split, GemvOut::SiluMul)?;
                Ok(out)
            }
            _ => self.silu_mul(&self.linear(x, w, bias)?),
        }
    }

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        let _span = self.span("split_cols");
        if widths.iter().sum::<usize>() != x.cols {
            return Err(shape_err(format!("split_cols {widths:?} of width {}", x.cols)));
        }
        let mut start = 0;
        let mut parts = Vec::with_capacity(widths.len());
        for &w in widths {
            let out = self.tensor(x.rows, w)?;
            let (o, xp, wi, xc, st) = (self.tp(&out), self.tp(x), w as i32, x.cols as i32, start as i32);
            let vec: i32 = if [w, x.cols, start].iter().all(|v| v.is_multiple_of(8)) { 8 } else { 1 };
            let cfg = Self::row_blocks_cfg(x.rows, w / vec as usize);
            self.launch(&self.k.copy_cols, cfg, &[&o, &xp, &wi, &xc, &st, &vec])?;
            parts.push(out);
            start += w;
        }
        Ok(parts)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let _span = self.span("add_assign");
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(shape_err("add_assign: shapes differ".into()));
        }
        if !x.len().is_multiple_of(2) {
            return Err(shape_err(format!("add_assign of an odd size {}", x.len())));
        }
        let (xp, yp, n) = (self.tp(x), self.tp(y), x.len());
        self.launch_pdl(&self.k.add_assign, self.elementwise_cfg(n / 2), &[&xp, &yp, &n])
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, weight: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        self.fused_add_rms_norm(x, y, weight, eps)
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let _span = self.span("select_rows");
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(shape_err(format!("select_rows: row {r} of {}", x.rows)));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let out = self.tensor(rows.len(), x.cols)?;
        let dev = self.meta(&idx)?;
        let (o, xi, i, c) = (self.tp(&out), self.tp(x), self.ptr(&dev), x.cols as i32);
        self.launch(&self.k.select_rows, Self::rows_cfg(rows.len(), 256), &[&o, &xi, &i, &c])?;
        Ok(out)
    }

    fn argmax_rows(&self, x: &CudaTensor) -> Result<Vec<u32>> {
        let _span = self.span("argmax_rows");
        if x.rows == 0 {
            return Ok(Vec::new());
        }
        // Parts of ARGMAX_CHUNK columns (8 per thread of a 256-thread block,
        // 16-byte loads): a 150k vocabulary is read by ~75 blocks a row.
        const ARGMAX_CHUNK: usize = 256 * 8;
        let parts = x.cols.div_ceil(ARGMAX_CHUNK).max(1);
        // SAFETY: `argmax_parts` writes every (row, part) entry and
        // `argmax_merge_parts` one id per row before anything reads them.
        let (best, idx, out) = unsafe {
            (
                self.stream.alloc::<f32>(x.rows * parts).cu()?,
                self.stream.alloc::<i32>(x.rows * parts).cu()?,
                self.stream.alloc::<u32>(x.rows).cu()?,
            )
        };
        let (bp, ip, o, xi) = (self.ptr(&best), self.ptr(&idx), self.ptr(&out), self.tp(x));
        let (c, chunk, n) = (x.cols as i32, ARGMAX_CHUNK as i32, parts as i32);
        let cfg =
            LaunchConfig { grid_dim: (parts as u32, x.rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch_pdl(&self.k.argmax_parts, cfg, &[&bp, &ip, &xi, &c, &chunk])?;
        self.launch_pdl(&self.k.argmax_merge_parts, Self::rows_cfg(x.rows, 128), &[&o, &bp, &ip, &n])?;
        self.stream.clone_dtoh(&out).cu()
    }

    fn row_sq_distance(&self, a: &CudaTensor, b: &CudaTensor) -> Result<Vec<f32>> {
        let _span = self.span("row_sq_distance");
        if (a.rows, a.cols) != (b.rows, b.cols) {
            return Err(shape_err(format!("row_sq_distance: {}×{} and {}×{}", a.rows, a.cols, b.rows, b.cols)));
        }
        if a.rows == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the kernel writes one sum per row (block), every row.
        let out = unsafe { self.stream.alloc::<f32>(a.rows) }.cu()?;
        let (o, ap, bp, c) = (self.ptr(&out), self.tp(a), self.tp(b), a.cols as i32);
        self.launch(&self.k.row_sq_distance, Self::rows_cfg(a.rows, 256), &[&o, &ap, &bp, &c])?;
        self.stream.clone_dtoh(&out).cu()
    }

    fn attention_mass(&self, q: &CudaTensor, k: &CudaTensor, shape: AttentionShape) -> Result<Vec<f32>> {
        let _span = self.span("attention_mass");
        let AttentionShape { num_heads, num_kv_heads, head_dim, scale } = shape;
        if q.cols != num_heads * head_dim
            || k.cols != num_kv_heads * head_dim
            || head_dim > 256
            || num_kv_heads == 0
            || !num_heads.is_multiple_of(num_kv_heads)
        {
            return Err(shape_err(format!(
                "attention_mass: q {}×{}, k {}×{} for {shape:?}",
                q.rows, q.cols, k.rows, k.cols
            )));
        }
        if k.rows == 0 {
            return Ok(Vec::new());
        }
        let out = self.stream.alloc_zeros::<f32>(k.rows).cu()?;
        if q.rows > 0 {
            let (o, qp, kp) = (self.ptr(&out), self.tp(q), self.tp(k));
            let (n, h, kvh, d) = (k.rows as i32, num_heads as i32, num_kv_heads as i32, head_dim as i32);
            let cfg = Self::rows_cfg(q.rows * num_heads, 256);
            self.launch(&self.k.attention_mass, cfg, &[&o, &qp, &kp, &n, &h, &kvh, &d, &scale])?;
        }
        self.stream.clone_dtoh(&out).cu()
    }

    fn concat_rows(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        let _span = self.span("concat_rows");
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(shape_err("concat_rows: widths differ".into()));
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let out = self.tensor(rows, cols)?;
        let mut at = self.tp(&out);
        for p in parts {
            let bytes = p.len() * 2;
            if bytes > 0 {
                // SAFETY: `out` has room for every part; each source is a live tensor of `bytes` bytes.
                unsafe { cudarc::driver::result::memcpy_dtod_async(at, self.tp(p), bytes, self.stream.cu_stream()) }
                    .cu()?;
            }
            at += bytes as u64;
        }
        Ok(out)
    }

    fn attention_bidirectional(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        shape: AttentionShape,
        spans: &[(usize, usize)],
    ) -> Result<CudaTensor> {
        let _span = self.span("attention_bidirectional");
        let width = shape.num_heads * shape.head_dim;
        if [q, k, v].iter().any(|t| t.cols != width || t.rows != q.rows) || shape.num_kv_heads != shape.num_heads {
            return Err(shape_err("attention_bidirectional: q, k, v shapes disagree".into()));
        }
        let mut row_span = vec![0u32; 2 * q.rows];
        let mut longest = 0;
        for &(start, len) in spans {
            if start + len > q.rows {
                return Err(shape_err(format!("attention span {start}+{len} beyond {} rows", q.rows)));
            }
            longest = longest.max(len);
            for r in start..start + len {
                row_span[2 * r] = start as u32;
                row_span[2 * r + 1] = len as u32;
            }
        }
        let out = self.tensor(q.rows, width)?;
        let rs = self.meta(&row_span)?;
        let cfg = LaunchConfig {
            grid_dim: (q.rows as u32, shape.num_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (longest * 4) as u32,
        };
        let (o, qp, kp, vp, rp) = (self.tp(&out), self.tp(q), self.tp(k), self.tp(v), self.ptr(&rs));
        let (h, d) = (shape.num_heads as i32, shape.head_dim as i32);
        self.launch(&self.k.attention_bidirectional, cfg, &[&o, &qp, &kp, &vp, &rp, &h, &d, &shape.scale])?;
        Ok(out)
    }
}
