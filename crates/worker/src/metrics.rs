//! The worker's Prometheus metrics, served on its HTTP port ([`crate::http`]).
//!
//! Latencies are observed by the engine thread as they happen; gauges
//! (queue, batch, KV blocks, memory per tier) are read from the engine
//! thread's [`Stats`] at scrape time, so a scrape costs one round trip to
//! that thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use inferscale_memory::Mode;
use inferscale_telemetry::prom::worker::{
    KV_BLOCKS, KV_BLOCKS_FREE, MEMORY_UNITS, REQUESTS_RUNNING, REQUESTS_TOTAL, REQUESTS_WAITING, USERS,
};
use inferscale_telemetry::prom::{self, Histogram};

use crate::protocol::host::Stats;

/// Rows (sequences) per forward step: powers of two up to the largest
/// running batch.
const ROW_BUCKETS: [f64; 11] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// Tokens computed per forward step: decode rows alone up to a few hundred,
/// with prefill chunks up to the step's token budget (`--max-batch-tokens`).
const TOKEN_BUCKETS: [f64; 12] = [1.0, 8.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

/// Memory modes, in the order of the per-mode histograms.
const MODES: [Mode; 4] = Mode::ALL;

fn mode_index(mode: Mode) -> usize {
    MODES.iter().position(|&m| m == mode).unwrap_or(0)
}

#[derive(Debug)]
pub struct WorkerMetrics {
    /// Per mode: arrival at the worker to the first token, and the time per
    /// output token after it.
    ttft: [Histogram; 4],
    tpot: [Histogram; 4],
    /// Per mode: arrival at the worker to the last token.
    e2e: [Histogram; 4],
    /// Tokens of finished requests' prompts (as their usage counts them:
    /// injected memory included) and of their answers.
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    /// Injected tokens recomputed through every layer (blend).
    recomputed_tokens: AtomicU64,
    /// Memory tokens of injecting requests by how they reached the model:
    /// injected as stored KV, or pasted and prefilled (their KV was cold).
    injected_tokens: AtomicU64,
    pasted_tokens: AtomicU64,
    /// Prompt tokens of prompt- and none-mode requests past their header
    /// that were looked up in the prefix cache, and those found.
    prefix_queried_tokens: AtomicU64,
    prefix_hit_tokens: AtomicU64,
    /// Arrival to admission into the running batch (retrieval excluded).
    queue: Histogram,
    /// A request's reads of facts' KV from disk (read, check, decode,
    /// cache), for requests that read any.
    kv_load: Histogram,
    /// Sequences per forward step, the tokens it computed (prefill and
    /// decode: where a step's time goes when admissions prefill beside the
    /// decoding rows), and the step's duration.
    batch_rows: Histogram,
    batch_tokens: Histogram,
    step: Histogram,
    /// Requests that left the worker, by how: every engine counts here.
    finished: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    pub shards_sent: AtomicU64,
    pub shard_bytes_sent: AtomicU64,
    pub shards_received: AtomicU64,
    pub shard_bytes_received: AtomicU64,
    /// Set when a write failed for a full disk, cleared when one succeeds.
    disk_full: AtomicBool,
    /// The answer-quality audit (`--audit-share`), per injecting mode:
    /// first-token KL(prompt ‖ served), and audits whose greedy first
    /// tokens agreed; audits skipped (queue full, facts forgotten, no KV
    /// blocks free).
    audit_kl: [Histogram; 4],
    audit_agreed: [AtomicU64; 4],
    audit_skipped: AtomicU64,
    /// Audits queued or running.
    audit_waiting: AtomicU64,
}

/// The audit's counts so far (see [`WorkerMetrics::audits`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuditCounts {
    /// Requests audited (every injecting mode).
    pub audited: u64,
    /// Requests sampled for the audit and not audited.
    pub skipped: u64,
    /// Audits queued or running: none once every sampled request's audit
    /// has its outcome counted.
    pub waiting: u64,
}

/// First-token KL buckets: from bf16 noise (1e-4) to answers apart (4).
const KL_BUCKETS: [f64; 10] = [1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 4.0];

impl Default for WorkerMetrics {
    fn default() -> Self {
        WorkerMetrics {
            ttft: Default::default(),
            tpot: Default::default(),
            e2e: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            recomputed_tokens: AtomicU64::new(0),
            injected_tokens: AtomicU64::new(0),
            pasted_tokens: AtomicU64::new(0),
            prefix_queried_tokens: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
            queue: Histogram::default(),
            kv_load: Histogram::default(),
            batch_rows: Histogram::new(&ROW_BUCKETS),
            batch_tokens: Histogram::new(&TOKEN_BUCKETS),
            step: Histogram::default(),
            finished: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            shards_sent: AtomicU64::new(0),
            shard_bytes_sent: AtomicU64::new(0),
            shards_received: AtomicU64::new(0),
            shard_bytes_received: AtomicU64::new(0),
            disk_full: AtomicBool::new(false),
            audit_kl: std::array::from_fn(|_| Histogram::new(&KL_BUCKETS)),
            audit_agreed: Default::default(),
            audit_skipped: AtomicU64::new(0),
            audit_waiting: AtomicU64::new(0),
        }
    }
}

impl WorkerMetrics {
    /// A request's first token, `seconds` after its arrival.
    pub fn first_token(&self, mode: Mode, seconds: f64) {
        self.ttft[mode_index(mode)].observe(seconds);
    }

    /// A finished request's decode: `tokens` after the first in `seconds`.
    pub fn decoded(&self, mode: Mode, tokens: usize, seconds: f64) {
        if tokens > 0 {
            self.tpot[mode_index(mode)].observe(seconds / tokens as f64);
        }
    }

    /// A finished request: `prompt` tokens prefilled, `generated` tokens
    /// answered, `seconds` from its arrival to its last token.
    pub fn completed(&self, mode: Mode, prompt: usize, generated: usize, seconds: f64) {
        self.e2e[mode_index(mode)].observe(seconds);
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.generation_tokens.fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// Injected tokens a blend request recomputed through every layer.
    pub fn recomputed(&self, tokens: usize) {
        self.recomputed_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// A request answered in full.
    pub fn finished(&self) {
        self.finished.fetch_add(1, Ordering::Relaxed);
    }

    /// A request whose caller went away.
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// A request refused or failed.
    pub fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests finished, cancelled and failed so far.
    /// A write to the memory's disk ended: `Err(DiskFull)` sets the
    /// disk-full gauge, a success clears it, other errors say nothing.
    pub(crate) fn wrote<T>(&self, r: &crate::error::Result<T>) {
        match r {
            Ok(_) => self.disk_full.store(false, Ordering::Relaxed),
            Err(crate::error::WorkerError::DiskFull) => self.disk_full.store(true, Ordering::Relaxed),
            Err(_) => {}
        }
    }

    /// Whether the last write that settled it found the disk full.
    pub fn disk_full(&self) -> bool {
        self.disk_full.load(Ordering::Relaxed)
    }

    pub(crate) fn outcomes(&self) -> (u64, u64, u64) {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (n(&self.finished), n(&self.cancelled), n(&self.failed))
    }

    /// An audited `mode` request: its first-token KL from prompt mode, and
    /// whether the greedy first tokens agreed.
    pub(crate) fn audited(&self, mode: Mode, kl: f64, agreed: bool) {
        self.audit_kl[mode_index(mode)].observe(kl);
        if agreed {
            self.audit_agreed[mode_index(mode)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request sampled for the audit that was not audited.
    pub(crate) fn audit_skipped(&self) {
        self.audit_skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` audits are queued or running.
    pub(crate) fn audits_waiting(&self, n: usize) {
        // Release: the outcomes counted before it are seen by whoever
        // reads this value (`audits`).
        self.audit_waiting.store(n as u64, Ordering::Release);
    }

    /// The audit's counts so far: what a benchmark reads around a point to
    /// say how many of its requests were audited.
    pub fn audits(&self) -> AuditCounts {
        let waiting = self.audit_waiting.load(Ordering::Acquire);
        AuditCounts {
            audited: self.audit_kl.iter().map(Histogram::count).sum(),
            skipped: self.audit_skipped.load(Ordering::Relaxed),
            waiting,
        }
    }

    /// A read of facts' KV from disk took `seconds`.
    pub(crate) fn kv_loaded(&self, seconds: f64) {
        self.kv_load.observe(seconds);
    }

    /// An injecting request's memory tokens: `injected` as stored KV,
    /// `pasted` as text (cold KV).
    pub(crate) fn memory_tokens(&self, injected: usize, pasted: usize) {
        self.injected_tokens.fetch_add(injected as u64, Ordering::Relaxed);
        self.pasted_tokens.fetch_add(pasted as u64, Ordering::Relaxed);
    }

    /// A request looked up `queried` prompt tokens in the prefix cache and
    /// found the KV of `hit` of them.
    pub(crate) fn prefix_cache(&self, queried: usize, hit: usize) {
        self.prefix_queried_tokens.fetch_add(queried as u64, Ordering::Relaxed);
        self.prefix_hit_tokens.fetch_add(hit as u64, Ordering::Relaxed);
    }

    pub(crate) fn admitted(&self, waited_seconds: f64) {
        self.queue.observe(waited_seconds);
    }

    pub(crate) fn stepped(&self, rows: usize, tokens: usize, seconds: f64) {
        self.batch_rows.observe(rows as f64);
        self.batch_tokens.observe(tokens as f64);
        self.step.observe(seconds);
    }

    /// The exposition text: these histograms and counters with `stats`,
    /// resident memory labelled as the `resident_tier` it lives in.
    pub fn render(&self, stats: &Stats, resident_tier: &str) -> String {
        let mut out = String::new();
        for (name, help, h) in [
            ("inferscale_worker_ttft_seconds", "Arrival at the worker to the first token, by memory mode.", &self.ttft),
            ("inferscale_worker_tpot_seconds", "Time per output token after the first, by memory mode.", &self.tpot),
            (
                "inferscale_worker_e2e_request_latency_seconds",
                "Arrival at the worker to the last token of finished requests, by memory mode.",
                &self.e2e,
            ),
        ] {
            prom::header(&mut out, name, "histogram", help);
            for (mode, h) in MODES.iter().zip(h) {
                h.render(&mut out, name, &format!("mode=\"{}\"", mode.as_str()));
            }
        }
        for (name, help, h) in [
            ("inferscale_worker_queue_seconds", "Wait for admission into the running batch.", &self.queue),
            (
                "inferscale_worker_kv_load_seconds",
                "Reads of facts' KV from disk into the cache: a request's, read at its arrival, or one fact's, read in the background.",
                &self.kv_load,
            ),
            ("inferscale_worker_batch_rows", "Sequences per forward step.", &self.batch_rows),
            (
                "inferscale_worker_batch_tokens",
                "Tokens computed per forward step (prefill and decode).",
                &self.batch_tokens,
            ),
            ("inferscale_worker_step_seconds", "Duration of a forward step.", &self.step),
        ] {
            prom::header(&mut out, name, "histogram", help);
            h.render(&mut out, name, "");
        }
        let n = |v: usize| v as f64;
        let load = &stats.load;
        let used = load.kv_blocks_total.saturating_sub(load.kv_blocks_free);
        for (name, help, v) in [
            (REQUESTS_WAITING, "Requests waiting for admission into the running batch.", n(load.waiting)),
            (REQUESTS_RUNNING, "Requests in the running batch.", n(load.running)),
            (KV_BLOCKS, "KV cache blocks (capacity).", n(load.kv_blocks_total)),
            (KV_BLOCKS_FREE, "Free KV cache blocks.", n(load.kv_blocks_free)),
            ("inferscale_worker_kv_blocks_used", "KV cache blocks in use.", n(used)),
            (
                "inferscale_worker_kv_cache_usage_ratio",
                "Share of the KV cache's blocks in use (0 to 1).",
                if load.kv_blocks_total == 0 { 0.0 } else { n(used) / n(load.kv_blocks_total) },
            ),
            (USERS, "Users with memory here.", n(stats.users)),
            (MEMORY_UNITS, "Memory units stored here.", n(stats.facts)),
            (
                "inferscale_worker_damaged_users",
                "Users refused because their stored memory is damaged (repair them: inferscale memory repair).",
                n(stats.damaged_users),
            ),
            (
                "inferscale_worker_unread_users",
                "Users not read from disk since the worker started (read on first use, the rest in idle time); \
                 the memory-unit count and disk bytes cover the others.",
                n(stats.unread_users),
            ),
            (
                "inferscale_worker_unsettled_users",
                "Users whose failed ingest is still being undone (their writes wait).",
                n(stats.unsettled_users),
            ),
            (
                "inferscale_worker_disk_full",
                "1 while the memory's disk is full (writes answer 507), else 0.",
                if self.disk_full.load(Ordering::Relaxed) { 1.0 } else { 0.0 },
            ),
        ] {
            prom::single(&mut out, name, help, v);
        }
        let name = "inferscale_worker_memory_bytes";
        prom::header(
            &mut out,
            name,
            "gauge",
            "Memory-store bytes by tier (resident KV; KV in the host tier; logs on disk).",
        );
        out.push_str(&format!("{name}{{tier=\"{}\"}} {}\n", prom::label(resident_tier), stats.kv_resident_bytes));
        out.push_str(&format!("{name}{{tier=\"pinned_host\"}} {}\n", stats.kv_host_tier_bytes));
        out.push_str(&format!("{name}{{tier=\"disk\"}} {}\n", stats.disk_bytes));
        let c = &stats.kv_cache;
        let tiers = [prom::label(resident_tier), "pinned_host".to_string()];
        for (name, help, v) in [
            ("inferscale_worker_kv_cache_hits_total", "Facts a request found in the KV cache, by tier.", c.hits),
            ("inferscale_worker_kv_cache_evictions_total", "Facts evicted from a KV cache tier.", c.evictions),
        ] {
            prom::header(&mut out, name, "counter", help);
            for (tier, v) in tiers.iter().zip(v) {
                out.push_str(&format!("{name}{{tier=\"{tier}\"}} {v}\n"));
            }
        }
        for (name, help, v) in [
            ("inferscale_worker_kv_cache_misses_total", "Facts a request read from disk.", c.misses),
            (
                "inferscale_worker_kv_cache_promotions_total",
                "Host-tier facts read again onto the device (--kv-promote-after).",
                c.promoted,
            ),
            (
                "inferscale_worker_kv_cache_demotions_total",
                "Device facts a promotion evicted, read again into the host tier.",
                c.demoted,
            ),
            (
                "inferscale_worker_kv_cache_warmed_total",
                "Facts the KV tiers held at the last stop, read back after this start (--kv-warm-restart).",
                c.warmed,
            ),
            ("inferscale_worker_kv_cache_loaded_bytes_total", "KV record bytes read from disk.", c.loaded_bytes),
            (
                "inferscale_worker_kv_cache_over_budget_total",
                "Facts cached past a tier's budget because pinned facts filled it.",
                c.over_budget,
            ),
            (
                "inferscale_worker_kv_corrupt_records_total",
                "Stored KV records that failed their check when read (re-encoded).",
                c.corrupt,
            ),
        ] {
            prom::header(&mut out, name, "counter", help);
            out.push_str(&format!("{name} {v}\n"));
        }
        let name = "inferscale_worker_audit_kl_nats";
        prom::header(
            &mut out,
            name,
            "histogram",
            "Audited requests (--audit-share): KL(prompt mode || served) of the first-token distributions, by memory mode.",
        );
        for (mode, h) in MODES.iter().zip(&self.audit_kl).filter(|(m, _)| m.injects()) {
            h.render(&mut out, name, &format!("mode=\"{}\"", mode.as_str()));
        }
        let name = "inferscale_worker_audit_top1_agreed_total";
        prom::header(
            &mut out,
            name,
            "counter",
            "Audited requests whose greedy first token is prompt mode's, by memory mode.",
        );
        for (mode, v) in MODES.iter().zip(&self.audit_agreed).filter(|(m, _)| m.injects()) {
            out.push_str(&format!("{name}{{mode=\"{}\"}} {}\n", mode.as_str(), v.load(Ordering::Relaxed)));
        }
        let name = "inferscale_worker_audits_skipped_total";
        let help = "Requests sampled for the audit and not audited (queue full, facts forgotten, no KV blocks free).";
        prom::header(&mut out, name, "counter", help);
        out.push_str(&format!("{name} {}\n", self.audit_skipped.load(Ordering::Relaxed)));
        let name = "inferscale_worker_audits_waiting";
        prom::header(&mut out, name, "gauge", "Audits queued or running (they run in the engine's spare time).");
        out.push_str(&format!("{name} {}\n", self.audit_waiting.load(Ordering::Relaxed)));
        let name = REQUESTS_TOTAL;
        prom::header(&mut out, name, "counter", "Requests that left the worker, by how.");
        for (status, v) in [("finished", stats.finished), ("cancelled", stats.cancelled), ("failed", stats.failed)] {
            out.push_str(&format!("{name}{{status=\"{status}\"}} {v}\n"));
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        for (name, help, v) in [
            (
                "inferscale_worker_prompt_tokens_total",
                "Prompt tokens of finished requests, as their usage counts them (injected memory included).",
                &self.prompt_tokens,
            ),
            (
                "inferscale_worker_generation_tokens_total",
                "Tokens generated by finished requests.",
                &self.generation_tokens,
            ),
            ("inferscale_worker_shards_sent_total", "Shards this worker sent in migrations.", &self.shards_sent),
            ("inferscale_worker_shard_bytes_sent_total", "Bytes of shards sent.", &self.shard_bytes_sent),
            ("inferscale_worker_shards_received_total", "Shards received and committed.", &self.shards_received),
            ("inferscale_worker_shard_bytes_received_total", "Bytes of shards received.", &self.shard_bytes_received),
            (
                "inferscale_worker_prefix_cache_queries_tokens_total",
                "Prompt tokens (past the header) of prompt- and none-mode requests looked up in the prefix cache.",
                &self.prefix_queried_tokens,
            ),
            (
                "inferscale_worker_prefix_cache_hits_tokens_total",
                "Of those, tokens whose KV the prefix cache held (not computed).",
                &self.prefix_hit_tokens,
            ),
            (
                "inferscale_worker_recomputed_tokens_total",
                "Injected memory tokens recomputed through every layer (memory mode blend).",
                &self.recomputed_tokens,
            ),
        ] {
            prom::single(&mut out, name, help, load(v));
        }
        let name = "inferscale_worker_memory_tokens_total";
        prom::header(
            &mut out,
            name,
            "counter",
            "Memory tokens of kv and blend requests: injected as stored KV, or pasted and prefilled because their KV was on disk only.",
        );
        out.push_str(&format!("{name}{{path=\"injected\"}} {}\n", load(&self.injected_tokens)));
        out.push_str(&format!("{name}{{path=\"prefilled\"}} {}\n", load(&self.pasted_tokens)));
        prom::build_info(&mut out, "worker", env!("CARGO_PKG_VERSION"));
        prom::process(&mut out);
        out
    }
}
