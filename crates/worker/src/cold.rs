//! `--cold-kv auto`: whether a kv-mode request waits for its cold facts'
//! reads or prefills them, chosen by what each costs it.
//!
//! A fact whose KV is on disk only can reach the request two ways: read by
//! a reader thread (the request waits, outside the scheduler, until the read
//! is cached) or pasted as text and prefilled with the question. Reads run
//! on a few threads in order of arrival, so the m-th of this request's
//! reads is done after the reads queued before it and its own predecessors;
//! a prefill costs every pasted token. The request waits for the first m
//! reads and prefills the rest, with the m that makes the wait plus the
//! prefill smallest — the rule, pure, here; the measurements it is fed
//! (seconds per read, seconds per prefilled token, the reads queued) are
//! the engine thread's running means.

use std::time::Duration;

/// What the choice is made from: running means, and the readers' queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColdCosts {
    /// One fact's read on one reader thread (read, check, decode, cache),
    /// seconds; `None` until a read was measured.
    pub read_s: Option<f64>,
    /// Reader threads working in parallel.
    pub readers: usize,
    /// Reads queued or running before this request's.
    pub backlog: usize,
    /// One prefilled token, seconds; `None` until a prefill was measured.
    pub prefill_s_per_token: Option<f64>,
}

/// How long past its expected wait a request waits for its reads: reads
/// vary with the disk and the load, and a request is released as soon as
/// its reads are cached, so this costs only when a read is late. The
/// deadline is twice the expected wait, and at least this.
pub const MIN_WAIT: Duration = Duration::from_millis(20);

/// The deadline for a request expected to wait `expected` (zero: none).
pub fn deadline(expected: Duration) -> Duration {
    match expected.is_zero() {
        true => Duration::ZERO,
        false => (2 * expected).max(MIN_WAIT),
    }
}

/// Of a request's cold facts (their tokens, in the order their reads are
/// queued), how many to wait for and how long that is expected to take:
/// the first `m` are injected once read, the rest prefilled. Without a measured read or prefill there
/// is nothing to weigh: prefill them all (`ColdKv::Prefill`'s choice, which
/// never waits for the disk); the reads are queued either way, so the next
/// request has the measurement. Ties go to waiting less.
pub fn plan(costs: &ColdCosts, tokens: &[usize]) -> (usize, Duration) {
    let (Some(read_s), Some(per_token)) = (costs.read_s, costs.prefill_s_per_token) else {
        return (0, Duration::ZERO);
    };
    let readers = costs.readers.max(1);
    // The m-th read completes with its wave: reads run `readers` at a time.
    let wait = |m: usize| if m == 0 { 0.0 } else { read_s * (costs.backlog + m).div_ceil(readers) as f64 };
    let total: usize = tokens.iter().sum();
    let mut best = (0, per_token * total as f64, 0.0);
    let mut pasted = total;
    for (i, &t) in tokens.iter().enumerate() {
        pasted -= t;
        let m = i + 1;
        let cost = wait(m) + per_token * pasted as f64;
        if cost < best.1 {
            best = (m, cost, wait(m));
        }
    }
    (best.0, Duration::from_secs_f64(best.2))
}

/// A running mean that follows change: each sample moves it by 1/8.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mean(Option<f64>);

impl Mean {
    pub fn observe(&mut self, x: f64) {
        if x.is_finite() && x >= 0.0 {
            self.0 = Some(self.0.map_or(x, |m| m + (x - m) / 8.0));
        }
    }

    pub fn get(&self) -> Option<f64> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(read_ms: f64, readers: usize, backlog: usize, prefill_us_per_token: f64) -> ColdCosts {
        ColdCosts {
            read_s: Some(read_ms / 1e3),
            readers,
            backlog,
            prefill_s_per_token: Some(prefill_us_per_token / 1e6),
        }
    }

    #[test]
    fn fast_reads_are_waited_for_and_slow_ones_prefilled() {
        // Four facts of 100 tokens. Reads of 5 ms on 4 idle threads finish
        // together at 5 ms; prefilling 400 tokens at 50 µs each is 20 ms.
        assert_eq!(plan(&costs(5.0, 4, 0, 50.0), &[100; 4]), (4, Duration::from_millis(5)));
        // A disk 10× slower: 50 ms of waiting against 20 ms of prefill.
        assert_eq!(plan(&costs(50.0, 4, 0, 50.0), &[100; 4]), (0, Duration::ZERO));
        // A deep queue makes even fast reads late: 40 reads ahead on 4
        // threads put this request's first read 55 ms out.
        assert_eq!(plan(&costs(5.0, 4, 40, 50.0), &[100; 4]), (0, Duration::ZERO));
    }

    #[test]
    fn a_request_waits_for_the_reads_that_come_soon_and_prefills_the_rest() {
        // Two threads, 10 ms a read, 2 reads ahead: this request's reads
        // finish at 20, 20, 30, 30, 40, 40 ms. Prefilling a 200-token fact
        // costs 20 ms at 100 µs a token: each further pair of reads costs
        // 10 ms more waiting and saves 40 ms of prefill.
        let (m, wait) = plan(&costs(10.0, 2, 2, 100.0), &[200; 6]);
        assert_eq!((m, wait), (6, Duration::from_millis(40)));
        // With 50-token facts (5 ms each to prefill) no wait pays: the first
        // two reads cost 20 ms of waiting to save 10 ms of prefill.
        assert_eq!(plan(&costs(10.0, 2, 2, 100.0), &[50; 6]), (0, Duration::ZERO));
        let (m, wait) = plan(&costs(10.0, 2, 2, 100.0), &[300, 300, 10, 10, 10, 10]);
        assert_eq!((m, wait), (2, Duration::from_millis(20)), "the long facts, whose reads come first");
    }

    #[test]
    fn without_measurements_every_cold_fact_is_prefilled() {
        let unmeasured = ColdCosts { read_s: None, readers: 4, backlog: 0, prefill_s_per_token: Some(1e-4) };
        assert_eq!(plan(&unmeasured, &[100; 3]), (0, Duration::ZERO));
        let unmeasured = ColdCosts { read_s: Some(1e-3), readers: 4, backlog: 0, prefill_s_per_token: None };
        assert_eq!(plan(&unmeasured, &[100; 3]), (0, Duration::ZERO));
        assert_eq!(plan(&costs(1.0, 4, 0, 50.0), &[]), (0, Duration::ZERO), "no cold facts, no wait");
    }

    #[test]
    fn the_deadline_leaves_room_for_a_late_read() {
        assert_eq!(deadline(Duration::ZERO), Duration::ZERO);
        assert_eq!(deadline(Duration::from_millis(3)), MIN_WAIT);
        assert_eq!(deadline(Duration::from_millis(40)), Duration::from_millis(80));
    }

    #[test]
    fn the_mean_follows_its_samples() {
        let mut m = Mean::default();
        assert_eq!(m.get(), None);
        m.observe(8.0);
        assert_eq!(m.get(), Some(8.0));
        m.observe(16.0);
        assert_eq!(m.get(), Some(9.0));
        m.observe(f64::NAN);
        m.observe(-1.0);
        assert_eq!(m.get(), Some(9.0), "nonsense is not a sample");
    }
}
