//! Decode steps replayed as CUDA graphs ([`PagedKv::run_decode_graph`]).
//!
//! A decode step of a small model is a few hundred kernels whose work is a
//! few microseconds each: launching them one by one from the host, each with
//! its own stream-ordered allocation, costs more than the kernels (Qwen2.5's
//! 1.5B shape stepped in 2.8–3.9 ms against a 1.0 ms floor of bytes). A
//! graph captured once per batch size replays the whole step in one launch.
//!
//! What a replay cannot change is fixed at capture: kernel arguments (every
//! buffer's address, the grid of each launch) and the GEMMs' plans. So:
//! - the engine pads a step to one of [`GRAPH_ROWS`] rows (rows of one token
//!   in a block set aside for them), so a graph serves every batch size up
//!   to its own;
//! - the step's metadata (tokens, positions, slots and the attention plan:
//!   each sequence's context length and block table) lives in buffers the
//!   graph owns, rewritten before each replay — while capturing, the
//!   backend's `meta` hands out those buffers, by the address of the host
//!   arrays the step was built from, and refuses any other upload;
//! - attention keeps one work per sequence and a fixed number of key
//!   splits, and the kernel sizes each sequence's splits from its own
//!   context length (`keys_per_split` 0);
//! - the logits are copied into a buffer the graph owns, and from it into
//!   the step's result after the replay.
//!
//! The capture runs on a stream of its own, through a cuBLAS handle bound
//! to it, so that other threads' work on the backend's stream (retrieval)
//! never joins a capture. The first step of a size runs as is: it tunes
//! that size's GEMMs (which a capture could not) and gives the step its
//! logits; the capture follows it. A capture that fails leaves that size to
//! run as is from then on, with a warning.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasSetWorkspace_v2, cublasStatus_t};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, result};
use half::bf16;
use inferscale_engine::backend::{AttentionShape, DecodeGraphs, DecodeStep, StepForward, Tensors};
use inferscale_engine::{EngineError, Result};

use crate::backend::{Blas, Cu, CudaBackend, CudaKvStore, CudaTensor, Storage, shape_err};
use crate::error::CudaError;
use crate::paged::{AttentionPlan, plan_attention};

/// Batch sizes with a graph: a step runs at the first at least its rows.
/// Steps of more rows run as they are (at that size launches are a small
/// share of the step).
pub(crate) const GRAPH_ROWS: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256];

/// Most key splits of a graph's attention (each sequence's keys are split
/// over them; idle splits only write an empty partial result).
const MAX_SPLITS: usize = 32;

/// cuBLAS workspace of the capture handle: set explicitly, so that no
/// GEMM allocates one while a capture records.
const BLAS_WORKSPACE: usize = 32 << 20;

/// What a capture reads its step's metadata from (see the module doc).
pub(crate) struct Capture {
    /// The step's host arrays ([`host_key`]) and the device buffers
    /// holding their contents.
    inputs: Vec<(HostKey, Arc<CudaSlice<u32>>)>,
    /// The attention plan (spans, works, block tables: `plan_attention`'s
    /// layout for one work per sequence) and where its parts start.
    pub(crate) plan: Arc<CudaSlice<u32>>,
    pub(crate) works_off: usize,
    pub(crate) tables_off: usize,
    pub(crate) rows: usize,
    pub(crate) splits: usize,
}

/// A host array by address and length: which of a step's inputs an op
/// was handed.
type HostKey = (usize, usize);

fn host_key(data: &[u32]) -> HostKey {
    (data.as_ptr() as usize, data.len())
}

impl Capture {
    /// The device copy of `data`, if it is one of the step's inputs.
    pub(crate) fn input(&self, data: &[u32]) -> Option<Arc<CudaSlice<u32>>> {
        let key = host_key(data);
        self.inputs.iter().find(|(k, _)| *k == key).map(|(_, d)| d.clone())
    }
}

/// A captured graph. CUDA asks only that calls on one graph be serialised:
/// this one belongs to one engine's [`DecodeGraphs`] and is reached only
/// through the engine's `&mut`, so moving it between threads is sound.
struct Graph(CudaGraph);
// SAFETY: see above.
unsafe impl Send for Graph {}

/// One batch size's graph and the buffers it reads and writes.
struct Bucket {
    graph: Graph,
    tokens: Arc<CudaSlice<u32>>,
    positions: Arc<CudaSlice<u32>>,
    slots: Arc<CudaSlice<u32>>,
    plan: Arc<CudaSlice<u32>>,
    /// Elements `plan` holds: a step whose plan is longer (longer block
    /// tables) recaptures with a larger buffer.
    plan_room: usize,
    logits: CudaSlice<bf16>,
    vocab: usize,
}

/// An engine's graphs (the content of its [`DecodeGraphs`]).
struct Graphs {
    stream: Arc<CudaStream>,
    blas: Arc<Mutex<Blas>>,
    _workspace: CudaSlice<u8>,
    buckets: HashMap<usize, Bucket>,
    /// Sizes whose capture failed: they run as they are.
    failed: HashSet<usize>,
}

impl Graphs {
    fn new(be: &CudaBackend) -> Result<Self> {
        let stream = be.ctx.new_stream().cu()?;
        let blas = CudaBlas::new(stream.clone()).cu()?;
        let workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE).cu()?;
        let ws = be.ptr(&workspace);
        // SAFETY: the handle is ours and the workspace outlives it (both
        // are dropped with these graphs, the handle first).
        let status = unsafe { cublasSetWorkspace_v2(*blas.handle(), ws as *mut c_void, BLAS_WORKSPACE) };
        if status != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Unsupported(format!("cublasSetWorkspace: {status:?}")).into());
        }
        stream.synchronize().cu()?;
        Ok(Graphs {
            stream,
            blas: Arc::new(Mutex::new(Blas(blas))),
            _workspace: workspace,
            buckets: HashMap::new(),
            failed: HashSet::new(),
        })
    }
}

impl CudaBackend {
    pub(crate) fn graph_rows(&self, rows: usize) -> Option<usize> {
        // Profiling brackets every op with events, which a replay has none of.
        if self.profiler.is_some() || self.capture.is_some() {
            return None;
        }
        GRAPH_ROWS.iter().copied().find(|&r| r >= rows)
    }

    pub(crate) fn decode_graph(
        &self,
        graphs: &mut DecodeGraphs,
        store: &mut CudaKvStore,
        step: &DecodeStep<'_>,
        forward: &mut StepForward<'_, CudaBackend>,
    ) -> Result<CudaTensor> {
        let rows = step.tokens.len();
        if self.graph_rows(rows) != Some(rows)
            || step.positions.len() != rows
            || step.slots.len() != rows
            || step.spans.len() != rows
            || step.rows == 0
            || step.rows > rows
        {
            return Err(shape_err(format!("a decode graph step of {} rows padded to {rows}", step.rows)));
        }
        // Neither a capture nor a replay may wait for a side-stream injection.
        self.await_all_layers(store)?;
        let spec = store.spec;
        // One work per sequence: any group of query heads fits one work, so
        // plan as if there were one query head per KV head.
        let one_per_seq = AttentionShape {
            num_heads: spec.num_kv_heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            scale: 1.0,
        };
        let plan = plan_attention(step.spans, one_per_seq, rows, spec, 1)?;
        if graphs.state.is_none() {
            graphs.state = Some(Box::new(Graphs::new(self)?));
        }
        let g = graphs
            .state
            .as_mut()
            .and_then(|b| b.downcast_mut::<Graphs>())
            .ok_or_else(|| EngineError::Shape("decode graphs of another backend".into()))?;

        if let Some(b) = g.buckets.get(&rows).filter(|b| b.plan_room >= plan.meta.len()) {
            let s = self.stream.cu_stream();
            // SAFETY: each buffer holds at least the elements copied (sizes
            // checked above and at capture); the host arrays are pageable,
            // so each copy has left them before it returns.
            unsafe {
                result::memcpy_htod_async(self.ptr(&b.tokens), step.tokens, s).cu()?;
                result::memcpy_htod_async(self.ptr(&b.positions), step.positions, s).cu()?;
                result::memcpy_htod_async(self.ptr(&b.slots), step.slots, s).cu()?;
                result::memcpy_htod_async(self.ptr(&b.plan), &plan.meta, s).cu()?;
                // On the backend's stream (not the capture's), after the copies.
                result::graph::launch(b.graph.0.cu_graph_exec(), s).cu()?;
            }
            graphs.replayed += 1;
            return self.first_rows(&b.logits, b.vocab, step.rows);
        }

        // Run as is: this step's result, and the GEMM plans for `rows`.
        let out = forward(self, store)?;
        if !g.failed.contains(&rows) {
            g.buckets.remove(&rows);
            match self.record(g, store, step, &plan, out.cols, forward) {
                Ok(b) => {
                    g.buckets.insert(rows, b);
                    graphs.captured += 1;
                }
                Err(e) => {
                    eprintln!("inferscale: decode steps of {rows} rows run without a graph: its capture failed: {e}");
                    g.failed.insert(rows);
                }
            }
        }
        if step.rows == rows { Ok(out) } else { self.select_rows(&out, &(0..step.rows).collect::<Vec<_>>()) }
    }

    /// Records `forward` on the capture stream into a new bucket.
    fn record(
        &self,
        g: &mut Graphs,
        store: &mut CudaKvStore,
        step: &DecodeStep<'_>,
        plan: &AttentionPlan,
        vocab: usize,
        forward: &mut StepForward<'_, CudaBackend>,
    ) -> Result<Bucket> {
        let rows = step.tokens.len();
        let upload = |data: &[u32], room: usize| -> Result<Arc<CudaSlice<u32>>> {
            let mut d = self.stream.alloc_zeros::<u32>(room).cu()?;
            self.stream.memcpy_htod(data, &mut d.slice_mut(..data.len())).cu()?;
            Ok(Arc::new(d))
        };
        let (tokens, positions, slots) =
            (upload(step.tokens, rows)?, upload(step.positions, rows)?, upload(step.slots, rows)?);
        // Room for block tables twice as long as this step's, and at least
        // 64 blocks (1,024 tokens) a sequence.
        let plan_room = (2 * plan.meta.len()).max(plan.tables_off + 64 * rows);
        let plan_buf = upload(&plan.meta, plan_room)?;
        let logits = self.stream.alloc_zeros::<bf16>(rows * vocab).cu()?;
        let blocks = rows * store.spec.num_kv_heads;
        let splits = (2 * self.sm_count).div_ceil(blocks).clamp(1, MAX_SPLITS);
        let capture = Capture {
            inputs: vec![
                (host_key(step.tokens), tokens.clone()),
                (host_key(step.positions), positions.clone()),
                (host_key(step.slots), slots.clone()),
            ],
            plan: plan_buf.clone(),
            works_off: plan.works_off,
            tables_off: plan.tables_off,
            rows,
            splits,
        };
        // The buffers above are written on the backend's stream; the
        // capture records nothing that runs before a replay, which is
        // queued on that stream too.
        self.stream.synchronize().cu()?;
        let be = self.for_capture(g.stream.clone(), g.blas.clone(), capture);
        g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).cu()?;
        let recorded = (|| -> Result<()> {
            let out = forward(&be, store)?;
            if (out.rows, out.cols) != (rows, vocab) {
                return Err(shape_err(format!("a decode graph's logits [{}, {}]", out.rows, out.cols)));
            }
            let Storage::Device(src) = &out.data else {
                return Err(shape_err("a decode graph's logits off the device".into()));
            };
            // SAFETY: both buffers hold rows × vocab bf16.
            unsafe { result::memcpy_dtod_async(be.ptr(&logits), be.ptr(src), rows * vocab * 2, g.stream.cu_stream()) }
                .cu()
        })();
        // End the capture whatever happened, so the stream is usable again.
        let graph = g.stream.end_capture(CUgraphInstantiate_flags(0));
        drop(be);
        recorded?;
        let graph = graph.cu()?.ok_or_else(|| shape_err("a decode graph captured nothing".into()))?;
        graph.upload().cu()?;
        g.stream.synchronize().cu()?;
        Ok(Bucket { graph: Graph(graph), tokens, positions, slots, plan: plan_buf, plan_room, logits, vocab })
    }

    /// The first `rows` rows of a graph's logits, as a tensor of their own.
    fn first_rows(&self, logits: &CudaSlice<bf16>, vocab: usize, rows: usize) -> Result<CudaTensor> {
        let out = self.tensor(rows, vocab)?;
        // SAFETY: the graph's buffer holds at least `rows` rows of `vocab`.
        unsafe {
            result::memcpy_dtod_async(self.tp(&out), self.ptr(logits), rows * vocab * 2, self.stream.cu_stream())
        }
        .cu()?;
        Ok(out)
    }
}
