//! Per-op device time, for finding where a forward pass spends it: set
//! `INFERSCALE_CUDA_PROFILE=1` and the backend brackets every op with CUDA
//! events and prints a table (count, total and mean device milliseconds per
//! op) to stderr when the last clone of the backend is dropped. Events cost
//! host time and serialise nothing, but leave profiling off for timings.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

#[derive(Default)]
struct State {
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    totals: BTreeMap<&'static str, (usize, f64)>,
    /// What the totals are of (see [`Profiler::phase`]).
    phase: Option<String>,
}

impl State {
    fn fold(&mut self) {
        for (name, start, end) in self.pending.drain(..) {
            if let Ok(ms) = start.elapsed_ms(&end) {
                let e = self.totals.entry(name).or_default();
                e.0 += 1;
                e.1 += ms as f64;
            }
        }
    }

    /// Prints the totals (after folding what is pending; the stream must be
    /// synchronised).
    fn report(&mut self) {
        self.fold();
        if self.totals.is_empty() {
            return;
        }
        inferscale_engine::backend::print_op_profile("cuda", "device", self.phase.as_deref(), &self.totals);
    }
}

pub(crate) struct Profiler {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<State>,
}

/// An op in progress; its end event is recorded when dropped.
pub(crate) struct Span<'a> {
    p: &'a Profiler,
    name: &'static str,
    start: Option<CudaEvent>,
}

impl Profiler {
    /// A profiler when `INFERSCALE_CUDA_PROFILE=1`.
    pub fn from_env(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Option<Arc<Profiler>> {
        (std::env::var("INFERSCALE_CUDA_PROFILE").is_ok_and(|v| v == "1")).then(|| {
            Arc::new(Profiler { ctx: ctx.clone(), stream: stream.clone(), state: Mutex::new(State::default()) })
        })
    }

    /// Reports what was measured since the last phase began, under that
    /// phase's name, and starts counting anew for `name` — so that a
    /// benchmark's timed runs are not mixed with its set-up (encoding,
    /// GEMM tuning, warm-up).
    pub fn phase(&self, name: &str) {
        if self.stream.synchronize().is_err() {
            return;
        }
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.report();
        s.totals.clear();
        s.phase = Some(name.to_string());
    }

    pub fn span(&self, name: &'static str) -> Span<'_> {
        let start = self.stream.record_event(Some(CU_EVENT_DEFAULT)).ok();
        Span { p: self, name, start }
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        let (Some(start), Ok(end)) = (self.start.take(), self.p.stream.record_event(Some(CU_EVENT_DEFAULT))) else {
            return;
        };
        let mut s = self.p.state.lock().unwrap_or_else(|e| e.into_inner());
        s.pending.push((self.name, start, end));
        if s.pending.len() >= 20_000 && self.p.stream.synchronize().is_ok() {
            s.fold();
        }
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if self.stream.synchronize().is_err() {
            return;
        }
        self.state.lock().unwrap_or_else(|e| e.into_inner()).report();
    }
}
