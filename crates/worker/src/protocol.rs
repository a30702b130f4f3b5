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
//! texts, ingests in bounded batches and their partial-failure report,
//! forget, stats, and the freeze/release states of shard moves — is
//! written once, here, so the two kinds of worker cannot drift apart.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use inferscale_engine::sampling::SamplingParams;
use inferscale_engine::{Backend, FinishReason};
use inferscale_memory::{
    CacheStats, Chat, Event as UnitEvent, Footprint, Hit, ImportReport, IngestReport, KvHeader, Memory, MemoryUnit,
    Mode, Scope, ShardRecord, StagedShard, UnitUpdate, UpdateReport,
};
use tokio::sync::{mpsc, oneshot};
use tracing::Span;

use crate::error::{Result, WorkerError};
use crate::metrics::WorkerMetrics;

mod moves;

pub(crate) use moves::{Moves, ShardCommand};

/// A chat request as a worker's engine sees it.
#[derive(Debug, Clone)]
pub struct GenerateJob {
    pub user: String,
    /// System prompt, earlier turns and the question.
    pub chat: Chat,
    /// Which of the user's units may be retrieved (an agent's, a run's).
    pub scope: Scope,
    pub mode: Mode,
    pub k: usize,
    /// The context window the caller expects its memory encoded with.
    pub window: Option<usize>,
    /// [`Mode::Blend`]: the share of injected tokens recomputed.
    pub blend_ratio: f32,
    pub params: SamplingParams,
    pub deadline: Option<Duration>,
    pub arrived: Instant,
    /// The request's trace span; its phases are children of it.
    pub span: Span,
}

/// Where a request's time went, in milliseconds: each phase's duration,
/// and the first token and the end measured from arrival at the worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    pub queue_ms: f64,
    pub retrieve_ms: f64,
    /// Composing the request and queuing its injection on the host; the
    /// device's part overlaps the prefill and is counted in `prefill_ms`.
    pub inject_ms: f64,
    pub prefill_ms: f64,
    pub first_token_ms: f64,
    pub total_ms: f64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub injected_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub facts: usize,
    /// Of the injected tokens, those recomputed through every layer (blend).
    pub recomputed_tokens: usize,
    /// kv and blend: where the facts' KV came from (`None` where the
    /// engine does not say, and in prompt and none mode).
    pub sources: Option<FactSources>,
}

/// Where the KV of a request's retrieved facts came from, in facts: the
/// tiered store's view of one request (docs/serving.md, "Where stored KV
/// lives").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FactSources {
    pub device: usize,
    pub host: usize,
    /// Read from disk while the request waited.
    pub disk: usize,
    /// On disk only, so pasted and prefilled with the question.
    pub prefilled: usize,
}

#[derive(Debug, Clone)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
    pub fact_ids: Vec<String>,
}

/// What a generate request's stream carries.
#[derive(Debug)]
pub enum Event {
    Token { id: u32, text: String },
    Finished(Box<Finished>),
    Failed(WorkerError),
}

/// Where a generate request's events go; closed when its caller left.
pub type Events = mpsc::UnboundedSender<Event>;

/// A finish reason as OpenAI's API names it (end of sequence is `stop`).
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Counters and gauges of a worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub load: Load,
    pub users: usize,
    pub facts: usize,
    pub damaged_users: usize,
    pub unsettled_users: usize,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub window: usize,
    /// Pre-RoPE KV of the memory held in the backend's memory, and the
    /// memory's logs on disk (0 unless asked for).
    pub kv_resident_bytes: u64,
    /// Pre-RoPE KV cached in the backend's host tier.
    pub kv_host_tier_bytes: u64,
    pub disk_bytes: u64,
    /// The memory's KV cache counters (0 unless asked for).
    pub kv_cache: CacheStats,
}

/// What an engine reports of its running batch, for [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Requests beyond which new ones are refused as queue-full.
    pub max_queue: usize,
}

/// What a memory shard holds, for [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holdings {
    pub users: usize,
    pub facts: usize,
    /// Users refused because their stored memory is damaged, and users
    /// whose failed ingest is still being undone.
    pub damaged_users: usize,
    pub unsettled_users: usize,
    /// Bytes per tier, when asked for (O(facts) to measure).
    pub footprint: Option<Footprint>,
}

/// The units of search `hits` over `user`'s facts in `memory`, with their
/// scores (what both hosts answer a search with).
pub fn search_results<B: Backend>(memory: &Memory<B>, user: &str, hits: &[Hit]) -> Vec<(MemoryUnit, f32)> {
    let facts = memory.facts(user).unwrap_or_default();
    hits.iter().filter_map(|h| facts.get(h.index).map(|f| (f.unit.clone(), h.score))).collect()
}

/// What `memory` holds (with its bytes per tier when `footprint`).
pub fn holdings<B: Backend>(memory: &Memory<B>, footprint: bool) -> Holdings {
    Holdings {
        users: memory.users().count(),
        facts: memory.fact_count(),
        damaged_users: memory.damaged().count(),
        unsettled_users: memory.unsettled_count(),
        footprint: footprint.then(|| memory.footprint()),
    }
}

/// What the service asks of a worker.
pub(crate) enum Command {
    Generate {
        job: GenerateJob,
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
        reply: oneshot::Sender<Result<(Vec<MemoryUnit>, usize)>>,
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
        reply: oneshot::Sender<Result<Vec<(MemoryUnit, f32)>>>,
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

/// Sentence embeddings of a request's texts, in order, and the tokens the
/// encoder read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub tokens: usize,
}

/// A memory search (`/v1/memories/search`): `user`'s units for `query`.
#[derive(Debug, Clone, Default)]
pub struct SearchQuery {
    pub user: String,
    pub query: String,
    pub top_k: usize,
    /// Results score at least this (cosine similarity).
    pub threshold: Option<f32>,
    /// Metadata filters (`inferscale_memory::filter_matches`).
    pub filters: serde_json::Map<String, serde_json::Value>,
    /// Only units of this agent / run.
    pub scope: Scope,
}

/// Most results one search may ask for.
pub const MAX_SEARCH_TOP_K: usize = 1000;

/// Most texts one embeddings request may carry (OpenAI's limit).
pub const MAX_EMBED_INPUTS: usize = 2048;

/// An engine with a memory shard: what differs between the kinds of
/// worker. Called from the one thread that runs the `Protocol`; every
/// input has passed the protocol's checks.
pub trait MemoryHost {
    /// The context window (in turns) the shard's KV is encoded with.
    fn window(&self) -> usize;

    /// Whether the engine can serve [`Mode::Blend`] (recompute part of the
    /// injected KV inside its own forward pass).
    fn blends(&self) -> bool {
        true
    }

    /// Sentence embeddings of `texts` (each non-empty) by the retrieval
    /// encoder.
    fn embed(&mut self, texts: &[String]) -> Result<Embedded>;

    /// A user's units for a search, each with its score, best first
    /// (`inferscale_memory::Session::search`).
    fn search(&mut self, q: &SearchQuery) -> Result<Vec<(MemoryUnit, f32)>>;

    /// Changes one unit of `user` (`inferscale_memory::Memory::update`);
    /// requests that retrieved it and are laid out later use the new one.
    fn update(&mut self, user: &str, id: &str, change: &UnitUpdate, defer_kv: bool) -> Result<UpdateReport>;

    /// One unit's history, oldest first.
    fn history(&self, user: &str, id: &str) -> Result<Vec<UnitEvent>>;

    /// Starts answering an admitted request: its events (tokens, then
    /// finished or failed) go to `events`, now or later. An error refuses
    /// it (the protocol reports it and counts the failure).
    fn generate(&mut self, job: GenerateJob, events: Events) -> Result<()>;

    /// Checks that every one of `units` can be encoded and stored (length
    /// against the model's context and a log record), storing nothing: a
    /// request is refused whole before any of it is stored.
    fn check_fits(&self, units: &[MemoryUnit]) -> Result<()>;

    /// Stores a few of `user`'s validated units and, unless `defer_kv`,
    /// encodes their KV (the protocol splits large ingests into batches).
    fn ingest(&mut self, user: &str, units: &[MemoryUnit], defer_kv: bool) -> Result<IngestReport>;

    /// Starts an all-or-nothing ingest of one request's `units` for
    /// `user`, before its first batch ([`inferscale_memory::Memory::begin_ingest`]):
    /// a crash before [`MemoryHost::end_ingest`] commits it removes, at
    /// the next start, what its batches stored.
    fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()>;

    /// Ends the ingest begun for `user`: `commit` keeps what its batches
    /// stored; otherwise it is removed (with the KV derived from it).
    fn end_ingest(&mut self, user: &str, commit: bool) -> Result<()>;

    /// `user`'s stored units, in order.
    fn units(&self, user: &str) -> Result<Vec<MemoryUnit>>;

    /// Forgets one unit of `user`, or all of them; requests that retrieved
    /// from the memory but have not used it yet fail as forgotten.
    fn forget(&mut self, user: &str, unit: Option<&str>) -> Result<()>;

    fn load(&self) -> Load;

    fn holdings(&self, footprint: bool) -> Holdings;

    /// Every user held here, with the digest of its units (the leader
    /// replaces a replica whose digest differs from the home's).
    fn users(&self) -> Vec<(String, u64)>;

    /// `user`'s fact ids in order (empty for an unknown user).
    fn fact_ids(&self, user: &str) -> Vec<String>;

    /// The shard's KV header and `user`'s fact ids: the start of an export.
    fn export_begin(&self, user: &str) -> Result<(KvHeader, Vec<String>)>;

    /// Transfer records for a prefix of `ids` (about `max_bytes`), and how
    /// many ids they cover.
    fn export(&self, user: &str, ids: &[String], with_kv: bool, max_bytes: usize) -> Result<(Vec<ShardRecord>, usize)>;

    /// Where imports are staged, and the KV header a shard must match.
    fn import_target(&self) -> Result<(PathBuf, KvHeader)>;

    /// Commits a staged shard in place of `user`'s copy; requests that
    /// retrieved from the old copy and have not used it fail as moving.
    fn commit_import(&mut self, user: &str, staged: StagedShard) -> Result<ImportReport>;

    /// Removes `user`, who has moved away (its unstarted requests fail as
    /// moving); nothing to do for a user this shard does not have.
    fn drop_user(&mut self, user: &str) -> Result<()>;
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
        return Err(WorkerError::Invalid("`query` is empty".into()));
    }
    if q.top_k == 0 || q.top_k > MAX_SEARCH_TOP_K {
        return Err(WorkerError::Invalid(format!("top_k = {} is outside 1..={MAX_SEARCH_TOP_K}", q.top_k)));
    }
    if let Some(t) = q.threshold.filter(|t| !(-1.0..=1.0).contains(t)) {
        return Err(WorkerError::Invalid(format!("threshold = {t} is outside -1..=1 (a cosine similarity)")));
    }
    Ok(())
}

/// An embeddings request's texts: 1 to [`MAX_EMBED_INPUTS`], none empty.
fn check_embed(texts: &[String]) -> Result<()> {
    if texts.is_empty() {
        return Err(WorkerError::Invalid("`input` is empty".into()));
    }
    if texts.len() > MAX_EMBED_INPUTS {
        return Err(WorkerError::Invalid(format!(
            "{} inputs in one request; the limit is {MAX_EMBED_INPUTS}",
            texts.len()
        )));
    }
    match texts.iter().position(|t| t.trim().is_empty()) {
        Some(i) => Err(WorkerError::Invalid(format!("input[{i}] is empty"))),
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
                if let Err(e) = self.admit(host, &job).and_then(|()| host.generate(job, events.clone())) {
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
                    .and_then(|()| host.check_fits(&units));
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
                let _ = reply.send(host.units(&user).map(|units| (units, host.window())));
            }
            Command::Forget { user, unit, reply } => {
                let r = self.moves.check_write(&user).and_then(|()| host.forget(&user, unit.as_deref()));
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
                let _ = reply.send(check_embed(&texts).and_then(|()| host.embed(&texts)));
            }
            Command::Update { user, id, change, defer_kv, reply } => {
                let r = self.moves.check_write(&user).and_then(|()| host.update(&user, &id, &change, defer_kv));
                self.metrics.wrote(&r);
                let _ = reply.send(r);
            }
            Command::History { user, id, reply } => {
                let _ = reply.send(host.history(&user, &id));
            }
            Command::Search { query, reply } => {
                let r = check_search(&query).and_then(|()| self.moves.check_read(&query.user));
                let _ = reply.send(r.and_then(|()| host.search(&query)));
            }
            Command::Shard(c) => self.shard(host, c),
        }
    }

    fn check_size(&self, units: usize) -> Result<()> {
        let max = self.cfg.max_ingest_units;
        match units <= max {
            true => Ok(()),
            false => Err(WorkerError::Invalid(format!(
                "{units} units in one ingest request; the limit is {max}: send them in several requests"
            ))),
        }
    }

    /// The checks every request passes before its engine sees it.
    fn admit(&mut self, host: &impl MemoryHost, job: &GenerateJob) -> Result<()> {
        check_window(host, job.window)?;
        job.params.validate()?;
        if job.params.max_tokens == 0 {
            return Err(WorkerError::Invalid("max_tokens must be at least 1".into()));
        }
        if job.chat.question.trim().is_empty() {
            return Err(WorkerError::Invalid("the question (last user message) is empty".into()));
        }
        if job.mode == Mode::None {
            return Ok(());
        }
        if job.mode == Mode::Blend {
            inferscale_memory::check_blend_ratio(job.blend_ratio).map_err(WorkerError::Invalid)?;
            if !host.blends() {
                return Err(WorkerError::Invalid(
                    "memory mode blend needs the native engine (this worker serves with vLLM): use kv or prompt".into(),
                ));
            }
        }
        if job.user.is_empty() {
            return Err(WorkerError::Invalid("a user is required when memory is used".into()));
        }
        self.moves.check_read(&job.user)?;
        if job.k == 0 || job.k > self.cfg.max_k {
            return Err(WorkerError::Invalid(format!("k = {} is outside 1..={}", job.k, self.cfg.max_k)));
        }
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
                && let Err(e) = host.end_ingest(&job.user, false)
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
            0 => host.begin_ingest(&job.user, &job.units),
            _ => Ok(()),
        };
        let stored = begun.and_then(|()| host.ingest(&job.user, &job.units[job.next..end], job.defer_kv || defer_kv));
        let done = match stored {
            Ok(r) => {
                job.report.added += r.added;
                job.report.skipped += r.skipped;
                job.report.encoded_tokens += r.encoded_tokens;
                job.next = end;
                if job.next < job.units.len() {
                    return handled;
                }
                host.end_ingest(&job.user, true).map(|()| job.report)
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
                    if let Err(undo) = host.end_ingest(&job.user, false) {
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

    fn stats(&self, host: &impl MemoryHost, memory_bytes: bool) -> Stats {
        let load = host.load();
        let held = host.holdings(memory_bytes);
        let (finished, cancelled, failed) = self.metrics.outcomes();
        let footprint = held.footprint.unwrap_or_default();
        Stats {
            load,
            users: held.users,
            facts: held.facts,
            damaged_users: held.damaged_users,
            unsettled_users: held.unsettled_users,
            window: host.window(),
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
                let _ = reply.send(host.users());
            }
            ShardCommand::ExportBegin { user, reply } => {
                let _ = reply.send(host.export_begin(&user));
            }
            ShardCommand::Export { user, ids, with_kv, max_bytes, reply } => {
                let _ = reply.send(host.export(&user, &ids, with_kv, max_bytes));
            }
            ShardCommand::Freeze { user, reply } => {
                self.moves.freeze(&user);
                self.moves.freezing.push((user, reply));
                self.settle_freezes(host);
            }
            ShardCommand::ImportTarget { reply } => match host.import_target() {
                Ok(target) => {
                    let _ = reply.send(target);
                }
                // Dropping the reply fails the import as shutting down.
                Err(e) => eprintln!("inferscale worker: no import target: {e}"),
            },
            ShardCommand::CommitImport { user, staged, reply } => {
                let r = host.commit_import(&user, staged);
                if r.is_ok() {
                    self.moves.imported(&user);
                }
                let _ = reply.send(r);
            }
            ShardCommand::Release { user, drop, reply } => {
                self.moves.release(&user, drop);
                let r = if drop { host.drop_user(&user) } else { Ok(()) };
                let _ = reply.send(r);
            }
        }
    }

    /// Answers freezes whose user has no ingest left in the queue: a
    /// freeze must see every unit its user was sent before it.
    fn settle_freezes(&mut self, host: &impl MemoryHost) {
        let pending = std::mem::take(&mut self.moves.freezing);
        for (user, reply) in pending {
            if self.ingests.iter().any(|j| j.user == user) {
                self.moves.freezing.push((user, reply));
            } else {
                let _ = reply.send(host.fact_ids(&user));
            }
        }
    }
}

fn check_window(host: &impl MemoryHost, window: Option<usize>) -> Result<()> {
    let ours = host.window();
    match window {
        Some(w) if w != ours => Err(WorkerError::Invalid(format!(
            "window {w}: this worker's memory is encoded with a context window of {ours} turns"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    //! The dispatcher's own decisions, against a host that keeps units in
    //! a map: both real hosts run behind it in the CLI's and the vLLM
    //! front's end-to-end tests; here each ordering rule is pinned alone.

    use std::collections::HashMap;
    use std::sync::Arc;

    use inferscale_memory::MemoryError;

    use super::*;

    #[derive(Default)]
    struct MapHost {
        units: HashMap<String, Vec<MemoryUnit>>,
        generated: Vec<String>,
        dropped: Vec<String>,
        /// An engine that cannot blend (vLLM's).
        no_blend: bool,
        /// The ingest under way: its user and how many units it had.
        begun: Option<(String, usize)>,
        /// Ingests committed and aborted.
        ends: Vec<bool>,
    }

    impl MemoryHost for MapHost {
        fn window(&self) -> usize {
            2
        }
        fn blends(&self) -> bool {
            !self.no_blend
        }
        fn embed(&mut self, texts: &[String]) -> Result<Embedded> {
            let vectors = texts.iter().map(|t| vec![t.len() as f32]).collect();
            Ok(Embedded { vectors, tokens: texts.iter().map(String::len).sum() })
        }
        fn search(&mut self, q: &SearchQuery) -> Result<Vec<(MemoryUnit, f32)>> {
            Ok(self.units(&q.user)?.into_iter().take(q.top_k).map(|u| (u, 1.0)).collect())
        }
        fn update(&mut self, _: &str, _: &str, change: &UnitUpdate, _: bool) -> Result<UpdateReport> {
            Ok(UpdateReport { changed: change.text.is_some(), encoded_tokens: 0 })
        }
        fn history(&self, _: &str, _: &str) -> Result<Vec<UnitEvent>> {
            Ok(Vec::new())
        }
        fn generate(&mut self, job: GenerateJob, _events: Events) -> Result<()> {
            self.generated.push(job.chat.question);
            Ok(())
        }
        fn check_fits(&self, units: &[MemoryUnit]) -> Result<()> {
            match units.iter().find(|u| u.text == "huge") {
                Some(u) => Err(WorkerError::Invalid(format!("unit {:?} is too long", u.id))),
                None => Ok(()),
            }
        }
        fn ingest(&mut self, user: &str, units: &[MemoryUnit], _defer_kv: bool) -> Result<IngestReport> {
            if units.iter().any(|u| u.text == "boom") {
                let reason = "injected failure".into();
                return Err(WorkerError::Memory(MemoryError::Corrupt { path: "kv.log".into(), offset: 0, reason }));
            }
            self.units.entry(user.into()).or_default().extend_from_slice(units);
            Ok(IngestReport { added: units.len(), ..Default::default() })
        }
        fn begin_ingest(&mut self, user: &str, _units: &[MemoryUnit]) -> Result<()> {
            assert!(self.begun.is_none(), "one ingest at a time");
            self.begun = Some((user.into(), self.units.get(user).map_or(0, Vec::len)));
            Ok(())
        }
        fn end_ingest(&mut self, user: &str, commit: bool) -> Result<()> {
            let (who, had) = self.begun.take().expect("an ingest was begun");
            assert_eq!(who, user);
            if !commit && let Some(u) = self.units.get_mut(user) {
                u.truncate(had);
            }
            self.ends.push(commit);
            Ok(())
        }
        fn units(&self, user: &str) -> Result<Vec<MemoryUnit>> {
            self.units.get(user).cloned().ok_or_else(|| WorkerError::UnknownUser(user.into()))
        }
        fn forget(&mut self, user: &str, _unit: Option<&str>) -> Result<()> {
            self.units.remove(user).map(drop).ok_or_else(|| WorkerError::UnknownUser(user.into()))
        }
        fn load(&self) -> Load {
            Load { running: 1, max_queue: 8, ..Load::default() }
        }
        fn holdings(&self, _footprint: bool) -> Holdings {
            let facts = self.units.values().map(Vec::len).sum();
            Holdings { users: self.units.len(), facts, footprint: None, ..Default::default() }
        }
        fn users(&self) -> Vec<(String, u64)> {
            self.units.iter().map(|(u, us)| (u.clone(), us.len() as u64)).collect()
        }
        fn fact_ids(&self, user: &str) -> Vec<String> {
            self.units.get(user).map_or_else(Vec::new, |u| u.iter().map(|u| u.id.clone()).collect())
        }
        fn export_begin(&self, _user: &str) -> Result<(KvHeader, Vec<String>)> {
            Err(WorkerError::Internal("not part of these tests".into()))
        }
        fn export(&self, _: &str, _: &[String], _: bool, _: usize) -> Result<(Vec<ShardRecord>, usize)> {
            Err(WorkerError::Internal("not part of these tests".into()))
        }
        fn import_target(&self) -> Result<(PathBuf, KvHeader)> {
            Err(WorkerError::Internal("not part of these tests".into()))
        }
        fn commit_import(&mut self, _: &str, _: StagedShard) -> Result<ImportReport> {
            Err(WorkerError::Internal("not part of these tests".into()))
        }
        fn drop_user(&mut self, user: &str) -> Result<()> {
            self.units.remove(user);
            self.dropped.push(user.into());
            Ok(())
        }
    }

    fn protocol() -> (Protocol, Arc<WorkerMetrics>) {
        let metrics = Arc::new(WorkerMetrics::default());
        let cfg = ProtocolConfig { max_k: 50, ingest_batch: 2, max_ingest_units: 6 };
        (Protocol::new(cfg, metrics.clone()), metrics)
    }

    fn units(ids: &[&str]) -> Vec<MemoryUnit> {
        ids.iter().map(|&id| MemoryUnit { id: id.into(), text: format!("unit {id}"), ..Default::default() }).collect()
    }

    fn job(user: &str, question: &str, mode: Mode, k: usize) -> GenerateJob {
        GenerateJob {
            user: user.into(),
            chat: Chat::question(question),
            scope: Scope::default(),
            mode,
            k,
            window: None,
            blend_ratio: inferscale_memory::DEFAULT_BLEND_RATIO,
            params: SamplingParams::greedy(8),
            deadline: None,
            arrived: Instant::now(),
            span: Span::none(),
        }
    }

    /// Sends `job`; returns the error it was refused with, if any.
    fn generate(p: &mut Protocol, host: &mut MapHost, job: GenerateJob) -> Option<WorkerError> {
        let (events, mut rx) = mpsc::unbounded_channel();
        p.handle(host, Command::Generate { job, events });
        match rx.try_recv() {
            Ok(Event::Failed(e)) => Some(e),
            _ => None,
        }
    }

    fn ingest(
        p: &mut Protocol,
        host: &mut MapHost,
        user: &str,
        u: Vec<MemoryUnit>,
    ) -> oneshot::Receiver<Result<IngestReport>> {
        let (reply, rx) = oneshot::channel();
        p.handle(host, Command::Ingest { user: user.into(), window: None, units: u, defer_kv: false, reply });
        rx
    }

    #[test]
    fn embeddings_requests_are_checked_then_answered_in_order() {
        let (mut p, _) = protocol();
        let mut host = MapHost::default();
        let mut embed = |texts: Vec<String>| {
            let (reply, mut rx) = oneshot::channel();
            p.handle(&mut host, Command::Embed { texts, reply });
            rx.try_recv().expect("answered at once")
        };
        let too_many = vec!["x".to_string(); MAX_EMBED_INPUTS + 1];
        for (bad, needle) in [(vec![], "empty"), (vec!["a".into(), " ".into()], "input[1]"), (too_many, "limit")] {
            let e = embed(bad).expect_err("refused");
            assert!(matches!(&e, WorkerError::Invalid(m) if m.contains(needle)), "{e} lacks {needle:?}");
        }
        let out = embed(vec!["ab".into(), "abc".into()]).expect("embedded");
        assert_eq!(out.vectors, [vec![2.0], vec![3.0]]);
        assert_eq!(out.tokens, 5);
    }

    #[test]
    fn requests_are_checked_before_the_engine_sees_them() {
        let (mut p, metrics) = protocol();
        let mut host = MapHost::default();
        let mut wrong_window = job("ana", "Where?", Mode::Kv, 5);
        wrong_window.window = Some(3);
        let mut no_tokens = job("ana", "Where?", Mode::Kv, 5);
        no_tokens.params.max_tokens = 0;
        let mut over = job("ana", "Where?", Mode::Blend, 5);
        over.blend_ratio = 1.5;
        let mut nan = job("ana", "Where?", Mode::Blend, 5);
        nan.blend_ratio = f32::NAN;
        for (bad, needle) in [
            (wrong_window, "context window of 2 turns"),
            (no_tokens, "max_tokens"),
            (over, "blend_ratio = 1.5"),
            (nan, "blend_ratio = NaN"),
            (job("ana", "  ", Mode::Kv, 5), "question"),
            (job("", "Where?", Mode::Prompt, 5), "a user is required"),
            (job("ana", "Where?", Mode::Kv, 0), "k = 0 is outside 1..=50"),
            (job("ana", "Where?", Mode::Kv, 51), "k = 51 is outside 1..=50"),
        ] {
            let e = generate(&mut p, &mut host, bad).expect("refused");
            assert!(matches!(&e, WorkerError::Invalid(m) if m.contains(needle)), "{e} lacks {needle:?}");
        }
        assert!(host.generated.is_empty(), "the engine saw a refused request");
        assert_eq!(metrics.outcomes(), (0, 0, 8));
        // Without memory neither user nor k matters.
        assert!(generate(&mut p, &mut host, job("", "Hello?", Mode::None, 0)).is_none());
        assert_eq!(host.generated, ["Hello?"]);
        // Blend is for engines that can recompute inside their forward pass.
        assert!(generate(&mut p, &mut host, job("ana", "Blend?", Mode::Blend, 5)).is_none());
        host.no_blend = true;
        let e = generate(&mut p, &mut host, job("ana", "Blend?", Mode::Blend, 5)).expect("refused");
        assert!(e.to_string().contains("needs the native engine"), "{e}");
        assert_eq!(host.generated, ["Hello?", "Blend?"]);
    }

    #[test]
    fn ingests_go_in_batches_and_a_failure_stores_nothing_of_its_request() {
        let (mut p, _) = protocol();
        let mut host = MapHost::default();
        let mut rx = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c", "d", "e"]));
        assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2, "two of five stored");
        assert!(p.ingesting(), "more to go");
        assert_eq!(host.fact_ids("ana"), ["a", "b"]);
        assert!(rx.try_recv().is_err(), "answered before it was stored");
        assert_eq!(p.ingest_some(&mut host, 1, false), 1, "a call stores at most what it is allowed");
        assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2);
        assert!(!p.ingesting(), "the last batch ends it");
        assert_eq!(rx.try_recv().expect("answered").expect("stored").added, 5);
        assert_eq!(host.ends, [true], "committed once, after its last batch");

        let mut bad = units(&["f", "g", "h"]);
        bad[2].text = "boom".into();
        let mut rx = ingest(&mut p, &mut host, "ana", bad);
        while p.ingest_some(&mut host, usize::MAX, false) > 0 {}
        let e = rx.try_recv().expect("answered").expect_err("failed");
        assert!(e.to_string().contains("injected failure"), "{e}");
        // The batch before the failing one was stored, then removed.
        assert_eq!(host.ends, [true, false]);
        assert_eq!(host.fact_ids("ana"), ["a", "b", "c", "d", "e"], "nothing of the failed request is left");
        // Refused whole: nothing of a request that fails validation is stored.
        let rx = ingest(&mut p, &mut host, "ana", units(&["x", "x"]));
        assert!(matches!(rx.blocking_recv(), Ok(Err(WorkerError::Invalid(_)))));
        assert!(!p.ingesting());
    }

    /// An ingest whose caller left (a deadline, a hang-up) stops, and what
    /// it stored goes: before, it went on and was stored after its caller
    /// had been told it failed (504).
    #[test]
    fn an_ingest_whose_caller_left_is_cancelled_and_removed() {
        let (mut p, _) = protocol();
        let mut host = MapHost::default();
        let rx = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c", "d", "e"]));
        assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2);
        assert_eq!(host.fact_ids("ana"), ["a", "b"]);
        drop(rx);
        assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 0, "nothing left to do");
        assert_eq!(host.ends, [false]);
        assert!(host.fact_ids("ana").is_empty(), "what it stored is gone");
        // One that had not started yet is dropped without touching the memory.
        let rx = ingest(&mut p, &mut host, "bo", units(&["x"]));
        drop(rx);
        assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 0);
        assert_eq!(host.ends, [false]);
        assert!(host.fact_ids("bo").is_empty());
    }

    #[test]
    fn a_request_is_refused_whole_when_one_unit_cannot_be_stored_or_it_is_too_large() {
        let (mut p, _) = protocol();
        let mut host = MapHost::default();
        let mut sent = units(&["a", "b", "c"]);
        sent[2].text = "huge".into();
        let rx = ingest(&mut p, &mut host, "ana", sent);
        assert!(matches!(rx.blocking_recv(), Ok(Err(WorkerError::Invalid(m))) if m.contains("\"c\" is too long")));
        assert!(!p.ingesting() && host.units.is_empty(), "nothing of it queued or stored");
        let rx = ingest(&mut p, &mut host, "ana", units(&["1", "2", "3", "4", "5", "6", "7"]));
        let e = rx.blocking_recv().expect("answered").expect_err("too many units");
        assert!(e.to_string().contains("7 units in one ingest request; the limit is 6"), "{e}");
        assert!(host.units.is_empty());
    }

    #[test]
    fn a_freeze_sees_every_queued_unit_then_writes_wait_until_release() {
        let (mut p, _) = protocol();
        let mut host = MapHost::default();
        let mut stored = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c"]));
        let (reply, mut frozen) = oneshot::channel();
        p.handle(&mut host, Command::Shard(ShardCommand::Freeze { user: "ana".into(), reply }));
        assert!(frozen.try_recv().is_err(), "answered while an ingest of the user was queued");
        while p.ingest_some(&mut host, usize::MAX, false) > 0 {}
        assert!(stored.try_recv().is_ok_and(|r| r.is_ok()));
        assert_eq!(frozen.try_recv().expect("answered"), ["a", "b", "c"]);

        let late = ingest(&mut p, &mut host, "ana", units(&["d"]));
        assert!(matches!(late.blocking_recv(), Ok(Err(WorkerError::Moving(_)))));
        // Reads go on while frozen.
        assert!(generate(&mut p, &mut host, job("ana", "Where?", Mode::Kv, 5)).is_none());

        let (reply, released) = oneshot::channel();
        p.handle(&mut host, Command::Shard(ShardCommand::Release { user: "ana".into(), drop: true, reply }));
        assert!(released.blocking_recv().is_ok_and(|r| r.is_ok()));
        assert_eq!(host.dropped, ["ana"]);
        // Moved away: its requests are refused (retryably) rather than answered without memory.
        let e = generate(&mut p, &mut host, job("ana", "Where?", Mode::Kv, 5)).expect("refused");
        assert!(matches!(e, WorkerError::Moving(_)), "{e}");
    }

    #[test]
    fn forgetting_a_user_fails_its_queued_ingests() {
        let (mut p, _) = protocol();
        let mut host = MapHost::default();
        let first = ingest(&mut p, &mut host, "ana", units(&["a", "b", "c"]));
        assert_eq!(p.ingest_some(&mut host, usize::MAX, false), 2);
        let (reply, forgot) = oneshot::channel();
        p.handle(&mut host, Command::Forget { user: "ana".into(), unit: None, reply });
        assert!(forgot.blocking_recv().is_ok_and(|r| r.is_ok()));
        // The rest of the ingest would bring the user back after the delete.
        assert!(matches!(first.blocking_recv(), Ok(Err(WorkerError::Forgotten(_)))));
        assert!(!p.ingesting());
        assert!(host.units.is_empty());

        let (reply, stats) = oneshot::channel();
        p.handle(&mut host, Command::Stats { memory_bytes: false, reply });
        let s = stats.blocking_recv().expect("stats");
        assert_eq!((s.load.running, s.load.max_queue, s.window, s.users), (1, 8, 2, 0));
    }
}
