//! How much background work (storing an ingest, encoding stored facts'
//! KV) the engine thread does beside serving. Pure decisions, tested
//! without an engine.
//!
//! The engine thread does one thing at a time: while it stores or encodes,
//! no request's step runs. With nothing to serve, background work goes at
//! full speed, in slices of about [`IDLE_SLICE`] (a request that arrives
//! then waits for one slice at most). While requests run — or ran a moment
//! ago: a client's next request comes right after its last one ends — it
//! gets a share of the thread's time (`share`), in slices sized to take
//! about half a step (a request then waits at most about half a step more
//! between two of its tokens), and work
//! whose single item takes more than [`MAX_ITEM_STEPS`] steps waits for
//! the engine to be idle — a slice of it would stall every running request
//! for that long — unless it must progress (an ingest a client waits
//! for), which then goes an item at a time within its share.

use std::time::{Duration, Instant};

/// The share of the engine thread's time that each kind of background
/// work (storing ingests; encoding stored facts) may take while requests
/// run: a request's steps then come at least this much less often than
/// idle ones (with both kinds busy, half as often at worst).
pub(crate) const BACKGROUND_SHARE: f64 = 0.25;

/// A slice beside requests is sized to take this many steps: a token
/// then waits at most about 1.5 steps where it would have waited one.
pub(crate) const SLICE_STEPS: f64 = 0.5;

/// How long a slice of background work takes at most when nothing is
/// served (one item at least).
pub(crate) const IDLE_SLICE: Duration = Duration::from_millis(200);

/// How long the engine counts as serving after its last request: a closed
/// loop of clients leaves gaps of a few milliseconds between requests,
/// which are not idle time.
pub(crate) const RECENTLY_BUSY: Duration = Duration::from_secs(1);

/// A background item (one unit stored, one fact encoded) that takes longer
/// than this many serving steps is not run while requests run.
pub(crate) const MAX_ITEM_STEPS: f64 = 2.0;

#[derive(Debug, Clone)]
pub(crate) struct Throttle {
    /// Share of the engine thread's time background work may take while
    /// requests run (0..1).
    share: f64,
    /// Items a slice may take at most.
    max: usize,
    /// When the next slice may start while requests run.
    next: Option<Instant>,
    /// The last measured time per item, beside requests and when idle
    /// (an item may do more when idle: an ingest encodes its KV then).
    per_item: Option<Duration>,
    per_item_idle: Option<Duration>,
    /// Whether a slice takes one item at least, however long one takes.
    must_progress: bool,
}

impl Throttle {
    pub(crate) fn new(share: f64, max: usize, must_progress: bool) -> Throttle {
        let share = share.clamp(0.01, 1.0);
        Throttle { share, max: max.max(1), next: None, per_item: None, per_item_idle: None, must_progress }
    }

    /// How many items the slice that may start `now` takes: when the
    /// engine is idle (`busy` false), as many as fit in [`IDLE_SLICE`]
    /// (one at least, `max` at most); while it serves, 0 until the last
    /// slice's share of time has passed, then as many as fit in about
    /// [`SLICE_STEPS`] of a `step` (at least one), or 0 if one item takes more than
    /// [`MAX_ITEM_STEPS`] steps and the work need not progress.
    pub(crate) fn allowance(&self, now: Instant, busy: bool, step: Duration) -> usize {
        if !busy {
            return match self.per_item_idle {
                None => 1,
                Some(t) => ((IDLE_SLICE.as_secs_f64() / t.as_secs_f64().max(1e-6)) as usize).clamp(1, self.max),
            };
        }
        if self.next.is_some_and(|t| now < t) {
            return 0;
        }
        match self.per_item {
            None => 1,
            Some(t) if t.as_secs_f64() > MAX_ITEM_STEPS * step.as_secs_f64() => usize::from(self.must_progress),
            Some(t) => ((SLICE_STEPS * step.as_secs_f64() / t.as_secs_f64().max(1e-6)) as usize).clamp(1, self.max),
        }
    }

    /// A slice of `items` items took `took`, ending `now`: the next one
    /// waits so that background work keeps to its share of the time.
    pub(crate) fn done(&mut self, now: Instant, items: usize, took: Duration, busy: bool) {
        if items > 0 {
            let per = Some(took / items as u32);
            match busy {
                true => self.per_item = per,
                false => self.per_item_idle = per,
            }
        }
        self.next = busy.then(|| now + took.mul_f64(1.0 / self.share - 1.0));
    }
}

/// An exponentially weighted mean of step durations (the serving step a
/// slice is sized against).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepTime(Option<Duration>);

impl StepTime {
    pub(crate) fn observe(&mut self, took: Duration) {
        self.0 = Some(match self.0 {
            None => took,
            Some(m) => m.mul_f64(0.9) + took.mul_f64(0.1),
        });
    }

    /// The mean (a millisecond before any step was seen).
    pub(crate) fn get(&self) -> Duration {
        self.0.unwrap_or(Duration::from_millis(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn idle_work_runs_at_full_speed_in_slices_a_request_waits_little_for() {
        let now = Instant::now();
        let mut t = Throttle::new(0.25, 16, false);
        assert_eq!(t.allowance(now, false, 30 * MS), 1, "the first slice probes one item");
        t.done(now, 1, 50 * MS, false);
        assert_eq!(t.allowance(now, false, 30 * MS), 4, "200 ms of 50 ms items, at once");
        t.done(now, 4, 8 * MS, false);
        assert_eq!(t.allowance(now, false, 30 * MS), 16, "never more than the batch");
        t.done(now, 1, 900 * MS, false);
        assert_eq!(t.allowance(now, false, 30 * MS), 1, "one at least");
    }

    #[test]
    fn beside_requests_slices_fit_a_step_and_keep_to_their_share() {
        let now = Instant::now();
        let mut t = Throttle::new(0.25, 16, false);
        let step = 30 * MS;
        assert_eq!(t.allowance(now, true, step), 1, "the first slice probes one item");
        t.done(now, 1, 5 * MS, true);
        // 5 ms an item: three fit in half a 30 ms step; the next slice waits
        // 3× the last one's time (a quarter of the time is background work).
        assert_eq!(t.allowance(now, true, step), 0);
        assert_eq!(t.allowance(now + 14 * MS, true, step), 0);
        assert_eq!(t.allowance(now + 15 * MS, true, step), 3);
        t.done(now + 30 * MS, 3, 15 * MS, true);
        assert_eq!(t.allowance(now + 70 * MS, true, step), 0);
        assert_eq!(t.allowance(now + 75 * MS, true, step), 3);
        // Idle again: no waiting.
        t.done(now + 140 * MS, 6, 30 * MS, false);
        assert_eq!(t.allowance(now + 141 * MS, false, step), 16, "5 ms an item when idle");
    }

    #[test]
    fn an_item_longer_than_two_steps_waits_for_idle_unless_it_must_progress() {
        let now = Instant::now();
        let mut t = Throttle::new(0.5, 16, false);
        t.done(now, 1, 300 * MS, true);
        let later = now + Duration::from_secs(10);
        assert_eq!(t.allowance(later, true, 30 * MS), 0, "300 ms an item against 30 ms steps");
        assert_eq!(t.allowance(later, true, 200 * MS), 1, "against 200 ms steps one goes");
        // Idle slices are measured apart: they may do more per item.
        t.done(later, 16, Duration::from_secs(30), false);
        assert_eq!(t.allowance(later, true, 200 * MS), 1);
        let mut ingest = Throttle::new(0.5, 16, true);
        ingest.done(now, 1, 300 * MS, true);
        assert_eq!(ingest.allowance(later, true, 30 * MS), 1, "one item at a time, within the share");
        assert_eq!(ingest.allowance(now + 299 * MS, true, 30 * MS), 0);
    }

    #[test]
    fn step_time_is_a_running_mean() {
        let mut s = StepTime::default();
        assert_eq!(s.get(), MS);
        s.observe(10 * MS);
        assert_eq!(s.get(), 10 * MS);
        s.observe(110 * MS);
        assert_eq!(s.get(), 20 * MS);
    }
}
