//! The engine thread: one engine, one memory shard, one scheduler.
//!
//! Everything that touches tensors runs on this one thread, in a loop:
//! take the commands that arrived (new requests, ingests, forgets, stats),
//! drop requests whose client went away or whose deadline passed, ask the
//! scheduler for the next step, lay out newly admitted requests (fork the
//! cached header, inject or paste the retrieved facts), run the step's
//! forward pass, sample, stream tokens. Ingests are encoded a few units
//! per loop turn, so a large ingest never stalls the running batch for
//! long. The gRPC layer talks to this thread only through [`Command`]s.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use inferscale_engine::bert::Bert;
use inferscale_engine::kv_cache::BLOCK_SIZE;
use inferscale_engine::sampling::{Rng, SamplingParams, sample};
use inferscale_engine::{Backend, Engine, FinishReason, NextToken, Sequence};
use inferscale_memory::{Composer, Encoders, Fact, IngestReport, Memory, Mode, Prompts, Query, Turn, prepare};
use inferscale_model::ModelFiles;
use tokio::sync::{mpsc, oneshot};
use tracing::{Span, field::Empty, info_span};

use crate::error::{Result, WorkerError};
use crate::metrics::WorkerMetrics;
use crate::scheduler::{RequestId, RequestSpec, Scheduler, SchedulerConfig};
use crate::text::{Delta, TextStream};

mod moves;

pub use moves::{Moves, ShardCommand};

/// What the engine thread owns.
pub struct WorkerParts<B: Backend> {
    pub files: ModelFiles,
    pub engine: Engine<B>,
    pub embedder: Bert<B>,
    pub memory: Memory<B>,
    /// End-of-sequence token ids.
    pub eos: Vec<u32>,
}

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
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            max_running: 64,
            max_queue: 256,
            max_k: 200,
            ingest_batch: 4,
            ingest_tokens_per_unit: 2048,
            prompts: Prompts::default(),
        }
    }
}

/// A finish reason as OpenAI's API names it (end of sequence is `stop`).
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// A chat request as the engine thread sees it.
#[derive(Debug, Clone)]
pub struct GenerateJob {
    pub user: String,
    pub question: String,
    pub mode: Mode,
    pub k: usize,
    /// The context window the caller expects its memory encoded with.
    pub window: Option<usize>,
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

/// Counters and gauges of a worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    pub users: usize,
    pub facts: usize,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub window: usize,
    pub max_queue: usize,
    /// Pre-RoPE KV of the memory held in the backend's memory, and the
    /// memory's logs on disk (0 unless asked for).
    pub kv_resident_bytes: u64,
    /// Pre-RoPE KV of users placed in the backend's host tier.
    pub kv_host_tier_bytes: u64,
    pub disk_bytes: u64,
}

/// A stored unit as listed.
pub type Unit = Turn;

pub enum Command {
    Generate {
        job: GenerateJob,
        events: mpsc::UnboundedSender<Event>,
    },
    Ingest {
        user: String,
        window: Option<usize>,
        units: Vec<Turn>,
        /// Store facts only; KV is encoded when first needed.
        defer_kv: bool,
        reply: oneshot::Sender<Result<IngestReport>>,
    },
    List {
        user: String,
        reply: oneshot::Sender<Result<(Vec<Unit>, usize)>>,
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
    Shard(ShardCommand),
}

/// A request from arrival to its last token.
struct Live {
    job: GenerateJob,
    question: Vec<u32>,
    events: mpsc::UnboundedSender<Event>,
    /// Retrieved fact ids, best first.
    fact_ids: Vec<String>,
    memory_tokens: usize,
    seq: Option<Sequence>,
    rng: Rng,
    generated: Vec<u32>,
    text: TextStream,
    finish: Option<FinishReason>,
    timings: Timings,
    admitted: Option<Instant>,
    /// The phase under way (queue, prefill, decode), ended when the next
    /// begins.
    phase: Span,
}

struct IngestJob {
    user: String,
    units: Vec<Turn>,
    defer_kv: bool,
    next: usize,
    report: IngestReport,
    reply: oneshot::Sender<Result<IngestReport>>,
}

/// Where the engine thread's time goes, printed every 10 s when
/// `INFERSCALE_WORKER_PROFILE=1`: commands (arrivals: retrieval and
/// sizing), layout (header fork and injection), the forward pass with
/// sampling's device part, and the host's sampling and streaming.
#[derive(Default)]
struct Profile {
    on: bool,
    since: Option<Instant>,
    steps: u64,
    rows: u64,
    commands: Duration,
    layout: Duration,
    forward: Duration,
    sample: Duration,
}

impl Profile {
    fn add(&mut self, what: fn(&mut Profile) -> &mut Duration, from: Instant) -> Instant {
        let now = Instant::now();
        if self.on {
            *what(self) += now - from;
        }
        now
    }

    fn report(&mut self) {
        let Some(since) = self.since else {
            self.since = Some(Instant::now());
            return;
        };
        let wall = since.elapsed();
        if !self.on || wall < Duration::from_secs(10) {
            return;
        }
        let pct = |d: Duration| 100.0 * d.as_secs_f64() / wall.as_secs_f64();
        eprintln!(
            "inferscale worker profile: {:.1} steps/s, {:.1} rows/step; commands {:.0}% layout {:.0}% forward {:.0}% sample+stream {:.0}% (ms/step: forward {:.2})",
            self.steps as f64 / wall.as_secs_f64(),
            self.rows as f64 / self.steps.max(1) as f64,
            pct(self.commands),
            pct(self.layout),
            pct(self.forward),
            pct(self.sample),
            self.forward.as_secs_f64() * 1e3 / self.steps.max(1) as f64,
        );
        *self = Profile { on: true, since: Some(Instant::now()), ..Default::default() };
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs the engine thread until every command sender is dropped.
pub fn run<B: Backend>(
    parts: WorkerParts<B>,
    cfg: WorkerConfig,
    rx: Receiver<Command>,
    metrics: Arc<WorkerMetrics>,
) -> Result<()> {
    let WorkerParts { files, mut engine, embedder, mut memory, eos } = parts;
    let composer = Composer::new(&files, &cfg.prompts)?;
    let tokenizer =
        files.tokenizer.as_ref().ok_or_else(|| WorkerError::Startup("the model has no tokenizer".into()))?;
    memory.set_encode_batch(cfg.ingest_batch);
    let mut header = engine.new_sequence(composer.header().to_vec())?;
    engine.prefill(&mut header)?;
    let reserve = (cfg.ingest_batch * cfg.ingest_tokens_per_unit).div_ceil(BLOCK_SIZE);
    let free = engine.pool().free_blocks();
    let total_blocks = free.checked_sub(reserve).filter(|&n| n > 0).ok_or_else(|| {
        WorkerError::Startup(format!(
            "the KV cache has {free} free blocks after the header; ingest needs {reserve}: give it more memory"
        ))
    })?;
    let mut sched = Scheduler::new(SchedulerConfig {
        max_batch_tokens: engine.max_batch_tokens(),
        max_running: cfg.max_running,
        max_queue: cfg.max_queue,
        total_blocks,
        block_size: BLOCK_SIZE,
    });
    let mut core = Core {
        engine,
        embedder,
        memory,
        eos,
        composer: &composer,
        tokenizer,
        header,
        cfg,
        live: HashMap::new(),
        ingests: VecDeque::new(),
        next_id: 0,
        stats: Stats::default(),
        moves: moves::Moves::default(),
        metrics,
        profile: Profile { on: std::env::var_os("INFERSCALE_WORKER_PROFILE").is_some(), ..Default::default() },
    };
    loop {
        let idle = core.live.is_empty() && core.ingests.is_empty();
        if idle && core.encode_pending() {
            // Background work done; look for commands before more of it.
            match rx.try_recv() {
                Ok(c) => core.handle(c, &mut sched),
                Err(TryRecvError::Empty) => continue,
                Err(TryRecvError::Disconnected) => return Ok(()),
            }
        }
        let idle = core.live.is_empty() && core.ingests.is_empty();
        let first = if idle {
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        } else {
            None
        };
        let t0 = Instant::now();
        if let Some(c) = first {
            core.handle(c, &mut sched);
        }
        loop {
            match rx.try_recv() {
                Ok(c) => core.handle(c, &mut sched),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return Ok(()),
            }
        }
        core.profile.add(|p| &mut p.commands, t0);
        core.profile.report();
        core.reap(&mut sched);
        core.ingest_some();
        core.settle_freezes();
        core.step(&mut sched);
    }
}

struct Core<'c, 'f, B: Backend> {
    engine: Engine<B>,
    embedder: Bert<B>,
    memory: Memory<B>,
    eos: Vec<u32>,
    composer: &'c Composer<'f>,
    tokenizer: &'f inferscale_model::Tokenizer,
    header: Sequence,
    cfg: WorkerConfig,
    live: HashMap<RequestId, Live>,
    ingests: VecDeque<IngestJob>,
    next_id: RequestId,
    stats: Stats,
    moves: moves::Moves,
    metrics: Arc<WorkerMetrics>,
    profile: Profile,
}

impl<'c, 'f, B: Backend> Core<'c, 'f, B> {
    fn handle(&mut self, c: Command, sched: &mut Scheduler) {
        match c {
            Command::Generate { job, events } => {
                let span = job.span.clone();
                if let Err(e) = self.admit(job, events.clone(), sched) {
                    span.record("otel.status_code", "error");
                    self.stats.failed += 1;
                    let _ = events.send(Event::Failed(e));
                }
            }
            Command::Ingest { user, window, units, defer_kv, reply } => {
                let check = self
                    .check_window(window)
                    .and_then(|()| Ok(Memory::<B>::validate(&user, &units)?))
                    .and_then(|()| self.moves.check_write(&user));
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
                let window = self.memory.spec().window;
                let units = self.memory.facts(&user).map_err(WorkerError::from);
                let units = units.map(|facts| (facts.iter().map(Fact::unit).collect(), window));
                let _ = reply.send(units);
            }
            Command::Forget { user, unit, reply } => {
                if let Err(e) = self.moves.check_write(&user) {
                    let _ = reply.send(Err(e));
                    return;
                }
                let whole_user = unit.is_none();
                let r = match &unit {
                    None => self.memory.forget_user(&user),
                    Some(id) => self.memory.forget_fact(&user, id),
                };
                let r = r.map_err(|e| match (e, unit) {
                    (inferscale_memory::MemoryError::Invalid { .. }, Some(id)) => {
                        WorkerError::UnknownUnit { user: user.clone(), id }
                    }
                    (e, _) => e.into(),
                });
                if r.is_ok() {
                    self.drop_unstarted(&user, sched, WorkerError::Forgotten);
                    if whole_user {
                        // An ingest still encoding would bring the user back after the delete.
                        let (gone, keep): (VecDeque<IngestJob>, VecDeque<IngestJob>) =
                            std::mem::take(&mut self.ingests).into_iter().partition(|j| j.user == user);
                        self.ingests = keep;
                        for j in gone {
                            let _ = j.reply.send(Err(WorkerError::Forgotten(user.clone())));
                        }
                    }
                }
                let _ = reply.send(r);
            }
            Command::Shard(c) => self.handle_shard(c, sched),
            Command::Stats { memory_bytes, reply } => {
                let m = &self.memory;
                let mut s = self.stats.clone();
                s.running = sched.running();
                s.waiting = sched.waiting();
                s.kv_blocks_total = self.engine.pool().total_blocks();
                s.kv_blocks_free = self.engine.pool().free_blocks();
                s.users = m.users().count();
                s.facts = m.users().map(|u| m.facts(u).map_or(0, <[_]>::len)).sum();
                s.window = m.spec().window;
                s.max_queue = self.cfg.max_queue;
                if memory_bytes {
                    let footprint = m.footprint();
                    s.kv_resident_bytes = footprint.kv_resident_bytes;
                    s.kv_host_tier_bytes = footprint.kv_host_tier_bytes;
                    s.disk_bytes = footprint.disk_bytes;
                }
                let _ = reply.send(s);
            }
        }
    }

    fn check_window(&self, window: Option<usize>) -> Result<()> {
        let ours = self.memory.spec().window;
        match window {
            Some(w) if w != ours => Err(WorkerError::Invalid(format!(
                "window {w}: this worker's memory is encoded with a context window of {ours} turns"
            ))),
            _ => Ok(()),
        }
    }

    /// Retrieves, sizes and queues a request.
    fn admit(&mut self, job: GenerateJob, events: mpsc::UnboundedSender<Event>, sched: &mut Scheduler) -> Result<()> {
        self.check_window(job.window)?;
        job.params.validate()?;
        if job.params.max_tokens == 0 {
            return Err(WorkerError::Invalid("max_tokens must be at least 1".into()));
        }
        if job.question.trim().is_empty() {
            return Err(WorkerError::Invalid("the question (last user message) is empty".into()));
        }
        if job.mode != Mode::None && job.user.is_empty() {
            return Err(WorkerError::Invalid("a user is required when memory is used".into()));
        }
        if job.mode != Mode::None {
            self.moves.check_read(&job.user)?;
        }
        if job.mode != Mode::None && (job.k == 0 || job.k > self.cfg.max_k) {
            return Err(WorkerError::Invalid(format!("k = {} is outside 1..={}", job.k, self.cfg.max_k)));
        }
        let question = self.composer.question(&job.question)?;
        let t0 = Instant::now();
        let retrieve =
            info_span!(parent: &job.span, "retrieve", k = job.k as i64, candidates = Empty, retrieved = Empty);
        let entered = retrieve.enter();
        let mut facts = Vec::new();
        if job.mode != Mode::None && self.memory.has_user(&job.user) {
            let engine = &mut self.engine;
            if job.mode == Mode::Kv {
                let mut enc = Encoders { engine, embedder: &self.embedder, composer: self.composer };
                self.memory.ensure_kv(&job.user, &mut enc)?;
            }
            let query = self.embedder.embed(self.engine.backend(), &[job.question.as_str()])?;
            let query = query.first().ok_or_else(|| WorkerError::Invalid("empty question embedding".into()))?;
            facts = self.memory.retrieve(
                self.engine.backend(),
                &job.user,
                Query { text: &job.question, embedding: query },
                job.k,
            )?;
            retrieve.record("candidates", self.memory.facts(&job.user).map_or(0, <[_]>::len) as i64);
        }
        retrieve.record("retrieved", facts.len() as i64);
        drop(entered);
        drop(retrieve);
        let retrieve_ms = ms(t0.elapsed());
        let all = if facts.is_empty() { &[][..] } else { self.memory.facts(&job.user)? };
        let memory_tokens: usize = facts.iter().map(|&i| all[i].tokens.len()).sum();
        let header = self.header.len();
        let limit = self.engine.model().config().max_position_embeddings;
        let prompt_len = header + memory_tokens + question.len();
        if prompt_len >= limit {
            return Err(WorkerError::Invalid(format!(
                "the prompt is {prompt_len} tokens with its memory; the model's context is {limit}: lower k"
            )));
        }
        let max_new = job.params.max_tokens.min(limit - prompt_len);
        let (computed, injected) = match job.mode {
            Mode::Kv => (question.len(), memory_tokens),
            Mode::Prompt => (question.len() + memory_tokens, 0),
            Mode::None => (question.len(), 0),
        };
        let id = self.next_id;
        self.next_id += 1;
        sched.submit(RequestSpec {
            id,
            user: job.user.clone(),
            prompt_tokens: computed,
            // The fork copies the header's partial last block; the rest of it is shared.
            injected_tokens: injected + header % BLOCK_SIZE,
            max_new_tokens: max_new,
        })?;
        let mut job = job;
        job.params.max_tokens = max_new;
        let phase = info_span!(parent: &job.span, "queue");
        self.live.insert(
            id,
            Live {
                rng: Rng::new(job.params.seed),
                job,
                events,
                fact_ids: facts.iter().map(|&i| all[i].id.clone()).collect(),
                memory_tokens,
                seq: None,
                generated: Vec::new(),
                text: TextStream::default(),
                finish: None,
                timings: Timings { retrieve_ms, ..Default::default() },
                admitted: None,
                phase,
                question,
            },
        );
        Ok(())
    }

    /// Drops requests whose client went away or whose deadline passed;
    /// their blocks are free at once.
    fn reap(&mut self, sched: &mut Scheduler) {
        let now = Instant::now();
        let gone: Vec<(RequestId, bool)> = self
            .live
            .iter()
            .filter_map(|(&id, l)| {
                let late = l.job.deadline.is_some_and(|d| now > l.job.arrived + d);
                (l.events.is_closed() || late).then_some((id, late))
            })
            .collect();
        for (id, late) in gone {
            sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                if late && !l.events.is_closed() {
                    self.stats.failed += 1;
                    let ms = l.job.deadline.map_or(0, |d| d.as_millis() as u64);
                    l.job.span.record("otel.status_code", "error");
                    let _ = l.events.send(Event::Failed(WorkerError::Deadline(ms)));
                } else {
                    self.stats.cancelled += 1;
                }
            }
        }
    }

    /// Fails `user`'s requests that were not laid out yet, with `why`: the
    /// facts they retrieved may be gone.
    fn drop_unstarted(&mut self, user: &str, sched: &mut Scheduler, why: fn(String) -> WorkerError) {
        let ids: Vec<RequestId> =
            self.live.iter().filter(|(_, l)| l.job.user == user && l.seq.is_none()).map(|(&id, _)| id).collect();
        for id in ids {
            sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                self.stats.failed += 1;
                l.job.span.record("otel.status_code", "error");
                let _ = l.events.send(Event::Failed(why(user.to_string())));
            }
        }
    }

    /// When idle: encodes a few facts still without KV (a replica's copy,
    /// an import without KV). Returns whether it did any.
    fn encode_pending(&mut self) -> bool {
        let mut enc = Encoders { engine: &mut self.engine, embedder: &self.embedder, composer: self.composer };
        match self.memory.encode_pending(self.cfg.ingest_batch, &mut enc) {
            Ok(n) => n > 0,
            Err(e) => {
                eprintln!("inferscale worker: encoding stored facts in the background: {e}");
                false
            }
        }
    }

    /// Encodes the next few units of the oldest ingest; answers it when done.
    fn ingest_some(&mut self) {
        let Some(job) = self.ingests.front_mut() else { return };
        let end = (job.next + self.cfg.ingest_batch).min(job.units.len());
        let mut enc = Encoders { engine: &mut self.engine, embedder: &self.embedder, composer: self.composer };
        let units = &job.units[job.next..end];
        let r = match job.defer_kv {
            true => self.memory.ingest_deferred(&job.user, units, &mut enc),
            false => self.memory.ingest(&job.user, units, &mut enc),
        };
        match r {
            Ok(r) => {
                job.report.added += r.added;
                job.report.skipped += r.skipped;
                job.report.encoded_tokens += r.encoded_tokens;
                job.next = end;
                if job.next < job.units.len() {
                    return;
                }
                if let Some(job) = self.ingests.pop_front() {
                    let _ = job.reply.send(Ok(job.report));
                }
            }
            Err(e) => {
                if let Some(job) = self.ingests.pop_front() {
                    let stored = job.report.added;
                    let e = WorkerError::from(e);
                    let _ = job.reply.send(Err(match e {
                        WorkerError::Memory(m) if stored > 0 => {
                            WorkerError::Invalid(format!("{m} (the first {stored} units of this request are stored)"))
                        }
                        e => e,
                    }));
                }
            }
        }
    }

    /// Lays out a newly admitted request: fork the header, inject or paste
    /// its facts, append the question.
    fn layout(&mut self, id: RequestId) -> Result<()> {
        let Some(l) = self.live.get_mut(&id) else { return Ok(()) };
        let now = Instant::now();
        l.admitted = Some(now);
        // Retrieval ran at arrival; the rest of the wait was for admission.
        l.timings.queue_ms = (ms(now - l.job.arrived) - l.timings.retrieve_ms).max(0.0);
        self.metrics.admitted(l.timings.queue_ms / 1e3);
        l.phase = Span::none();
        let compose =
            info_span!(parent: &l.job.span, "compose", mode = l.job.mode.as_str(), facts = l.fact_ids.len() as i64);
        let _entered = compose.enter();
        let facts = match l.fact_ids.is_empty() {
            true => Vec::new(),
            false => {
                let all = self.memory.facts(&l.job.user)?;
                let by_id: HashMap<&str, usize> = all.iter().enumerate().map(|(i, f)| (f.id.as_str(), i)).collect();
                l.fact_ids
                    .iter()
                    .map(|f| by_id.get(f.as_str()).copied().ok_or_else(|| WorkerError::Forgotten(l.job.user.clone())))
                    .collect::<Result<Vec<usize>>>()?
            }
        };
        let p = prepare(&mut self.engine, &self.memory, &l.job.user, &facts, l.job.mode, &self.header, &l.question)?;
        self.engine.backend().synchronize()?;
        l.timings.inject_ms = ms(now.elapsed());
        l.phase = info_span!(parent: &l.job.span, "prefill", tokens = p.seq.pending() as i64);
        l.fact_ids = p.fact_ids;
        l.seq = Some(p.seq);
        Ok(())
    }

    /// One scheduler step: lay out, forward, sample, stream.
    fn step(&mut self, sched: &mut Scheduler) {
        let step = sched.schedule();
        if step.is_empty() {
            return;
        }
        let t0 = Instant::now();
        let mut failed: Vec<(RequestId, WorkerError)> = Vec::new();
        for item in &step.items {
            if self.live.get(&item.id).is_some_and(|l| l.seq.is_none())
                && let Err(e) = self.layout(item.id)
            {
                failed.push((item.id, e));
            }
        }
        let t1 = self.profile.add(|p| &mut p.layout, t0);
        let items: Vec<_> = step.items.iter().filter(|i| !failed.iter().any(|(f, _)| *f == i.id)).copied().collect();
        let mut ids = Vec::with_capacity(items.len());
        let mut takes = Vec::with_capacity(items.len());
        let mut greedy = Vec::with_capacity(items.len());
        let mut seqs: Vec<&mut Sequence> = Vec::with_capacity(items.len());
        let mut by_id: HashMap<RequestId, &mut Live> = self.live.iter_mut().map(|(&id, l)| (id, l)).collect();
        for item in &items {
            if let Some(l) = by_id.remove(&item.id)
                && let Some(seq) = l.seq.as_mut()
            {
                ids.push(item.id);
                takes.push(item.tokens);
                greedy.push(l.job.params.temperature == 0.0);
                seqs.push(seq);
            }
        }
        let forward = Instant::now();
        let logits = if seqs.is_empty() { Ok(Vec::new()) } else { self.engine.step_exact(&mut seqs, &takes, &greedy) };
        if !seqs.is_empty() {
            self.metrics.stepped(seqs.len(), forward.elapsed().as_secs_f64());
        }
        drop(seqs);
        let t2 = self.profile.add(|p| &mut p.forward, t1);
        self.profile.steps += 1;
        self.profile.rows += ids.len() as u64;
        let mut finished = Vec::new();
        match logits {
            Err(e) => {
                let msg = e.to_string();
                failed.extend(ids.iter().map(|&id| (id, WorkerError::Invalid(format!("engine step failed: {msg}")))));
            }
            Ok(next) => {
                for (id, next) in ids.iter().zip(next) {
                    let Some(next) = next else { continue };
                    if let Err(e) = self.sample_one(*id, next) {
                        failed.push((*id, e));
                    } else if self.live.get(id).is_some_and(|l| l.finish.is_some()) {
                        finished.push(*id);
                    }
                }
            }
        }
        for (id, e) in failed {
            sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                self.stats.failed += 1;
                l.job.span.record("otel.status_code", "error");
                let _ = l.events.send(Event::Failed(e));
            }
        }
        for id in sched.complete(&step, &finished) {
            self.finish(id);
        }
        self.profile.add(|p| &mut p.sample, t2);
    }

    fn sample_one(&mut self, id: RequestId, next: NextToken) -> Result<()> {
        let limit = self.engine.model().config().max_position_embeddings;
        let eos = &self.eos;
        let tokenizer = self.tokenizer;
        let Some(l) = self.live.get_mut(&id) else { return Ok(()) };
        let tok = match next {
            NextToken::Greedy(t) => t,
            NextToken::Logits(logits) => sample(&logits, &l.job.params, &mut l.rng),
        };
        if l.generated.is_empty() {
            let now = Instant::now();
            l.timings.first_token_ms = ms(now - l.job.arrived);
            l.timings.prefill_ms = l.admitted.map_or(0.0, |a| ms(now - a) - l.timings.inject_ms);
            self.metrics.first_token(l.job.mode, l.timings.first_token_ms / 1e3);
            l.phase = info_span!(parent: &l.job.span, "decode", tokens = Empty);
        }
        if !l.job.params.ignore_eos && eos.contains(&tok) {
            l.finish = Some(FinishReason::Eos);
            return Ok(());
        }
        l.generated.push(tok);
        let Some(seq) = l.seq.as_mut() else { return Ok(()) };
        seq.push(tok);
        match l.text.push(tokenizer, &l.generated, &l.job.params.stop)? {
            Delta::Text(text) => {
                let _ = l.events.send(Event::Token { id: tok, text });
            }
            Delta::Stop(text) => {
                if !text.is_empty() {
                    let _ = l.events.send(Event::Token { id: tok, text });
                }
                l.finish = Some(FinishReason::Stop);
                return Ok(());
            }
        }
        if l.generated.len() >= l.job.params.max_tokens || seq.next_position() as usize >= limit {
            l.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    fn finish(&mut self, id: RequestId) {
        let Some(mut l) = self.live.remove(&id) else { return };
        if l.finish != Some(FinishReason::Stop)
            && let Ok(rest) = l.text.finish(self.tokenizer, &l.generated)
            && !rest.is_empty()
        {
            let _ = l.events.send(Event::Token { id: l.generated.last().copied().unwrap_or(0), text: rest });
        }
        let header = self.header.len();
        let question = l.seq.as_ref().map_or(0, |s| s.len() - l.generated.len());
        l.timings.total_ms = ms(l.job.arrived.elapsed());
        // The first token ends the prefill; the decode makes the others.
        let decoded = l.generated.len().saturating_sub(1);
        self.metrics.decoded(l.job.mode, decoded, (l.timings.total_ms - l.timings.first_token_ms).max(0.0) / 1e3);
        l.phase.record("tokens", l.generated.len() as i64);
        let reason = l.finish.unwrap_or(FinishReason::Length);
        l.job.span.record("finish_reason", finish_reason(reason));
        let usage = Usage {
            prompt_tokens: question,
            injected_tokens: if l.job.mode == Mode::Kv { l.memory_tokens } else { 0 },
            cached_tokens: header,
            completion_tokens: l.generated.len(),
            facts: l.fact_ids.len(),
        };
        self.stats.finished += 1;
        let finished = Finished { reason, usage, timings: l.timings, fact_ids: l.fact_ids };
        let _ = l.events.send(Event::Finished(Box::new(finished)));
    }
}
