//! The injection kernel timed alone, with device events, next to the copies
//! that bound it: a device-to-device copy of the same bytes (the ceiling of
//! injection from device memory) and a pinned host-to-device copy (the
//! ceiling of injection from the host tier). `inferscale bench inject`
//! prints it.

use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use half::bf16;
use inferscale_engine::Result;
use inferscale_engine::backend::{InjectChunk, KvSpec, KvTiers, PagedKv, Tensors};
use inferscale_engine::rope::Rope;
use inferscale_model::HostTensor;

use crate::backend::{Cu, CudaBackend, CudaTensor};

/// Device time per call, in µs, for `payload_bytes` of K and V (every
/// layer of every injected token, counted once).
#[derive(Debug, Clone, Copy)]
pub struct InjectionTiming {
    pub tokens: usize,
    pub payload_bytes: usize,
    /// Injection from device memory (the kernel and its table upload).
    pub inject_us: f64,
    /// `cuMemcpyDtoDAsync` of the payload.
    pub copy_dtod_us: f64,
    /// Injection from the host tier, until every layer is ready.
    pub inject_host_tier_us: f64,
    /// `cuMemcpyHtoDAsync` of the payload from pinned memory.
    pub copy_htod_us: f64,
}

impl CudaBackend {
    /// Times `reps` injections of `facts` chunks of `fact_tokens` tokens
    /// each into a cache of `spec`'s shape (its `num_blocks` is grown to fit),
    /// back to back between two events, for each of the four operations.
    pub fn time_injection(
        &self,
        spec: KvSpec,
        rope: &Rope,
        facts: usize,
        fact_tokens: usize,
        reps: usize,
    ) -> Result<InjectionTiming> {
        let tokens = facts * fact_tokens;
        let spec = KvSpec { num_blocks: spec.num_blocks.max(tokens.div_ceil(spec.block_size)), ..spec };
        let mut store = self.new_kv_store(spec)?;
        let (layers, kv_dim) = (spec.num_layers, spec.kv_dim());
        let zeros = HostTensor { shape: vec![fact_tokens, kv_dim], data: vec![0.0; fact_tokens * kv_dim] };
        let device: Vec<Layers> = (0..facts)
            .map(|_| {
                let k = (0..layers).map(|_| self.upload_rows(&zeros)).collect::<Result<Vec<_>>>()?;
                let v = (0..layers).map(|_| self.upload_rows(&zeros)).collect::<Result<Vec<_>>>()?;
                Ok((k, v))
            })
            .collect::<Result<_>>()?;
        let hosted: Vec<Layers> = (0..facts)
            .map(|_| {
                let mut k = self.upload_rows_host_tier(&vec![&zeros; 2 * layers])?;
                let v = k.split_off(layers);
                Ok((k, v))
            })
            .collect::<Result<_>>()?;
        // Fact i at positions and slots i·fact_tokens.. (a prompt's layout).
        let places: Vec<Vec<u32>> =
            (0..facts).map(|i| (0..fact_tokens).map(|t| (i * fact_tokens + t) as u32).collect()).collect();
        let (dev_chunks, host_chunks) = (chunk_list(&device, &places), chunk_list(&hosted, &places));
        let payload = 2 * tokens * layers * kv_dim * 2;
        let src = self.stream.alloc_zeros::<bf16>(payload / 2).cu()?;
        let dst = self.stream.alloc_zeros::<bf16>(payload / 2).cu()?;
        // SAFETY: the pinned buffer is only read by the device copies below.
        let pinned = unsafe { self.ctx.alloc_pinned_with_flags::<bf16>(payload / 2, 0) }.cu()?;
        let (sp, dp) = (self.ptr(&src), self.ptr(&dst));
        let host = pinned.as_slice().cu()?;
        let cs = self.stream.cu_stream();

        let mut inject = |chunks: &[InjectChunk<'_, CudaTensor>]| -> Result<()> {
            self.inject(&mut store, chunks, rope)?;
            self.await_all_layers(&store)
        };
        let us_dev = self.time(reps, || inject(&dev_chunks))?;
        let us_host = self.time(reps, || inject(&host_chunks))?;
        // SAFETY: both buffers hold `payload` bytes; they live past the synchronisation in `time`.
        let us_dtod =
            self.time(reps, || unsafe { cudarc::driver::result::memcpy_dtod_async(dp, sp, payload, cs) }.cu())?;
        // SAFETY: as above, the source being pinned host memory of `payload` bytes.
        let us_htod = self.time(reps, || unsafe { cudarc::driver::result::memcpy_htod_async(dp, host, cs) }.cu())?;
        Ok(InjectionTiming {
            tokens,
            payload_bytes: payload,
            inject_us: us_dev,
            copy_dtod_us: us_dtod,
            inject_host_tier_us: us_host,
            copy_htod_us: us_htod,
        })
    }

    /// Mean device µs of `f` over `reps` back-to-back calls, after one warm-up.
    fn time(&self, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        f()?;
        let start = self.ctx.new_event(Some(CU_EVENT_DEFAULT)).cu()?;
        let end = self.ctx.new_event(Some(CU_EVENT_DEFAULT)).cu()?;
        start.record(&self.stream).cu()?;
        for _ in 0..reps.max(1) {
            f()?;
        }
        end.record(&self.stream).cu()?;
        Ok(start.elapsed_ms(&end).cu()? as f64 * 1e3 / reps.max(1) as f64)
    }
}

type Layers = (Vec<CudaTensor>, Vec<CudaTensor>);

fn chunk_list<'a>(set: &'a [Layers], places: &'a [Vec<u32>]) -> Vec<InjectChunk<'a, CudaTensor>> {
    set.iter().zip(places).map(|((k, v), p)| InjectChunk { k, v, positions: p, slots: p }).collect()
}
