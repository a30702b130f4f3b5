//! `--cold-kv auto`: whether a kv-mode request waits for its cold facts'
//! reads or prefills them, chosen by what each costs.
//!
//! A fact whose KV is on disk only can reach the request two ways: read by
//! a reader thread (the request waits, outside the scheduler, until the read
//! is cached) or pasted as text and prefilled with the question. Reads run
//! on a few threads in order of arrival, so the m-th of this request's
//! reads is done after the reads queued before it and its own predecessors.
//! The two cost different people: a wait delays only the request that
//! waits (the engine steps on without it), while a pasted token lengthens
//! the step that every sequence in the batch waits on. So the rule counts a
//! prefilled token's time once for the request and once for each sequence
//! that shares its steps (running, queued, or waiting for its own reads and
//! joining the batch after them), and the request waits for the first m
//! reads and prefills the rest, with the m that makes the sum smallest: on
//! an idle server its own wait against its own prefill, under load nearly
//! always the reads. The rule is pure, here; the measurements it is fed (seconds
//! per read, seconds per prefilled token, the reads queued, the sequences
//! sharing the steps) are the engine thread's.

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
    /// Sequences that share the steps which prefill this request's pasted
    /// tokens: running, queued for the scheduler, or waiting for their own
    /// reads. Counting only the running ones let a restart's burst — a
    /// hundred requests waiting for reads, none running — prefill 350 facts
    /// in its first second where `wait` prefilled 70 (docs/performance.md,
    /// "`--cold-kv auto` measured after its change").
    pub sharing: usize,
}

/// The shortest deadline of a request that waits for reads: reads vary
/// with the disk and the load, and a request is released as soon as its
/// reads are cached, so a deadline costs only when a read is late.
pub const MIN_WAIT: Duration = Duration::from_millis(20);

/// The deadline of a request expected to wait `expected` (zero: no wait)
/// for reads whose facts would cost `prefill` to prefill instead (seconds
/// of everyone's time: [`plan`]'s weighting). Twice the expected wait
/// leaves room for a late read; and a request whose reads are late keeps
/// waiting while its wait is still below what prefilling those facts
/// would cost (as one rents skis until the rent reaches their price): a
/// late read costs no more waiting than the larger of twice the expected
/// wait and the prefill it saves.
/// Under load that is the cap (`--cold-kv-wait-ms`), as `--cold-kv wait`
/// waits; a deadline of twice the expected wait alone released the
/// requests whose reads ran late into prefills that every running
/// sequence waited on — 220–245 facts in the steady 25 s of a point where
/// `wait` prefilled 18–161, and 3 % fewer requests (docs/performance.md,
/// "The 400-user stream on an H200").
pub fn deadline(expected: Duration, prefill: Duration) -> Duration {
    match expected.is_zero() {
        true => Duration::ZERO,
        false => (2 * expected).max(prefill).max(MIN_WAIT),
    }
}

/// How long a request may wait for its cold facts' reads (`tokens`: each
/// fact's, in the order their reads are queued), at most `cap`
/// (`--cold-kv-wait-ms`): the deadline of [`plan`]'s choice, or, before a
/// read and a prefill were measured, the whole cap, as `--cold-kv wait`
/// does: the first reads measure the disk, and a restart's first burst —
/// every request's facts on disk, nothing measured — waits for reads rather
/// than prefilling every fact of a hundred requests at once (measured:
/// docs/performance.md, "Cold facts after a restart: waiting beats
/// prefilling"). The request is released as soon as its reads are cached.
pub fn wait_limit(costs: &ColdCosts, tokens: &[usize], cap: Duration) -> Duration {
    if tokens.is_empty() {
        return Duration::ZERO;
    }
    match plan(costs, tokens) {
        Some((m, expected)) => deadline(expected, prefill_cost(costs, &tokens[..m])).min(cap),
        None => cap,
    }
}

/// What prefilling facts of `tokens` costs everyone ([`token_cost`]);
/// zero before a prefill was measured.
fn prefill_cost(costs: &ColdCosts, tokens: &[usize]) -> Duration {
    let seconds = token_cost(costs).unwrap_or(0.0) * tokens.iter().sum::<usize>() as f64;
    Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
}

/// A prefilled token's cost, seconds: its time once for the request and
/// once for each sequence sharing the steps; `None` until a prefill was
/// measured.
fn token_cost(costs: &ColdCosts) -> Option<f64> {
    Some(costs.prefill_s_per_token? * (1 + costs.sharing) as f64)
}

/// Of a request's cold facts (their tokens, in the order their reads are
/// queued), how many to wait for and how long that is expected to take:
/// the first `m` are injected once read, the rest prefilled; `None`
/// without a measured read and prefill (nothing to weigh). A wait costs
/// its length once; a prefilled token its time for this request and for
/// each sequence sharing the steps. Ties go to waiting less.
pub fn plan(costs: &ColdCosts, tokens: &[usize]) -> Option<(usize, Duration)> {
    let (read_s, per_token) = (costs.read_s?, token_cost(costs)?);
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
    Some((best.0, Duration::from_secs_f64(best.2)))
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

    /// Costs on an idle server (nothing running beside the request).
    fn costs(read_ms: f64, readers: usize, backlog: usize, prefill_us_per_token: f64) -> ColdCosts {
        ColdCosts {
            read_s: Some(read_ms / 1e3),
            readers,
            backlog,
            prefill_s_per_token: Some(prefill_us_per_token / 1e6),
            sharing: 0,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn fast_reads_are_waited_for_and_slow_ones_prefilled() {
        // Four facts of 100 tokens. Reads of 5 ms on 4 idle threads finish
        // together at 5 ms; prefilling 400 tokens at 50 µs each is 20 ms.
        assert_eq!(plan(&costs(5.0, 4, 0, 50.0), &[100; 4]), Some((4, ms(5))));
        // A disk 10× slower: 50 ms of waiting against 20 ms of prefill.
        assert_eq!(plan(&costs(50.0, 4, 0, 50.0), &[100; 4]), Some((0, Duration::ZERO)));
        // A deep queue makes even fast reads late: 40 reads ahead on 4
        // threads put this request's first read 55 ms out.
        assert_eq!(plan(&costs(5.0, 4, 40, 50.0), &[100; 4]), Some((0, Duration::ZERO)));
    }

    #[test]
    fn a_request_waits_for_the_reads_that_come_soon_and_prefills_the_rest() {
        // Two threads, 10 ms a read, 2 reads ahead: this request's reads
        // finish at 20, 20, 30, 30, 40, 40 ms. Prefilling a 200-token fact
        // costs 20 ms at 100 µs a token: each further pair of reads costs
        // 10 ms more waiting and saves 40 ms of prefill.
        assert_eq!(plan(&costs(10.0, 2, 2, 100.0), &[200; 6]), Some((6, ms(40))));
        // With 50-token facts (5 ms each to prefill) no wait pays: the first
        // two reads cost 20 ms of waiting to save 10 ms of prefill.
        assert_eq!(plan(&costs(10.0, 2, 2, 100.0), &[50; 6]), Some((0, Duration::ZERO)));
        let plan_ = plan(&costs(10.0, 2, 2, 100.0), &[300, 300, 10, 10, 10, 10]);
        assert_eq!(plan_, Some((2, ms(20))), "the long facts, whose reads come first");
    }

    #[test]
    fn under_load_a_prefill_costs_every_sequence_sharing_the_steps() {
        // The 50-token facts above, which an idle server prefills (30 ms of
        // prefill against 40 ms of waiting for all six): beside 3 running
        // sequences the prefill costs 4 × 30 ms, beside 100 far more.
        let busy = |sharing| ColdCosts { sharing, ..costs(10.0, 2, 2, 100.0) };
        assert_eq!(plan(&busy(3), &[50; 6]), Some((6, ms(40))));
        assert_eq!(plan(&busy(100), &[50; 6]), Some((6, ms(40))));
        // One running sequence already tips it: all six reads (40 ms of
        // waiting) against 2 × 30 ms of steps.
        assert_eq!(plan(&busy(1), &[50; 6]), Some((6, ms(40))));
        // A disk slow enough still loses: a second a read against 20-token
        // facts, 4 running.
        let slow = ColdCosts { sharing: 4, ..costs(1000.0, 2, 0, 100.0) };
        assert_eq!(plan(&slow, &[20; 2]), Some((0, Duration::ZERO)));
    }

    #[test]
    fn a_burst_of_waiting_requests_counts_as_load() {
        // A restart: 800 reads queued on 8 threads at 10 ms each, nothing
        // running. Eight 25-token facts at 60 µs a token: 12 ms of prefill
        // against a second of waiting, so a lone request prefills; with 99
        // requests waiting beside it (they join the steps that prefill its
        // facts) the prefill costs 100 × 12 ms and it waits.
        let burst = |sharing| ColdCosts { sharing, ..costs(10.0, 8, 800, 60.0) };
        assert_eq!(plan(&burst(0), &[25; 8]), Some((0, Duration::ZERO)));
        assert_eq!(plan(&burst(99), &[25; 8]), Some((8, ms(1010))));
        assert_eq!(wait_limit(&burst(99), &[25; 8], ms(200)), ms(200), "within the cap");
    }

    #[test]
    fn before_anything_is_measured_a_request_waits_as_wait_does() {
        let cap = ms(200);
        let unmeasured =
            ColdCosts { read_s: None, readers: 4, backlog: 0, prefill_s_per_token: Some(1e-4), sharing: 0 };
        assert_eq!(plan(&unmeasured, &[100; 3]), None);
        assert_eq!(wait_limit(&unmeasured, &[100; 3], cap), cap);
        let unmeasured = ColdCosts { read_s: Some(1e-3), prefill_s_per_token: None, ..unmeasured };
        assert_eq!(wait_limit(&unmeasured, &[100; 3], cap), cap);
        assert_eq!(wait_limit(&unmeasured, &[], cap), Duration::ZERO, "no cold facts, no wait");
        assert_eq!(wait_limit(&costs(1.0, 4, 0, 50.0), &[], cap), Duration::ZERO);
    }

    #[test]
    fn a_late_read_is_waited_for_while_waiting_costs_less_than_prefilling() {
        // The six 200-token facts above, on an idle server: expected 40 ms,
        // their prefill 120 ms (1,200 tokens at 100 µs), so the request
        // waits up to 120 ms; a lower cap wins; a plan that waits for
        // nothing waits not at all.
        assert_eq!(wait_limit(&costs(10.0, 2, 2, 100.0), &[200; 6], ms(200)), ms(120));
        assert_eq!(wait_limit(&costs(10.0, 2, 2, 100.0), &[200; 6], ms(50)), ms(50));
        assert_eq!(wait_limit(&costs(10.0, 2, 2, 100.0), &[50; 6], ms(200)), Duration::ZERO);
        // One 400-token fact (40 ms to prefill) read in 30 ms: twice the
        // expected wait is the longer, 60 ms.
        assert_eq!(wait_limit(&costs(30.0, 8, 0, 100.0), &[400], ms(200)), ms(60));
        // Beside 100 sequences the six 50-token facts' prefill costs 101 ×
        // 30 ms: the request waits up to the cap, as `--cold-kv wait` does,
        // where twice its expected 40 ms released it at 80.
        let busy = ColdCosts { sharing: 100, ..costs(10.0, 2, 2, 100.0) };
        assert_eq!(plan(&busy, &[50; 6]), Some((6, ms(40))));
        assert_eq!(wait_limit(&busy, &[50; 6], ms(200)), ms(200));
        // Waiting for the first two of four facts weighs only those two.
        let two = ColdCosts { sharing: 1, ..costs(10.0, 2, 0, 100.0) };
        assert_eq!(plan(&two, &[300, 300, 10, 10]), Some((2, ms(10))));
        assert_eq!(wait_limit(&two, &[300, 300, 10, 10], ms(500)), ms(120), "2 × 600 tokens × 100 µs");
    }

    #[test]
    fn the_deadline_leaves_room_for_a_late_read_up_to_the_prefill_it_saves() {
        assert_eq!(deadline(Duration::ZERO, ms(500)), Duration::ZERO, "no wait planned");
        assert_eq!(deadline(ms(3), Duration::ZERO), MIN_WAIT);
        assert_eq!(deadline(ms(40), ms(10)), ms(80));
        assert_eq!(deadline(ms(40), ms(500)), ms(500));
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
