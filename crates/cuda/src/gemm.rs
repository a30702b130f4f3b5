//! GEMMs with few rows — a question's 20 tokens, a decode batch — tuned
//! once per shape.
//!
//! At such shapes a GEMM is bound by reading the weight once, and which
//! kernel gets closest to that depends on the shape: how the K dimension is
//! split across blocks, the tile, the number of stages. cuBLAS picks by
//! heuristic. For `rows ≤ TUNED_ROWS` we ask cuBLASLt for its candidates,
//! time each (and cuBLAS's own choice) on the call's own buffers the first
//! time a shape is seen, and keep the fastest. Each timed call starts with
//! the L2 cache flushed: in a forward pass every weight comes from HBM, and
//! a weight that fits in L2 would otherwise favour kernels that only win
//! when it is already there. Row counts share a choice
//! within a bucket (1, 2, 4, 8, 16, then steps of 32: what is fastest moves
//! little inside one), so a server whose decode batches take every size
//! tunes each weight about thirteen times, not 256; a bucket's algorithm is
//! checked against each new row count (`cublasLtMatmulAlgoCheck`) before it
//! runs it. Tuning a shape costs a few milliseconds, once. For at most
//! [`GEMV_ROWS`](crate::kernels::GEMV_ROWS) rows our own kernel (gemv.cu) is
//! a candidate too, kept only where it is the fastest; it adds the bias in
//! the same pass.
//! Candidates compute the same products with different summation orders,
//! so results may differ in the last bits from cuBLAS's choice (each
//! algorithm is deterministic; `inferscale check` holds them to the CPU).
//! `INFERSCALE_CUDA_GEMM_LOG=1` prints every tuning's times.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtHandle_t, cublasLtMatmulAlgo_t, cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t,
    cublasLtMatmulHeuristicResult_t, cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t, cublasStatus_t,
    cudaDataType,
};
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig};
use inferscale_engine::Result;

use crate::backend::{Cu, CudaBackend, CudaTensor, shape_err};
use crate::error::CudaError;
use crate::kernels::{GEMV_ROWS, GEMV_THREADS};

/// Most rows for which shapes are tuned (beyond, cuBLAS's choice stands).
pub const TUNED_ROWS: usize = 256;
/// Workspace for split-K candidates.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Candidates asked of cuBLASLt per shape.
const CANDIDATES: usize = 16;
/// Warps a column our kernel is timed with (gemv.cu).
pub(crate) const GEMV_SPLITS: [u32; 4] = [1, 2, 4, 8];
/// Timed calls per candidate (after one warm-up).
const TIMED: usize = 5;
/// Bytes written between timed calls to evict the L2 cache (50 MB on an
/// H200; twice that covers larger parts).
const FLUSH_BYTES: usize = 128 << 20;

/// `out [rows, n] = x [rows, k] · w [n, k]ᵀ`, bf16 with f32 accumulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
}

/// Device pointers of one call.
#[derive(Debug, Clone, Copy)]
pub struct Operands {
    pub x: u64,
    pub w: u64,
    pub out: u64,
}

/// Rows of a shape's bucket (see the module doc).
pub fn row_bucket(rows: usize) -> usize {
    if rows <= 16 { rows.next_power_of_two() } else { rows.next_multiple_of(32) }
}

/// A bucket's choice: cuBLAS's own, a cuBLASLt algorithm, or our kernel.
#[derive(Clone, Copy)]
enum Choice {
    Cublas,
    Lt(cublasLtMatmulAlgo_t, usize),
    /// Ours, with this many warps a column.
    Ours(u32),
}

/// The kernels one call may run: cuBLAS's own choice, and ours where it
/// applies to the operands (few rows, aligned, `k` a multiple of 8).
pub(crate) struct Kernels<'a> {
    pub cublas: &'a dyn Fn() -> Result<()>,
    /// Ours with the given warps a column (one of [`GEMV_SPLITS`]), the
    /// call's bias (if any) added in the same pass.
    pub ours: Option<&'a dyn Fn(u32) -> Result<()>>,
}

/// What our GEMV writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemvOut {
    /// The product (plus the bias).
    Product,
    /// `silu(g) · u` of the product's two halves: the MLP's activation.
    SiluMul,
}

/// Which kernel a call ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ran {
    /// cuBLAS or cuBLASLt: the bias is still to be added.
    Library,
    /// Ours: the bias is in.
    Ours,
}

/// What a tuned shape runs.
enum Plan {
    /// cuBLAS's own choice won (or no candidate applied).
    Cublas,
    Lt(LtPlan),
    Ours(u32),
}

/// A cuBLASLt matmul: its descriptors and the chosen algorithm.
struct LtPlan {
    desc: cublasLtMatmulDesc_t,
    layouts: [cublasLtMatrixLayout_t; 3],
    algo: cublasLtMatmulAlgo_t,
    workspace: usize,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: created by `LtPlan::new` and used by no call in flight
        // (plans live as long as the tuner, which outlives its calls).
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

/// The cuBLASLt handle, its workspace and the plans chosen so far. Used
/// only under its mutex, as the cuBLAS handle is.
pub(crate) struct Tuner {
    handle: cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// Whether each tuning prints its candidates' times.
    log: bool,
    /// Overwritten between timed calls (allocated at the first tuning).
    flush: Option<CudaSlice<u8>>,
    /// Per (row bucket, n, k).
    choices: HashMap<Shape, Choice>,
    /// Per exact shape, with its descriptors.
    plans: HashMap<Shape, Plan>,
}

// SAFETY: the raw handles are only touched under the backend's mutex.
unsafe impl Send for Tuner {}

impl Drop for Tuner {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: every plan using the handle is gone.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Tuner {
    pub(crate) fn new(stream: &std::sync::Arc<CudaStream>) -> crate::Result<Self> {
        let handle = lt::create_handle().map_err(|e| CudaError::Unsupported(format!("cuBLASLt: {e:?}")))?;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        let log = std::env::var("INFERSCALE_CUDA_GEMM_LOG").is_ok_and(|v| v == "1");
        Ok(Tuner { handle, workspace, log, flush: None, choices: HashMap::new(), plans: HashMap::new() })
    }

    /// The split of our kernel if it is the plan of shape `s`.
    pub(crate) fn ours(&self, s: Shape) -> Option<u32> {
        match self.plans.get(&s) {
            Some(&Plan::Ours(split)) => Some(split),
            _ => None,
        }
    }

    /// Runs the GEMM: with the shape's plan, tuning it first if new.
    pub(crate) fn run(
        &mut self,
        ctx: &std::sync::Arc<CudaContext>,
        stream: &std::sync::Arc<CudaStream>,
        s: Shape,
        o: Operands,
        k: Kernels<'_>,
    ) -> Result<Ran> {
        if !self.plans.contains_key(&s) {
            let bucket = Shape { rows: row_bucket(s.rows), ..s };
            let plan = match self.choices.get(&bucket) {
                Some(&Choice::Lt(algo, ws)) => self.checked(s, algo, ws)?,
                Some(Choice::Cublas) => Plan::Cublas,
                Some(&Choice::Ours(split)) => Plan::Ours(split),
                None => {
                    if self.flush.is_none() {
                        // SAFETY: only ever written, never read.
                        self.flush = Some(unsafe { stream.alloc::<u8>(FLUSH_BYTES) }.cu()?);
                    }
                    let plan = self.tune(ctx, stream, s, o, &k)?;
                    let choice = match &plan {
                        Plan::Lt(p) => Choice::Lt(p.algo, p.workspace),
                        Plan::Cublas => Choice::Cublas,
                        Plan::Ours(split) => Choice::Ours(*split),
                    };
                    self.choices.insert(bucket, choice);
                    plan
                }
            };
            self.plans.insert(s, plan);
        }
        match (self.plans.get(&s), k.ours) {
            (Some(Plan::Lt(p)), _) => self.matmul(stream, p, o).map(|()| Ran::Library),
            // Ours won for the shape but does not apply to these operands
            // (a misaligned view): cuBLAS's choice.
            (Some(&Plan::Ours(split)), Some(ours)) => ours(split).map(|()| Ran::Ours),
            _ => (k.cublas)().map(|()| Ran::Library),
        }
    }

    fn tune(
        &self,
        ctx: &std::sync::Arc<CudaContext>,
        stream: &CudaStream,
        s: Shape,
        o: Operands,
        k: &Kernels<'_>,
    ) -> Result<Plan> {
        let flush = match &self.flush {
            Some(f) => cudarc::driver::DevicePtr::device_ptr(f, stream).0,
            None => return Ok(Plan::Cublas),
        };
        let (a, b) = (ctx.new_event(Some(CU_EVENT_DEFAULT)).cu()?, ctx.new_event(Some(CU_EVENT_DEFAULT)).cu()?);
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f32> {
            f()?;
            let mut total = 0.0;
            for _ in 0..TIMED {
                // SAFETY: `flush` addresses FLUSH_BYTES of device memory nothing reads.
                unsafe { cudarc::driver::result::memset_d8_async(flush, 0, FLUSH_BYTES, stream.cu_stream()) }.cu()?;
                a.record(stream).cu()?;
                f()?;
                b.record(stream).cu()?;
                total += a.elapsed_ms(&b).cu()?;
            }
            Ok(total)
        };
        let cublas_ms = time(k.cublas)?;
        let mut best = (cublas_ms, Plan::Cublas);
        for candidate in self.candidates(s)? {
            // A candidate that fails to run is skipped, not fatal.
            if let Ok(t) = time(&|| self.matmul(stream, &candidate, o))
                && t < best.0
            {
                best = (t, Plan::Lt(candidate));
            }
        }
        let mut ours_ms: Option<(f32, u32)> = None;
        for split in GEMV_SPLITS {
            let Some(ours) = k.ours else { break };
            let t = time(&|| ours(split))?;
            if ours_ms.is_none_or(|(best, _)| t < best) {
                ours_ms = Some((t, split));
            }
        }
        if let Some((t, split)) = ours_ms
            && t < best.0
        {
            best = (t, Plan::Ours(split));
        }
        if self.log {
            let us = |ms: f32| ms * 1e3 / TIMED as f32;
            let name = match best.1 {
                Plan::Cublas => "cuBLAS",
                Plan::Lt(_) => "cuBLASLt",
                Plan::Ours(_) => "ours",
            };
            eprintln!(
                "inferscale cuda gemm: rows {} n {} k {}: cuBLAS {:.1} µs, ours {}, chosen {name} {:.1} µs \
                 ({:.0} GB/s of weight)",
                s.rows,
                s.n,
                s.k,
                us(cublas_ms),
                ours_ms.map_or("–".to_string(), |(t, split)| format!("{:.1} µs (split {split})", us(t))),
                us(best.0),
                (s.n * s.k * 2) as f32 / (us(best.0) * 1e3)
            );
        }
        Ok(best.1)
    }

    /// The bucket's algorithm for the exact shape `s`, if cuBLASLt accepts
    /// it there; else cuBLAS's choice.
    fn checked(&self, s: Shape, algo: cublasLtMatmulAlgo_t, workspace: usize) -> Result<Plan> {
        let mut p = LtPlan::new(s, algo, workspace)?;
        let mut result = MaybeUninit::<cublasLtMatmulHeuristicResult_t>::zeroed();
        // SAFETY: the descriptors are live; `result` is written by the call.
        let status = unsafe {
            cudarc::cublaslt::sys::cublasLtMatmulAlgoCheck(
                self.handle,
                p.desc,
                p.layouts[0],
                p.layouts[1],
                p.layouts[2],
                p.layouts[2],
                &p.algo,
                result.as_mut_ptr(),
            )
        };
        // SAFETY: zero-initialised, and written by the check when it succeeds.
        let needs = unsafe { result.assume_init() }.workspaceSize;
        Ok(if status == cublasStatus_t::CUBLAS_STATUS_SUCCESS && needs <= WORKSPACE_BYTES {
            p.workspace = needs.max(workspace);
            Plan::Lt(p)
        } else {
            Plan::Cublas
        })
    }

    /// cuBLASLt's candidates for `s`, each with its own descriptors.
    fn candidates(&self, s: Shape) -> Result<Vec<LtPlan>> {
        let base = LtPlan::new(s, cublasLtMatmulAlgo_t { data: [0; 8] }, 0)?;
        let pref = lt::create_matmul_pref().map_err(blas)?;
        let bytes = WORKSPACE_BYTES as u64;
        let mut found = [MaybeUninit::<cublasLtMatmulHeuristicResult_t>::zeroed(); CANDIDATES];
        let mut count = 0i32;
        // SAFETY: the descriptors are live; `found` has room for CANDIDATES results.
        let status = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .and_then(|()| {
                cudarc::cublaslt::sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    base.desc,
                    base.layouts[0],
                    base.layouts[1],
                    base.layouts[2],
                    base.layouts[2],
                    pref,
                    CANDIDATES as i32,
                    found.as_mut_ptr() as *mut cublasLtMatmulHeuristicResult_t,
                    &mut count,
                )
                .result()
            })
        };
        // SAFETY: created above, used by nothing after this.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        if status.is_err() {
            return Ok(Vec::new()); // no candidates: cuBLAS's choice stands
        }
        let mut out = Vec::new();
        for r in &found[..count.clamp(0, CANDIDATES as i32) as usize] {
            // SAFETY: the first `count` entries were written by the heuristic query.
            let r = unsafe { r.assume_init() };
            if r.state == cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE_BYTES {
                out.push(LtPlan::new(s, r.algo, r.workspaceSize)?);
            }
        }
        Ok(out)
    }

    fn matmul(&self, stream: &CudaStream, p: &LtPlan, o: Operands) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (ws, _sync) = cudarc::driver::DevicePtr::device_ptr(&self.workspace, stream);
        // SAFETY: the descriptors match the operands' shapes (the plan was
        // made for this shape); the pointers address live buffers of them.
        unsafe {
            lt::matmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                o.w as *const c_void,
                p.layouts[0],
                o.x as *const c_void,
                p.layouts[1],
                o.out as *const c_void,
                p.layouts[2],
                o.out as *mut c_void,
                p.layouts[2],
                &p.algo,
                ws as *mut c_void,
                p.workspace,
                stream.cu_stream() as _,
            )
        }
        .map_err(blas)
    }
}

impl LtPlan {
    /// Column-major view, as the cuBLAS path uses: `out (n × rows) =
    /// wᵀ (n × k) · x (k × rows)`, with w stored `[n, k]` row-major, i.e.
    /// `k × n` column-major and transposed.
    fn new(s: Shape, algo: cublasLtMatmulAlgo_t, workspace: usize) -> Result<Self> {
        let bf16 = cudaDataType::CUDA_R_16BF;
        let desc =
            lt::create_matmul_desc(cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType::CUDA_R_32F).map_err(blas)?;
        let layouts = [
            lt::create_matrix_layout(bf16, s.k as u64, s.n as u64, s.k as i64),
            lt::create_matrix_layout(bf16, s.k as u64, s.rows as u64, s.k as i64),
            lt::create_matrix_layout(bf16, s.n as u64, s.rows as u64, s.n as i64),
        ];
        let plan = |layouts: [cublasLtMatrixLayout_t; 3]| LtPlan { desc, layouts, algo, workspace };
        let layouts = match layouts {
            [Ok(a), Ok(b), Ok(c)] => [a, b, c],
            other => {
                // Free whatever was made before reporting.
                for l in other.iter().flatten() {
                    // SAFETY: just created, used by nothing.
                    let _ = unsafe { lt::destroy_matrix_layout(*l) };
                }
                // SAFETY: as above.
                let _ = unsafe { lt::destroy_matmul_desc(desc) };
                return Err(CudaError::Unsupported("cuBLASLt matrix layout".into()).into());
            }
        };
        let p = plan(layouts);
        // The attribute is a cublasOperation_t, an int32 in the C API.
        let op_t = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32;
        // SAFETY: `desc` is live and the value is of the attribute's type.
        unsafe {
            lt::set_matmul_desc_attribute(
                p.desc,
                cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_t as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(blas)?;
        Ok(p)
    }
}

fn blas(e: cudarc::cublaslt::result::CublasError) -> inferscale_engine::EngineError {
    CudaError::Unsupported(format!("cuBLASLt: {e:?}")).into()
}

impl CudaBackend {
    /// Whether `gemv` applies to `x · wᵀ`: few rows, rows of whole 16-byte
    /// words, both operands 16-byte aligned.
    pub(crate) fn gemv_applies(&self, x: &CudaTensor, w: &CudaTensor) -> bool {
        (1..=GEMV_ROWS).contains(&x.rows)
            && x.cols == w.cols
            && x.cols.is_multiple_of(8)
            && self.tp(x).is_multiple_of(16)
            && self.tp(w).is_multiple_of(16)
            && w.rows <= i32::MAX as usize
    }

    /// `out = x · wᵀ (+ bias)` by our kernel (gemv.cu), `split` warps a
    /// column (one of [`GEMV_SPLITS`]) — or, for [`GemvOut::SiluMul`] (w
    /// stacks the gate and up projections), `out = silu(g) · u` of its two
    /// halves `[g | u]`: the same bits as the product then `silu_mul`.
    pub(crate) fn gemv(
        &self,
        out: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
        split: u32,
        what: GemvOut,
    ) -> Result<()> {
        let gated = what == GemvOut::SiluMul;
        let n = if gated { w.rows / 2 } else { w.rows };
        if !GEMV_SPLITS.contains(&split) {
            return Err(shape_err(format!("gemv: {split} warps a column")));
        }
        if !self.gemv_applies(x, w)
            || (gated && !w.rows.is_multiple_of(2))
            || (out.rows, out.cols) != (x.rows, n)
            || bias.is_some_and(|b| b.len() != w.rows)
        {
            return Err(shape_err(format!(
                "gemv{}: x [{}, {}] · w [{}, {}]ᵀ into [{}, {}]",
                if gated { " (gated)" } else { "" },
                x.rows,
                x.cols,
                w.rows,
                w.cols,
                out.rows,
                out.cols
            )));
        }
        let k = &self.k;
        let f = match (x.rows.next_power_of_two(), gated) {
            (1, false) => &k.gemv_r1,
            (2, false) => &k.gemv_r2,
            (4, false) => &k.gemv_r4,
            (_, false) => &k.gemv_r8,
            (1, true) => &k.gemv_silu_r1,
            (2, true) => &k.gemv_silu_r2,
            (4, true) => &k.gemv_silu_r4,
            (_, true) => &k.gemv_silu_r8,
        };
        let per_block = (GEMV_THREADS / 32 / split) as usize;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(per_block) as u32, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (o, xp, wp, bp) = (self.tp(out), self.tp(x), self.tp(w), bias.map_or(0, |b| self.tp(b)));
        let (rows, n, k, split) = (x.rows as i32, n as i32, x.cols as i32, split as i32);
        self.launch_pdl(f, cfg, &[&o, &xp, &wp, &bp, &rows, &n, &k, &split])
    }

    /// The split our kernel runs `x · wᵀ` with, if the tuner chose it for
    /// this shape and it applies to these operands (`None` before the
    /// shape's first `linear`, which tunes it).
    pub(crate) fn gemv_choice(&self, x: &CudaTensor, w: &CudaTensor) -> Option<u32> {
        if !self.gemv_applies(x, w) {
            return None;
        }
        let tuner = self.tuner.as_ref()?;
        crate::backend::lock(tuner).ours(Shape { rows: x.rows, n: w.rows, k: x.cols })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_buckets_are_few_and_cover_every_row_count() {
        let buckets: std::collections::BTreeSet<usize> = (1..=TUNED_ROWS).map(row_bucket).collect();
        assert_eq!(buckets.len(), 13, "{buckets:?}");
        for rows in 1..=TUNED_ROWS {
            let b = row_bucket(rows);
            assert!(b >= rows && b <= TUNED_ROWS, "{rows} -> {b}");
        }
        assert_eq!(
            (row_bucket(1), row_bucket(3), row_bucket(16), row_bucket(17), row_bucket(100)),
            (1, 4, 16, 32, 128)
        );
    }
}
