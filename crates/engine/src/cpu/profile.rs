//! Per-op wall time of the CPU backend, for finding where a forward pass
//! spends it: with `INFERSCALE_CPU_PROFILE=1` every op is timed, and at
//! each [`crate::Backend::profile_phase`] a table (count, total and mean
//! time per op) of the phase that ends goes to stderr. The CPU backend runs
//! each op to completion before returning, so an op's wall time is its
//! cost. Off, an op pays one check of a flag set once.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

#[derive(Default)]
struct State {
    /// Per op: calls and total milliseconds.
    totals: BTreeMap<&'static str, (usize, f64)>,
    phase: Option<String>,
}

static PROFILE: OnceLock<Option<Mutex<State>>> = OnceLock::new();

fn profiler() -> Option<&'static Mutex<State>> {
    PROFILE
        .get_or_init(|| {
            std::env::var("INFERSCALE_CPU_PROFILE").is_ok_and(|v| v == "1").then(|| Mutex::new(State::default()))
        })
        .as_ref()
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // A panic while holding the lock leaves only counters behind.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An op being timed; its time is added when dropped.
pub(crate) struct Span {
    name: &'static str,
    start: Instant,
}

/// Starts timing `name` when profiling is on.
pub(crate) fn span(name: &'static str) -> Option<Span> {
    profiler().map(|_| Span { name, start: Instant::now() })
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(p) = profiler() {
            let ms = self.start.elapsed().as_secs_f64() * 1e3;
            let mut s = lock(p);
            let e = s.totals.entry(self.name).or_default();
            e.0 += 1;
            e.1 += ms;
        }
    }
}

/// Reports the phase that ends and starts counting for `name`.
pub(crate) fn phase(name: &str) {
    let Some(p) = profiler() else { return };
    let mut s = lock(p);
    if !s.totals.is_empty() {
        crate::backend::print_op_profile("cpu", "wall", s.phase.as_deref(), &s.totals);
    }
    s.totals.clear();
    s.phase = Some(name.to_string());
}
