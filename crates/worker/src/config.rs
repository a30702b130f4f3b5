//! A worker's settings: its serving limits ([`WorkerConfig`]) and the
//! policies they choose — what a kv request does with cold facts
//! ([`ColdKv`]) and who may reuse whose computed prompt blocks
//! ([`PrefixCache`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inferscale_memory::Prompts;

use crate::protocol::MAX_INGEST_UNITS;

/// Serving limits of a worker.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub max_running: usize,
    pub max_queue: usize,
    /// Largest `k` a request may ask for.
    pub max_k: usize,
    /// Memory units encoded per loop turn during an ingest.
    pub ingest_batch: usize,
    /// Tokens of one unit's encoding (context window and the unit) that the
    /// ingest reserve is sized for; longer encodings may find the pool short.
    pub ingest_tokens_per_unit: usize,
    /// The system prompt of the header and the instruction before each
    /// question (the memory's KV must have been made with this system prompt).
    pub prompts: Prompts,
    /// Most units one ingest request may carry.
    pub max_ingest_units: usize,
    /// What a kv-mode request does with retrieved facts whose KV is on disk
    /// only.
    pub cold_kv: ColdKv,
    /// With [`ColdKv::Wait`] or [`ColdKv::Auto`]: the longest a request
    /// waits for its facts' reads before it prefills those still on disk.
    pub cold_kv_wait: Duration,
    /// Threads that read facts' KV from disk for kv-mode requests (at
    /// least 1): reads in flight at once, which an NVMe queue serves in
    /// parallel, so more of a request's cold facts arrive within
    /// [`WorkerConfig::cold_kv_wait`] instead of being prefilled.
    pub kv_readers: usize,
    /// Save which facts the KV tiers hold when the worker stops (and now
    /// and then while idle), and read them back on free reader threads
    /// after a start, so that a restart's first requests find the popular
    /// facts resident instead of all reading them at once (`inferscale-memory`'s
    /// `resident.rs`). Off by default: on the 400-user stream it lowered
    /// the restart run's TTFT p99 but not its throughput (docs/performance.md,
    /// "Reading back what the tiers held").
    pub kv_warm_restart: bool,
    /// Which requests' prompts may reuse each other's computed KV blocks.
    pub prefix_cache: PrefixCache,
    /// Share of kv and blend requests (0..=1) whose first token is also
    /// computed as prompt mode would, in the engine's spare time, to report
    /// what injection costs in answer quality (`engine_thread/audit.rs`);
    /// 0, the default, audits none.
    pub audit_share: f64,
}

/// The share of injecting requests audited, read at each one: it starts at
/// [`WorkerConfig::audit_share`] and can change while the worker serves
/// ([`crate::WorkerService::set_audit_share`]), so that an operator turns the
/// audit on or off without a restart and a benchmark measures several
/// shares on one warm worker.
#[derive(Debug)]
pub(crate) struct AuditShare(AtomicU64);

impl AuditShare {
    pub(crate) fn new(share: f64) -> AuditShare {
        AuditShare(AtomicU64::new(share.clamp(0.0, 1.0).to_bits()))
    }

    pub(crate) fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    pub(crate) fn set(&self, share: f64) {
        self.0.store(share.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
    }
}

/// Automatic prefix caching of computed prompt blocks (prompt and none
/// mode: the requests whose every token is computed). A request whose
/// prompt starts with whole blocks a request before it computed takes
/// their KV instead of computing them; `usage.cached_tokens` counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PrefixCache {
    /// Within a user only: one user's prompts are never found by another's,
    /// so the time to the first token says nothing of other users' prompts.
    /// Requests without a user (which no tenant scopes) are not cached.
    #[default]
    User,
    /// Across users (the prompts of users sharing a memory, or a long
    /// shared system prompt): for deployments whose users may learn what
    /// other users' prompts begin with.
    Shared,
    /// No prefix caching (the header cache still shares system prompts).
    Off,
}

impl PrefixCache {
    /// The salt of `user`'s block keys, or `None` when nothing is cached.
    /// A user's salt is its (tenant-scoped, non-empty) id; the shared salt
    /// is empty, so no user's can equal it.
    pub(crate) fn salt<'a>(&self, user: &'a str) -> Option<&'a [u8]> {
        match self {
            PrefixCache::User if user.is_empty() => None,
            PrefixCache::User => Some(user.as_bytes()),
            PrefixCache::Shared => Some(&[]),
            PrefixCache::Off => None,
        }
    }
}

/// What a kv-mode request does with retrieved facts whose KV is on disk
/// only (not in the device or host tier).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ColdKv {
    /// Prefill them as text with the question (what prompt mode costs for
    /// them, never a wait for the disk) while reader threads read their KV
    /// into the cache for the next request.
    Prefill,
    /// Read them on the engine thread at the request's arrival (every
    /// retrieved fact injected; the engine waits for the disk).
    Read,
    /// Read them on the reader threads while the request waits, outside the
    /// scheduler, for at most [`WorkerConfig::cold_kv_wait`]; facts read by
    /// then are injected, the rest prefilled as with `Prefill`. The engine
    /// never waits, and a request waits at most that long beyond `Prefill`.
    Wait,
    /// Per request, by cost (`crate::cold`): wait for the reads that come
    /// soon enough to cost less than their prefill — from the measured time
    /// of a read, the reads queued before this request's and the measured
    /// time of a prefilled token, counted for the request and for each
    /// sequence sharing its steps, running, queued or waiting for reads (a
    /// wait delays one request, a prefill every sequence in its steps) —
    /// and prefill the rest; never longer
    /// than [`WorkerConfig::cold_kv_wait`]. Until a read and a prefill were
    /// measured it waits, as `Wait` does. The default: it serves as `Wait`
    /// does under load and after a restart — on the tiered-store Zipf
    /// stream (docs/performance.md, H100, 2026-12-07) `Wait` served
    /// 77.8–80.8 req/s against 70.6–74.6 for the earlier rule, which
    /// weighed a prefill for the request alone and prefilled until
    /// measured, and cut the restart burst's TTFT p99 by a third — and
    /// unlike `Wait` it prefills where reads
    /// cost more than the prefill they save (a slow disk on an idle
    /// server).
    #[default]
    Auto,
}

/// The default of [`WorkerConfig::cold_kv_wait`]. A fact of an 8B model
/// reads in ≈ 27 ms on a reader thread (fp8, NVMe), but a restart's burst
/// queues hundreds of reads: on the 400-user Zipf stream (H100,
/// docs/performance.md) `wait` served 77.8–80.3 req/s with 200 ms and
/// 80.8 with 400 ms, where 100 ms (another machine of the same kind)
/// served 71.8 beside prompt mode's 28.1; the burst's requests wait at
/// most this much longer than with `prefill`.
pub const COLD_KV_WAIT: Duration = Duration::from_millis(200);

/// The default of [`WorkerConfig::kv_readers`].
pub const KV_READERS: usize = 4;

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            max_running: 64,
            max_queue: 256,
            max_k: 200,
            ingest_batch: 4,
            ingest_tokens_per_unit: 2048,
            prompts: Prompts::default(),
            max_ingest_units: MAX_INGEST_UNITS,
            cold_kv: ColdKv::default(),
            cold_kv_wait: COLD_KV_WAIT,
            kv_readers: KV_READERS,
            kv_warm_restart: false,
            prefix_cache: PrefixCache::default(),
            audit_share: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_cache_salts_keep_users_apart() {
        assert_eq!(PrefixCache::User.salt("t1/alice"), Some(&b"t1/alice"[..]));
        // A request without a user has no tenant to scope it: not cached.
        assert_eq!(PrefixCache::User.salt(""), None);
        // Shared: one salt, which no user's can equal (user ids are not empty).
        assert_eq!(PrefixCache::Shared.salt("t1/alice"), PrefixCache::Shared.salt("t2/bob"));
        assert_eq!(PrefixCache::Shared.salt(""), Some(&[][..]));
        assert_eq!(PrefixCache::Off.salt("t1/alice"), None);
    }
}
