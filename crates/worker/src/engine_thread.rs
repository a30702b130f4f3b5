//! The engine thread: one engine, one memory shard, one scheduler.
//!
//! Everything that touches tensors runs on this one thread, in a loop:
//! take the commands that arrived (new requests, ingests, forgets, stats),
//! drop requests whose client went away or whose deadline passed, ask the
//! scheduler for the next step, lay out newly admitted requests (fork the
//! cached header, inject or paste the retrieved facts), run the step's
//! forward pass, sample, stream tokens. Ingests are encoded a few units
//! per loop turn, so a large ingest never stalls the running batch for
//! long. Commands are carried out by the worker protocol
//! ([`crate::protocol`]), for which this thread is the [`MemoryHost`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use inferscale_engine::bert::Bert;
use inferscale_engine::kv_cache::BLOCK_SIZE;
use inferscale_engine::sampling::{Rng, sample};
use inferscale_engine::{Backend, Engine, FinishReason, NextToken, Sequence, blend_rows};
use inferscale_memory::{
    Event as UnitEvent, ImportReport, IngestReport, KvHeader, Memory, MemoryUnit, Mode, Pinned, Session, ShardRecord,
    StagedShard, UnitUpdate, UpdateReport,
};
use inferscale_model::ModelFiles;
use tracing::{Span, field::Empty, info_span};

use crate::config::{ColdKv, WorkerConfig};
use crate::error::{Result, WorkerError};
use crate::kv_reader::KvReader;
use crate::metrics::WorkerMetrics;
use crate::protocol::{
    Command, Embedded, Event, Events, FactSources, Finished, GenerateJob, Holdings, Load, MemoryHost, Protocol,
    ProtocolConfig, SearchQuery, Timings, Usage, finish_reason, holdings, search_results,
};
use crate::scheduler::{RequestId, RequestSpec, Scheduler, SchedulerConfig};
use crate::text::{Delta, TextStream};
use crate::throttle::{BACKGROUND_SHARE, RECENTLY_BUSY, StepTime, Throttle};

/// What the engine thread owns.
pub struct WorkerParts<B: Backend> {
    pub files: ModelFiles,
    pub engine: Engine<B>,
    pub embedder: Bert<B>,
    pub memory: Memory<B>,
    /// End-of-sequence token ids.
    pub eos: Vec<u32>,
}

/// A request from arrival to its last token.
struct Live<B: Backend> {
    job: GenerateJob,
    /// Tokens after the memory block: history, question, assistant start.
    tail: Vec<u32>,
    events: Events,
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
    /// Tokens of the header the request was laid out under, and whether
    /// they came from a cached prefill.
    header_tokens: usize,
    header_cached: bool,
    /// Prompt tokens past the header whose KV the prefix cache held.
    prefix_cached: usize,
    /// The retrieved facts' KV (kv and blend modes), made resident at
    /// arrival and held until layout injects it, so that the cache does
    /// not evict it while the request waits.
    pinned: Option<Pinned<B>>,
    /// Retrieved facts pasted as text (kv mode, their KV cold on arrival),
    /// and their tokens.
    paste: Vec<String>,
    pasted_tokens: usize,
    /// Where the facts' KV came from (kv and blend modes).
    sources: Option<FactSources>,
}

/// A kv-mode request retrieved and sized, not yet queued: waiting for its
/// cold facts' reads ([`ColdKv::Wait`]) or on its way to the scheduler.
struct Arrival<B: Backend> {
    job: GenerateJob,
    events: Events,
    tail: Vec<u32>,
    header: usize,
    /// Retrieved facts (indices into the user's facts), best first, their
    /// tokens, and the most tokens the answer may have.
    facts: Vec<usize>,
    memory_tokens: usize,
    max_new: usize,
    pinned: Option<Pinned<B>>,
    /// Facts whose KV is on disk only: read meanwhile, pasted if still cold.
    cold: Vec<usize>,
    /// Facts with no KV yet (not encoded): pasted.
    unencoded: Vec<usize>,
    sources: Option<FactSources>,
    arrived: Instant,
    /// Until when it waits for reads.
    until: Instant,
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
pub(crate) fn run<B: Backend>(
    parts: WorkerParts<B>,
    cfg: WorkerConfig,
    rx: Receiver<Command>,
    metrics: Arc<WorkerMetrics>,
) -> Result<()> {
    let WorkerParts { files, engine, embedder, mut memory, eos } = parts;
    if files.tokenizer.is_none() {
        return Err(WorkerError::Startup("the model has no tokenizer".into()));
    }
    memory.set_encode_batch(cfg.ingest_batch);
    let mut session = Session::new(Arc::new(files), engine, embedder, memory, &cfg.prompts)?;
    session.set_header_cache(cfg.header_cache_blocks);
    let engine = session.engine();
    // Ingest's encodings and the cached headers hold blocks the scheduler
    // never hands to requests.
    let reserve = (cfg.ingest_batch * cfg.ingest_tokens_per_unit).div_ceil(BLOCK_SIZE) + cfg.header_cache_blocks;
    let free = engine.pool().free_blocks();
    let total_blocks = free.checked_sub(reserve).filter(|&n| n > 0).ok_or_else(|| {
        WorkerError::Startup(format!(
            "the KV cache has {free} free blocks after the header; ingest and the header cache need {reserve}: give it more memory"
        ))
    })?;
    let sched = Scheduler::new(SchedulerConfig {
        max_batch_tokens: engine.max_batch_tokens(),
        max_running: cfg.max_running,
        max_queue: cfg.max_queue,
        total_blocks,
        block_size: BLOCK_SIZE,
    });
    let mut protocol = Protocol::new(
        ProtocolConfig { max_k: cfg.max_k, ingest_batch: cfg.ingest_batch, max_ingest_units: cfg.max_ingest_units },
        metrics.clone(),
    );
    let cfg_ingest_batch = cfg.ingest_batch;
    let mut core = Core {
        session,
        eos,
        cfg,
        sched,
        live: HashMap::new(),
        next_id: 0,
        metrics,
        profile: Profile { on: std::env::var_os("INFERSCALE_WORKER_PROFILE").is_some(), ..Default::default() },
        reader: KvReader::start().map_err(|e| WorkerError::Startup(format!("starting the KV reader threads: {e}")))?,
        waiting: Vec::new(),
        reads_cached: false,
        step_time: StepTime::default(),
        // An ingest a client waits for progresses; encodings may wait for idle.
        ingest_throttle: Throttle::new(BACKGROUND_SHARE, cfg_ingest_batch, true),
        encode_throttle: Throttle::new(BACKGROUND_SHARE, cfg_ingest_batch, false),
        last_busy: Instant::now() - RECENTLY_BUSY,
        last_scrub: Instant::now(),
    };
    loop {
        core.complete_reads();
        core.release_waiting();
        // Idle-time encoding waits until no request ran for a moment.
        let quiet = core.last_busy.elapsed() >= RECENTLY_BUSY;
        let idle = core.live.is_empty() && !protocol.ingesting();
        if idle && quiet {
            match core.encode_pending() {
                // Background work done; look for commands before more of it.
                true => match rx.try_recv() {
                    Ok(c) => protocol.handle(&mut core, c),
                    Err(TryRecvError::Empty) => continue,
                    Err(TryRecvError::Disconnected) => return Ok(()),
                },
                false => core.scrub(),
            }
        }
        let idle = core.live.is_empty() && !protocol.ingesting();
        let first = if idle {
            // Requests waiting for reads are looked at again soon.
            let nap = if core.waiting.is_empty() { Duration::from_millis(500) } else { Duration::from_millis(2) };
            match rx.recv_timeout(nap) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        } else {
            None
        };
        let t0 = Instant::now();
        if let Some(c) = first {
            protocol.handle(&mut core, c);
        }
        loop {
            match rx.try_recv() {
                Ok(c) => protocol.handle(&mut core, c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return Ok(()),
            }
        }
        core.profile.add(|p| &mut p.commands, t0);
        core.profile.report();
        core.reap();
        // Background work beside serving, within its share of the time
        // (`throttle.rs`): stored facts first (their KV left for later
        // while requests run), then KV encodings of stored facts.
        if !core.live.is_empty() {
            core.last_busy = Instant::now();
        }
        let busy = core.last_busy.elapsed() < RECENTLY_BUSY;
        let step = core.step_time.get();
        if protocol.ingesting() {
            let n = core.ingest_throttle.allowance(Instant::now(), busy, step);
            if n > 0 {
                let t = Instant::now();
                let handled = protocol.ingest_some(&mut core, n, busy);
                core.ingest_throttle.done(Instant::now(), handled, t.elapsed(), busy);
            }
        }
        if busy {
            core.encode_beside_serving(step);
        }
        core.step();
    }
}

struct Core<B: Backend> {
    session: Session<B>,
    eos: Vec<u32>,
    cfg: WorkerConfig,
    sched: Scheduler,
    live: HashMap<RequestId, Live<B>>,
    next_id: RequestId,
    metrics: Arc<WorkerMetrics>,
    profile: Profile,
    reader: KvReader<B>,
    /// kv-mode requests waiting for their cold facts' reads (`ColdKv::Wait`),
    /// and whether reads were cached since they were last looked at.
    waiting: Vec<Arrival<B>>,
    reads_cached: bool,
    /// Serving steps' mean duration, and the shares of the engine thread
    /// that storing ingests and encoding stored facts get beside serving.
    step_time: StepTime,
    ingest_throttle: Throttle,
    encode_throttle: Throttle,
    /// When a request last ran.
    last_busy: Instant,
    /// When the idle-time scrub last ran.
    last_scrub: Instant,
}

/// The idle-time scrub's pace: this many bytes of KV records a second.
const SCRUB_BYTES: u64 = 16 << 20;
const SCRUB_EVERY: Duration = Duration::from_secs(1);

/// The native engine's side of the protocol: the shard is this thread's,
/// and generation is this thread's scheduler and engine.
impl<B: Backend> MemoryHost for Core<B> {
    fn window(&self) -> usize {
        self.session.memory().spec().window
    }

    fn embed(&mut self, texts: &[String]) -> Result<Embedded> {
        let (vectors, tokens) = self.session.embed(texts)?;
        Ok(Embedded { vectors, tokens })
    }

    fn update(&mut self, user: &str, id: &str, change: &UnitUpdate, defer_kv: bool) -> Result<UpdateReport> {
        Ok(self.session.update(user, id, change, defer_kv)?)
    }

    fn history(&self, user: &str, id: &str) -> Result<Vec<UnitEvent>> {
        Ok(self.session.memory().history(user, id)?.to_vec())
    }

    fn search(&mut self, q: &SearchQuery) -> Result<Vec<(MemoryUnit, f32)>> {
        let hits = self.session.search(&q.user, &q.query, q.top_k, q.threshold, &q.filters, &q.scope)?;
        Ok(search_results(self.session.memory(), &q.user, &hits))
    }

    fn generate(&mut self, job: GenerateJob, events: Events) -> Result<()> {
        self.admit(job, events)
    }

    fn check_fits(&self, units: &[MemoryUnit]) -> Result<()> {
        Ok(self.session.check_fits(units)?)
    }

    fn ingest(&mut self, user: &str, units: &[MemoryUnit], defer_kv: bool) -> Result<IngestReport> {
        Ok(self.session.ingest(user, units, defer_kv)?)
    }

    fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()> {
        Ok(self.session.memory_mut().begin_ingest(user, units)?)
    }

    fn end_ingest(&mut self, user: &str, commit: bool) -> Result<()> {
        let memory = self.session.memory_mut();
        if commit {
            return Ok(memory.commit_ingest(user)?);
        }
        // Requests that retrieved the removed units fail as for a forget
        // (also when the undo failed: the units are hidden all the same).
        let undone = memory.abort_ingest(user);
        if undone.as_ref().is_ok_and(|&n| n > 0) || undone.is_err() {
            self.drop_unstarted(user, WorkerError::Forgotten);
        }
        undone.map(drop).map_err(Into::into)
    }

    fn units(&self, user: &str) -> Result<Vec<MemoryUnit>> {
        Ok(self.session.memory().units(user)?)
    }

    fn forget(&mut self, user: &str, unit: Option<&str>) -> Result<()> {
        self.session.memory_mut().forget(user, unit)?;
        self.drop_unstarted(user, WorkerError::Forgotten);
        Ok(())
    }

    fn load(&self) -> Load {
        Load {
            running: self.sched.running(),
            waiting: self.sched.waiting() + self.waiting.len(),
            kv_blocks_total: self.session.engine().pool().total_blocks(),
            kv_blocks_free: self.session.engine().pool().free_blocks(),
            max_queue: self.cfg.max_queue,
        }
    }

    fn holdings(&self, footprint: bool) -> Holdings {
        holdings(self.session.memory(), footprint)
    }

    fn users(&self) -> Vec<(String, u64)> {
        self.session.memory().digests().map(|(u, d)| (u.to_string(), d)).collect()
    }

    fn fact_ids(&self, user: &str) -> Vec<String> {
        self.session.memory().fact_ids(user)
    }

    fn export_begin(&self, user: &str) -> Result<(KvHeader, Vec<String>)> {
        Ok(self.session.memory().export_begin(user)?)
    }

    fn export(&self, user: &str, ids: &[String], with_kv: bool, max_bytes: usize) -> Result<(Vec<ShardRecord>, usize)> {
        let s = &self.session;
        Ok(s.memory().export(user, ids, with_kv, max_bytes)?)
    }

    fn import_target(&self) -> Result<(PathBuf, KvHeader)> {
        let m = self.session.memory();
        Ok((m.dir().to_path_buf(), m.kv_header().clone()))
    }

    fn commit_import(&mut self, user: &str, staged: StagedShard) -> Result<ImportReport> {
        // Requests that retrieved from the old copy must not lay out from the new one.
        self.drop_unstarted(user, WorkerError::Moving);
        Ok(self.session.commit_import(user, staged)?)
    }

    fn drop_user(&mut self, user: &str) -> Result<()> {
        self.drop_unstarted(user, WorkerError::Moving);
        if self.session.memory().has_user(user) {
            self.session.memory_mut().forget_user(user)?;
        }
        Ok(())
    }
}

impl<B: Backend> Core<B> {
    /// Retrieves, sizes and queues a request the protocol admitted.
    fn admit(&mut self, job: GenerateJob, events: Events) -> Result<()> {
        let tail = self.session.tail(&job.chat)?;
        let header = self.session.header_len(&job.chat)?;
        let t0 = Instant::now();
        let retrieve = info_span!(parent: &job.span, "retrieve", k = job.k as i64, candidates = Empty, retrieved = Empty, loaded = Empty);
        let entered = retrieve.enter();
        let mut facts = Vec::new();
        if job.mode != Mode::None && self.session.memory().has_user(&job.user) {
            facts = self.session.retrieve_in(&job.user, &job.chat.question, job.k, &job.scope)?;
            retrieve.record("candidates", self.session.memory().facts(&job.user).map_or(0, <[_]>::len) as i64);
        }
        retrieve.record("retrieved", facts.len() as i64);
        let all = if facts.is_empty() { &[][..] } else { self.session.memory().facts(&job.user)? };
        let memory_tokens: usize = facts.iter().map(|&i| all[i].tokens.len()).sum();
        let limit = self.session.engine().model().config().max_position_embeddings;
        let prompt_len = header + memory_tokens + tail.len();
        if prompt_len >= limit {
            return Err(WorkerError::Invalid(format!(
                "the prompt is {prompt_len} tokens with its memory; the model's context is {limit}: lower k"
            )));
        }
        // The facts' KV is pinned in the cache until layout. Facts whose
        // KV is on disk only are read by the reader threads and, in kv
        // mode, prefilled this time (or waited for, `ColdKv::Wait`);
        // otherwise read now, while the request waits for admission.
        let (mut pinned, mut cold, mut unencoded, mut sources) = (None, Vec::new(), Vec::new(), None);
        if job.mode.injects() && !facts.is_empty() {
            self.complete_reads();
            let read_now = job.mode != Mode::Kv || self.cfg.cold_kv == ColdKv::Read;
            // Facts whose KV is not encoded yet (an ingest stored while the
            // engine served, a replica's copy): kv mode pastes them and the
            // background encodes them; blend, which recomputes injected KV,
            // encodes its few now.
            let encode_now = job.mode != Mode::Kv;
            let got = self.session.fetch_with(&job.user, &facts, read_now, encode_now)?;
            if got.report.loaded > 0 {
                self.metrics.kv_loaded(got.report.load_seconds);
            }
            retrieve.record("loaded", got.report.loaded as i64);
            sources = Some(FactSources {
                device: got.report.device_hits,
                host: got.report.host_hits,
                disk: got.report.loaded,
                prefilled: got.cold.len() + got.missing.len(),
            });
            if !got.cold.is_empty() {
                let jobs = self.session.memory_mut().read_jobs(&job.user, &got.cold)?;
                self.reader.read(jobs);
                cold = got.cold;
            }
            unencoded = got.missing;
            pinned = Some(got.pinned);
        }
        drop(entered);
        drop(retrieve);
        let wait = match self.cfg.cold_kv {
            ColdKv::Wait if !cold.is_empty() => self.cfg.cold_kv_wait,
            _ => Duration::ZERO,
        };
        let max_new = job.params.max_tokens.min(limit - prompt_len);
        let arrival = Arrival {
            job,
            events,
            tail,
            header,
            facts,
            memory_tokens,
            max_new,
            pinned,
            cold,
            unencoded,
            sources,
            arrived: t0,
            until: t0 + wait,
        };
        if wait.is_zero() {
            return self.queue(arrival);
        }
        self.waiting.push(arrival);
        Ok(())
    }

    /// Requests waiting for their cold facts' reads: those whose reads are
    /// all cached or whose wait is over go to the scheduler, with what is
    /// still cold pasted. Looks only when reads were cached since the last
    /// look (by `complete_reads`, wherever it ran) or a wait ran out.
    fn release_waiting(&mut self) {
        let now = Instant::now();
        let read = std::mem::take(&mut self.reads_cached);
        if self.waiting.is_empty() || (!read && self.waiting.iter().all(|a| a.until > now)) {
            return;
        }
        for mut a in std::mem::take(&mut self.waiting) {
            match self.session.fetch_with(&a.job.user, &a.cold, false, false) {
                Ok(got) => {
                    let read = a.cold.len() - got.cold.len();
                    if let Some(s) = a.sources.as_mut() {
                        s.disk += read;
                        s.prefilled -= read;
                    }
                    if let Some(p) = a.pinned.as_mut() {
                        p.extend(got.pinned);
                    }
                    a.cold = got.cold;
                    a.unencoded.extend(got.missing);
                }
                Err(e) => {
                    self.fail(&a.job.span, &a.events, e.into());
                    continue;
                }
            }
            if !a.cold.is_empty() && a.until > now {
                self.waiting.push(a);
                continue;
            }
            let (events, span) = (a.events.clone(), a.job.span.clone());
            if let Err(e) = self.queue(a) {
                self.fail(&span, &events, e);
            }
        }
    }

    /// Fails a request the protocol already answered for (it was accepted).
    fn fail(&self, span: &Span, events: &Events, e: WorkerError) {
        self.metrics.failed();
        span.record("otel.status_code", "error");
        let _ = events.send(Event::Failed(e));
    }

    /// Sizes a request and hands it to the scheduler; its still-cold facts
    /// are pasted.
    fn queue(&mut self, a: Arrival<B>) -> Result<()> {
        let Arrival {
            job,
            events,
            tail,
            header,
            facts,
            memory_tokens,
            max_new,
            pinned,
            cold,
            unencoded,
            sources,
            arrived,
            ..
        } = a;
        let paste: Vec<usize> = cold.into_iter().chain(unencoded).collect();
        let retrieve_ms = ms(arrived.elapsed());
        let all = if facts.is_empty() { &[][..] } else { self.session.memory().facts(&job.user)? };
        // A request that waited for reads retrieved these indices then; a
        // forget since fails it before this (`drop_unstarted`).
        if facts.iter().chain(&paste).any(|&i| i >= all.len()) {
            return Err(WorkerError::Forgotten(job.user.clone()));
        }
        let pasted_tokens: usize = paste.iter().map(|&i| all[i].tokens.len()).sum();
        let (computed, injected) = match job.mode {
            Mode::Kv | Mode::Blend => (tail.len() + pasted_tokens, memory_tokens - pasted_tokens),
            Mode::Prompt => (tail.len() + memory_tokens, 0),
            Mode::None => (tail.len(), 0),
        };
        // The configured header's full blocks are shared (the fork copies
        // its partial last block). A request's own system prompt may be
        // prefilled at layout (and its header evicted from the cache while
        // the request runs), so such a request holds blocks for all of it,
        // plus the fork's copy of its last block. The prefill runs outside
        // the scheduler's steps (`layout`), so it is not budgeted as compute.
        let header_blocks = match self.session.composer().is_default_header(&job.chat) {
            true => header % BLOCK_SIZE,
            false => header + BLOCK_SIZE,
        };
        // Blend runs injected tokens through the first layers, so the
        // scheduler budgets them like prompt tokens (an upper bound of the
        // pass's cost): exactly the rows `prepare` will plan.
        let recompute = match job.mode {
            Mode::Blend => blend_rows(memory_tokens, job.blend_ratio),
            _ => 0,
        };
        let id = self.next_id;
        self.next_id += 1;
        self.sched.submit(RequestSpec {
            id,
            user: job.user.clone(),
            prompt_tokens: computed,
            injected_tokens: injected + header_blocks,
            recompute_tokens: recompute,
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
                fact_ids: facts.iter().map(|&i| all[i].unit.id.clone()).collect(),
                memory_tokens,
                seq: None,
                generated: Vec::new(),
                text: TextStream::default(),
                finish: None,
                timings: Timings { retrieve_ms, ..Default::default() },
                admitted: None,
                phase,
                tail,
                header_tokens: header,
                header_cached: true,
                prefix_cached: 0,
                pinned,
                paste: paste.iter().map(|&i| all[i].unit.id.clone()).collect(),
                pasted_tokens,
                sources,
            },
        );
        Ok(())
    }

    /// Drops requests whose client went away or whose deadline passed;
    /// their blocks are free at once.
    fn reap(&mut self) {
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
            self.sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                if late && !l.events.is_closed() {
                    self.metrics.failed();
                    let ms = l.job.deadline.map_or(0, |d| d.as_millis() as u64);
                    l.job.span.record("otel.status_code", "error");
                    let _ = l.events.send(Event::Failed(WorkerError::Deadline(ms)));
                } else {
                    self.metrics.cancelled();
                }
            }
        }
        // Those waiting for reads, likewise.
        for a in std::mem::take(&mut self.waiting) {
            let late = a.job.deadline.is_some_and(|d| now > a.job.arrived + d);
            if a.events.is_closed() {
                self.metrics.cancelled();
            } else if late {
                let ms = a.job.deadline.map_or(0, |d| d.as_millis() as u64);
                self.fail(&a.job.span, &a.events, WorkerError::Deadline(ms));
            } else {
                self.waiting.push(a);
            }
        }
    }

    /// Fails `user`'s requests that were not laid out yet, with `why`: the
    /// facts they retrieved may be gone.
    fn drop_unstarted(&mut self, user: &str, why: fn(String) -> WorkerError) {
        let ids: Vec<RequestId> =
            self.live.iter().filter(|(_, l)| l.job.user == user && l.seq.is_none()).map(|(&id, _)| id).collect();
        for id in ids {
            self.sched.cancel(id);
            if let Some(l) = self.live.remove(&id) {
                self.metrics.failed();
                l.job.span.record("otel.status_code", "error");
                let _ = l.events.send(Event::Failed(why(user.to_string())));
            }
        }
        let (theirs, others) = std::mem::take(&mut self.waiting).into_iter().partition(|a| a.job.user == user);
        self.waiting = others;
        for a in theirs {
            self.fail(&a.job.span, &a.events, why(user.to_string()));
        }
    }

    /// Caches the KV the reader threads have read since the last call.
    fn complete_reads(&mut self) {
        for done in self.reader.finished() {
            self.metrics.kv_loaded(done.seconds);
            self.reads_cached = true;
            if let Err(e) = self.session.complete_read(done) {
                eprintln!("inferscale worker: caching KV read from disk: {e}");
            }
        }
    }

    /// While requests run: encodes stored facts' KV within the encoding
    /// share of the thread's time, in slices of about one step — or not
    /// at all while one fact takes longer than two steps (a CPU encoding a
    /// windowed fact), which waits for idle time (`throttle.rs`).
    fn encode_beside_serving(&mut self, step: Duration) {
        let n = self.encode_throttle.allowance(Instant::now(), true, step);
        if n == 0 {
            return;
        }
        let t = Instant::now();
        let done = match self.session.encode_pending(n) {
            Ok(done) => done,
            Err(e) => {
                eprintln!("inferscale worker: encoding stored facts beside serving: {e}");
                0
            }
        };
        if done > 0 {
            self.encode_throttle.done(Instant::now(), done, t.elapsed(), true);
        }
    }

    /// When idle: encodes a few facts still without KV (a replica's copy,
    /// an import without KV, an ingest stored while requests ran), in a
    /// slice a request that arrives need not wait long for. Returns
    /// whether it did any.
    fn encode_pending(&mut self) -> bool {
        let n = self.encode_throttle.allowance(Instant::now(), false, self.step_time.get());
        let t = Instant::now();
        match self.session.encode_pending(n) {
            Ok(done) => {
                if done > 0 {
                    self.encode_throttle.done(Instant::now(), done, t.elapsed(), false);
                }
                done > 0
            }
            Err(e) => {
                eprintln!("inferscale worker: encoding stored facts in the background: {e}");
                false
            }
        }
    }

    /// When idle, at most once a second: checks the next stored KV records'
    /// checksums (`Memory::scrub_step`), so that damage is found and
    /// re-encoded before a request needs that KV.
    fn scrub(&mut self) {
        if self.last_scrub.elapsed() < SCRUB_EVERY {
            return;
        }
        self.last_scrub = Instant::now();
        let failed = self.session.memory_mut().scrub_step(SCRUB_BYTES);
        if failed > 0 {
            eprintln!("inferscale worker: {failed} stored KV records failed their check; they are re-encoded");
        }
    }

    /// Lays out a newly admitted request: fork the header, inject or paste
    /// its facts, append the question, take what the prefix cache holds of
    /// its prompt. Returns the prompt tokens the prefix cache saved.
    fn layout(&mut self, id: RequestId) -> Result<usize> {
        let Some(l) = self.live.get_mut(&id) else { return Ok(0) };
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
                let all = self.session.memory().facts(&l.job.user)?;
                let by_id: HashMap<&str, usize> =
                    all.iter().enumerate().map(|(i, f)| (f.unit.id.as_str(), i)).collect();
                l.fact_ids
                    .iter()
                    .map(|f| by_id.get(f.as_str()).copied().ok_or_else(|| WorkerError::Forgotten(l.job.user.clone())))
                    .collect::<Result<Vec<usize>>>()?
            }
        };
        let paste: Vec<usize> =
            l.fact_ids.iter().zip(&facts).filter(|(id, _)| l.paste.contains(id)).map(|(_, &i)| i).collect();
        let p = self.session.prepare_pasting(
            &l.job.chat,
            &l.job.user,
            &facts,
            &paste,
            l.job.mode,
            l.job.blend_ratio,
            &l.tail,
        )?;
        if l.job.mode.injects() {
            self.metrics.memory_tokens(p.memory_tokens - p.pasted_tokens, p.pasted_tokens);
        }
        l.header_cached = p.header_cached;
        l.header_tokens = p.header_tokens;
        let mut seq = p.seq;
        // Every token of a prompt- or none-mode request is computed: its
        // prompt may start with blocks an earlier request computed.
        if matches!(l.job.mode, Mode::Prompt | Mode::None)
            && let Some(salt) = self.cfg.prefix_cache.salt(&l.job.user)
        {
            l.prefix_cached = self.session.engine_mut().reuse_prefix(&mut seq, salt);
            self.metrics.prefix_cache(seq.len().saturating_sub(l.header_tokens), l.prefix_cached);
        }
        // No wait for the device: the injection runs on the backend's side
        // stream and overlaps this step's forward, which waits for a layer's
        // injected KV only when it reaches that layer. Waiting here cost a
        // host-tier request the whole bus transfer before its step began.
        l.timings.inject_ms = ms(now.elapsed());
        l.phase = info_span!(parent: &l.job.span, "prefill", tokens = seq.pending() as i64);
        l.fact_ids = p.fact_ids;
        l.seq = Some(seq);
        // Injected: the cache may move or evict those facts now.
        l.pinned = None;
        Ok(l.prefix_cached)
    }

    /// One scheduler step: lay out, forward, sample, stream.
    fn step(&mut self) {
        // Requests are laid out as they are admitted, before the step is
        // planned: what the prefix cache holds of a prompt is not computed.
        let t0 = Instant::now();
        for id in self.sched.admit() {
            match self.layout(id) {
                Ok(cached) => self.sched.cached(id, cached),
                Err(e) => self.fail_running(id, e),
            }
        }
        let step = self.sched.plan();
        if step.is_empty() {
            return;
        }
        let mut failed: Vec<(RequestId, WorkerError)> = Vec::new();
        let t1 = self.profile.add(|p| &mut p.layout, t0);
        let items = &step.items;
        let mut ids = Vec::with_capacity(items.len());
        let mut takes = Vec::with_capacity(items.len());
        let mut greedy = Vec::with_capacity(items.len());
        let mut seqs: Vec<&mut Sequence> = Vec::with_capacity(items.len());
        let mut by_id: HashMap<RequestId, &mut Live<B>> = self.live.iter_mut().map(|(&id, l)| (id, l)).collect();
        for item in items {
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
        let logits = if seqs.is_empty() {
            Ok(Vec::new())
        } else {
            self.session.engine_mut().step_scheduled(&mut seqs, &takes, &greedy)
        };
        if !seqs.is_empty() {
            self.metrics.stepped(seqs.len(), forward.elapsed().as_secs_f64());
            self.step_time.observe(forward.elapsed());
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
            self.fail_running(id, e);
        }
        for id in self.sched.complete(&step, &finished) {
            self.finish(id);
        }
        self.profile.add(|p| &mut p.sample, t2);
    }

    /// Fails a request the scheduler admitted: its blocks are free at once.
    fn fail_running(&mut self, id: RequestId, e: WorkerError) {
        self.sched.cancel(id);
        if let Some(l) = self.live.remove(&id) {
            self.metrics.failed();
            l.job.span.record("otel.status_code", "error");
            let _ = l.events.send(Event::Failed(e));
        }
    }

    fn sample_one(&mut self, id: RequestId, next: NextToken) -> Result<()> {
        let limit = self.session.engine().model().config().max_position_embeddings;
        let eos = &self.eos;
        let tokenizer = self.session.tokenizer();
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
            && let Ok(rest) = l.text.finish(self.session.tokenizer(), &l.generated)
            && !rest.is_empty()
        {
            let _ = l.events.send(Event::Token { id: l.generated.last().copied().unwrap_or(0), text: rest });
        }
        let prompt = l.seq.as_ref().map_or(0, |s| s.len() - l.generated.len());
        l.timings.total_ms = ms(l.job.arrived.elapsed());
        // The first token ends the prefill; the decode makes the others.
        let decoded = l.generated.len().saturating_sub(1);
        self.metrics.decoded(l.job.mode, decoded, (l.timings.total_ms - l.timings.first_token_ms).max(0.0) / 1e3);
        self.metrics.completed(l.job.mode, prompt, l.generated.len(), l.timings.total_ms / 1e3);
        l.phase.record("tokens", l.generated.len() as i64);
        let reason = l.finish.unwrap_or(FinishReason::Length);
        l.job.span.record("finish_reason", finish_reason(reason));
        let usage = Usage {
            prompt_tokens: prompt,
            injected_tokens: if l.job.mode.injects() { l.memory_tokens - l.pasted_tokens } else { 0 },
            cached_tokens: l.prefix_cached + if l.header_cached { l.header_tokens } else { 0 },
            completion_tokens: l.generated.len(),
            facts: l.fact_ids.len(),
            recomputed_tokens: l.seq.as_ref().map_or(0, Sequence::recomputed),
            sources: l.sources,
        };
        self.metrics.recomputed(usage.recomputed_tokens);
        self.metrics.finished();
        let finished = Finished { reason, usage, timings: l.timings, fact_ids: l.fact_ids };
        let _ = l.events.send(Event::Finished(Box::new(finished)));
    }
}
