//! The worker protocol, one for every engine: what the gRPC service asks
//! of a worker ([`Command`]), what a generate request streams back
//! ([`Event`]), and the one dispatcher (`Protocol`) that carries the
//! commands out.
//!
//! Two engines serve it: our own (the engine thread,
//! `crate::engine_thread`) and vLLM (the connector's front). They differ
//! in how an answer is generated and in where the memory shard lives, and
//! nothing else; that difference is the [`MemoryHost`] trait. Everything
//! a caller can observe beyond it — the admission checks and their error
//! texts, every memory command (over the host's [`Shard`], a `Session`,
//! in `shard.rs`), ingests in bounded batches and their all-or-nothing
//! transaction, forget, stats, and the freeze/release states of shard
//! moves — is written once, here, so the two kinds of worker cannot drift
//! apart.

use std::collections::VecDeque;

use inferscale_memory::{Event as UnitEvent, IngestReport, MemoryUnit, Mode, UnitUpdate, UpdateReport};
pub use inferscale_types::FactSources;
use inferscale_types::{Limits, Refusal, StoredUnit};
use tokio::sync::oneshot;

use crate::error::{Result, WorkerError};
use crate::metrics::WorkerMetrics;

pub(crate) mod host;
pub(crate) mod job;
mod moves;
mod shard;

pub use host::{Change, Load, MemoryHost, Stats};
pub use job::{Event, Events, Finished, GenerateJob, Logprobs, Timings, TokenLogprob, Usage, finish_reason};
pub(crate) use moves::{Moves, ShardCommand};
pub use shard::{Embedded, Holdings, MAX_EMBED_INPUTS, MAX_SEARCH_TOP_K, SearchQuery, Shard};

/// What the service asks of a worker.
pub(crate) enum Command {
    Generate {
        job: Box<GenerateJob>,
        events: Events,
    },
    Ingest {
        user: String,
        window: Option<usize>,
        units: Vec<MemoryUnit>,
        /// Store facts only; KV is encoded when first needed.
        defer_kv: bool,
        reply: oneshot::Sender<Result<IngestReport>>,
    },
    List {
        user: String,
        reply: oneshot::Sender<Result<(Vec<StoredUnit>, usize)>>,
    },
    Forget {
        user: String,
        unit: Option<String>,
        reply: oneshot::Sender<Result<()>>,
    },
    Stats {
        /// Also measure the memory's bytes per tier (O(facts): asked for by
        /// a metrics scrape, not by the router's once-a-second poll).
        memory_bytes: bool,
        reply: oneshot::Sender<Stats>,
    },
    Embed {
        texts: Vec<String>,
        reply: oneshot::Sender<Result<Embedded>>,
    },
    Search {
        query: SearchQuery,
        reply: oneshot::Sender<Result<Vec<(StoredUnit, f32)>>>,
    },
    Update {
        user: String,
        id: String,
        change: UnitUpdate,
        /// A replica's copy: a new text's KV is encoded when first needed.
        defer_kv: bool,
        reply: oneshot::Sender<Result<UpdateReport>>,
    },
    History {
        user: String,
        id: String,
        reply: oneshot::Sender<Result<Vec<UnitEvent>>>,
    },
    Shard(ShardCommand),
}

/// The protocol's own limits.
#[derive(Debug, Clone, Copy)]
pub struct ProtocolConfig {
    /// Largest `k` a request may ask for.
    pub max_k: usize,
    /// Units per [`MemoryHost::ingest`] call: an ingest holds its engine
    /// (or, in vLLM mode, the shard's lock) for this many units at most.
    pub ingest_batch: usize,
    /// Most units one ingest request may carry: a request is answered
    /// when all of it is stored, so this bounds the work (and the wait)
    /// one request can queue.
    pub max_ingest_units: usize,
}

/// Default [`ProtocolConfig::max_ingest_units`]: a long conversation (a
/// LoCoMo one has about 600 turns) in one request.
pub const MAX_INGEST_UNITS: usize = 2_000;

/// An ingest admitted and not yet stored in full.
struct IngestJob {
    user: String,
    units: Vec<MemoryUnit>,
    defer_kv: bool,
    next: usize,
    report: IngestReport,
    reply: oneshot::Sender<Result<IngestReport>>,
}

/// The one dispatcher of [`Command`]s: checks, then the host.
pub(crate) struct Protocol {
    cfg: ProtocolConfig,
    moves: Moves,
    ingests: VecDeque<IngestJob>,
    metrics: std::sync::Arc<WorkerMetrics>,
}

/// A search's query (not blank) and `top_k` (1 to [`MAX_SEARCH_TOP_K`]).
fn check_search(q: &SearchQuery) -> Result<()> {
    if q.query.trim().is_empty() {
        return Err(Refusal::new("query", "is empty").into());
    }
    if q.top_k == 0 || q.top_k > MAX_SEARCH_TOP_K {
        return Err(Refusal::new("top_k", format!("{} is outside 1..={MAX_SEARCH_TOP_K}", q.top_k)).into());
    }
    if let Some(t) = q.threshold.filter(|t| !(-1.0..=1.0).contains(t)) {
        return Err(Refusal::new("threshold", format!("{t} is outside -1..=1 (a cosine similarity)")).into());
    }
    Ok(())
}

/// An embeddings request's texts: 1 to [`MAX_EMBED_INPUTS`], none empty.
fn check_embed(texts: &[String]) -> Result<()> {
    if texts.is_empty() {
        return Err(Refusal::new("input", "is empty").into());
    }
    if texts.len() > MAX_EMBED_INPUTS {
        return Err(Refusal::new(
            "input",
            format!("{} inputs in one request; the limit is {MAX_EMBED_INPUTS}", texts.len()),
        )
        .into());
    }
    match texts.iter().position(|t| t.trim().is_empty()) {
        Some(i) => Err(Refusal::new(format!("input[{i}]"), "is empty").into()),
        None => Ok(()),
    }
}

impl Protocol {
    pub(crate) fn new(cfg: ProtocolConfig, metrics: std::sync::Arc<WorkerMetrics>) -> Protocol {
        Protocol { cfg, moves: Moves::default(), ingests: VecDeque::new(), metrics }
    }

    /// Whether an ingest is waiting for [`Protocol::ingest_some`].
    pub(crate) fn ingesting(&self) -> bool {
        !self.ingests.is_empty()
    }

    pub(crate) fn handle(&mut self, host: &mut impl MemoryHost, c: Command) {
        match c {
            Command::Generate { job, events } => {
                let span = job.span.clone();
                if let Err(e) = self.admit(host, &job).and_then(|()| host.generate(*job, events.clone())) {
                    span.record("otel.status_code", "error");
                    self.metrics.failed();
                    let _ = events.send(Event::Failed(e));
                }
            }
            Command::Ingest { user, window, units, defer_kv, reply } => {
                let check = check_window(host, window)
                    .and_then(|()| self.check_size(units.len()))
                    .and_then(|()| Ok(inferscale_memory::validate(&user, &units)?))
                    .and_then(|()| self.moves.check_write(&user))
                    .and_then(|()| host.with_shard(|s| s.check_fits(&units)));
                match check {
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                    Ok(()) => self.ingests.push_back(IngestJob {
                        user,
                        units,
                        defer_kv,
                        next: 0,
                        report: IngestReport::default(),
                        reply,
                    }),
                }
            }
            Command::List { user, reply } => {
                let _ = reply.send(host.with_shard(|s| Ok((s.units(&user)?, s.window()))));
            }
            Command::Forget { user, unit, reply } => {
                let r =
                    self.moves.check_write(&user).and_then(|()| host.with_shard(|s| s.forget(&user, unit.as_deref())));
                if r.is_ok() {
                    host.memory_changed(&user, Change::Removed);
                }
                self.metrics.wrote(&r);
                if r.is_ok() && unit.is_none() {
                    // An ingest still queued would bring the user back after the delete.
                    let (gone, keep) = std::mem::take(&mut self.ingests).into_iter().partition(|j| j.user == user);
                    self.ingests = keep;
                    for j in gone {
                        let _ = j.reply.send(Err(WorkerError::Forgotten(user.clone())));
                    }
                    self.settle_freezes(host);
                }
                let _ = reply.send(r);
            }
            Command::Stats { memory_bytes, reply } => {
                let _ = reply.send(self.stats(host, memory_bytes));
            }
            Command::Embed { texts, reply } => {
                let _ = reply.send(check_embed(&texts).and_then(|()| host.with_shard(|s| s.embed(&texts))));
            }
            Command::Update { user, id, change, defer_kv, reply } => {
                let r = self
                    .moves
                    .check_write(&user)
                    .and_then(|()| host.with_shard(|s| s.update(&user, &id, &change, defer_kv)));
                if r.as_ref().is_ok_and(|r| r.changed) {
                    host.memory_changed(&user, Change::Written);
                }
                self.metrics.wrote(&r);
                let _ = reply.send(r);
            }
            Command::History { user, id, reply } => {
                let _ = reply.send(host.with_shard(|s| s.history(&user, &id)));
            }
            Command::Search { query, reply } => {
                let r = check_search(&query).and_then(|()| self.moves.check_read(&query.user));
                let _ = reply.send(r.and_then(|()| host.with_shard(|s| s.search(&query))));
            }
            Command::Shard(c) => self.shard(host, c),
        }
    }

    fn check_size(&self, units: usize) -> Result<()> {
        let max = self.cfg.max_ingest_units;
        match units <= max {
            true => Ok(()),
            false => Err(Refusal::new(
                "turns",
                format!("{units} units in one ingest request; the limit is {max}: send them in several requests"),
            )
            .into()),
        }
    }

    /// The checks every request passes before its engine sees it: the
    /// rules the router applied too ([`inferscale_types::admit`], the same
    /// code and words), then what only this worker knows.
    fn admit(&mut self, host: &mut impl MemoryHost, job: &GenerateJob) -> Result<()> {
        inferscale_types::admit(&job.request, &Limits { max_k: self.cfg.max_k as u32 })?;
        job.params.validate()?;
        let memory = &job.request.memory;
        check_window(host, memory.window.map(|w| w as usize))?;
        if memory.mode == Mode::None {
            return Ok(());
        }
        if memory.mode == Mode::Blend && !host.blends() {
            return Err(Refusal::new(
                "memory.mode",
                "blend needs the native engine (this worker serves with vLLM): use kv or prompt",
            )
            .into());
        }
        self.moves.check_read(job.user())?;
        Ok(())
    }

    /// Stores the next batch of the oldest ingest; answers it when done or
    /// failed. Returns whether an ingest is still waiting. A request is
    /// stored all or nothing: begun before its first batch, committed
    /// after its last, and on a failure what its earlier batches stored
    /// is removed before the error is answered.
    /// A request whose caller has left — the router's deadline passed, or
    /// its client hung up — is cancelled the same way: no one is told
    /// "failed" about work that then goes on and succeeds.
    ///
    /// A call stores at most `max_units` units (the configured batch at
    /// most); with `defer_kv` their KV is left to encode later (the engine
    /// is serving: see `throttle.rs`). Returns how many units it handled.
    pub(crate) fn ingest_some(&mut self, host: &mut impl MemoryHost, max_units: usize, defer_kv: bool) -> usize {
        while self.ingests.front().is_some_and(|j| j.reply.is_closed()) {
            if let Some(job) = self.ingests.pop_front()
                && job.next > 0
                && let Err(e) = end_ingest(host, &job.user, false)
            {
                tracing::warn!(user = job.user, error = %e, "removing a cancelled ingest failed: a restart removes it");
            }
        }
        let Some(job) = self.ingests.front_mut() else {
            self.settle_freezes(host);
            return 0;
        };
        let end = (job.next + self.cfg.ingest_batch.min(max_units).max(1)).min(job.units.len());
        let handled = end - job.next;
        let begun = match job.next {
            0 => host.with_shard(|s| s.begin_ingest(&job.user, &job.units)),
            _ => Ok(()),
        };
        let batch = &job.units[job.next..end];
        let stored = begun.and_then(|()| host.with_shard(|s| s.ingest(&job.user, batch, job.defer_kv || defer_kv)));
        if stored.as_ref().is_ok_and(|r| r.added > 0) {
            host.memory_changed(&job.user, Change::Written);
        }
        let done = match stored {
            Ok(r) => {
                job.report.added += r.added;
                job.report.skipped += r.skipped;
                job.report.encoded_tokens += r.encoded_tokens;
                job.next = end;
                if job.next < job.units.len() {
                    return handled;
                }
                end_ingest(host, &job.user, true).map(|()| job.report)
            }
            Err(e) => Err(e),
        };
        self.metrics.wrote(&done);
        if let Some(job) = self.ingests.pop_front() {
            let reply = match done {
                Ok(report) => Ok(report),
                Err(e) => {
                    // The caller hears why the request failed. An undo that
                    // failed too has hidden what the request stored and is
                    // retried until it succeeds (the memory's `settle`):
                    // the request stays all or nothing either way.
                    if let Err(undo) = end_ingest(host, &job.user, false) {
                        tracing::warn!(user = job.user, error = %undo, "undoing a failed ingest failed; retrying it");
                    }
                    Err(e)
                }
            };
            let _ = job.reply.send(reply);
        }
        self.settle_freezes(host);
        handled
    }

    fn stats(&self, host: &mut impl MemoryHost, memory_bytes: bool) -> Stats {
        let load = host.load();
        let (held, window) = host.with_shard(|s| Ok((s.holdings(memory_bytes), s.window()))).unwrap_or_default();
        let (finished, cancelled, failed) = self.metrics.outcomes();
        let footprint = held.footprint.unwrap_or_default();
        Stats {
            load,
            users: held.users,
            facts: held.facts,
            damaged_users: held.damaged_users,
            unsettled_users: held.unsettled_users,
            unread_users: held.unread_users,
            window,
            finished,
            cancelled,
            failed,
            kv_resident_bytes: footprint.kv_resident_bytes,
            kv_host_tier_bytes: footprint.kv_host_tier_bytes,
            disk_bytes: footprint.disk_bytes,
            kv_cache: footprint.cache,
        }
    }

    fn shard(&mut self, host: &mut impl MemoryHost, c: ShardCommand) {
        match c {
            ShardCommand::ListUsers { reply } => {
                let _ = reply.send(host.with_shard(|s| Ok(s.users())).unwrap_or_default());
            }
            ShardCommand::ExportBegin { user, reply } => {
                let _ = reply.send(host.with_shard(|s| s.export_begin(&user)));
            }
            ShardCommand::Export { user, ids, with_kv, max_bytes, reply } => {
                let _ = reply.send(host.with_shard(|s| s.export(&user, &ids, with_kv, max_bytes)));
            }
            ShardCommand::Freeze { user, reply } => {
                self.moves.freeze(&user);
                self.moves.freezing.push((user, reply));
                self.settle_freezes(host);
            }
            ShardCommand::ImportTarget { reply } => match host.with_shard(|s| s.import_target()) {
                Ok(target) => {
                    let _ = reply.send(target);
                }
                // Dropping the reply fails the import as shutting down.
                Err(e) => eprintln!("inferscale worker: no import target: {e}"),
            },
            ShardCommand::CommitImport { user, staged, reply } => {
                // Requests that retrieved from the old copy must not lay out from the new one.
                host.memory_changed(&user, Change::Moved);
                let r = host.with_shard(|s| s.commit_import(&user, staged));
                if r.is_ok() {
                    self.moves.imported(&user);
                }
                let _ = reply.send(r);
            }
            ShardCommand::Release { user, drop, reply } => {
                self.moves.release(&user, drop);
                let r = match drop {
                    true => {
                        host.memory_changed(&user, Change::Moved);
                        host.with_shard(|s| s.drop_user(&user))
                    }
                    false => Ok(()),
                };
                let _ = reply.send(r);
            }
        }
    }

    /// Answers freezes whose user has no ingest left in the queue: a
    /// freeze must see every unit its user was sent before it.
    fn settle_freezes(&mut self, host: &mut impl MemoryHost) {
        let pending = std::mem::take(&mut self.moves.freezing);
        for (user, reply) in pending {
            if self.ingests.iter().any(|j| j.user == user) {
                self.moves.freezing.push((user, reply));
            } else {
                let _ = reply.send(host.with_shard(|s| Ok(s.fact_ids(&user))).unwrap_or_default());
            }
        }
    }
}

/// Ends the ingest begun for `user` (see [`Shard::end_ingest`]); units
/// that went away are a change of the user's memory.
fn end_ingest(host: &mut impl MemoryHost, user: &str, commit: bool) -> Result<()> {
    let (removed, r) = host.with_shard(|s| Ok(s.end_ingest(user, commit)))?;
    if removed {
        // Requests that retrieved the removed units fail as for a forget
        // (also when the undo failed: the units are hidden all the same).
        host.memory_changed(user, Change::Removed);
    }
    r
}

/// A request that names a context window must name the shard's. The shard
/// is asked only then: the vLLM connector's is behind the lock its loads
/// take, which a generate request should not contend for.
fn check_window(host: &mut impl MemoryHost, window: Option<usize>) -> Result<()> {
    let Some(w) = window else { return Ok(()) };
    let ours = host.with_shard(|s| Ok(s.window()))?;
    match w == ours {
        true => Ok(()),
        false => Err(Refusal::new(
            "window",
            format!("{w}: this worker's memory is encoded with a context window of {ours} turns"),
        )
        .into()),
    }
}

#[cfg(test)]
mod tests;
