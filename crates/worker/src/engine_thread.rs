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
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use inferscale_engine::bert::Bert;
use inferscale_engine::kv_cache::BLOCK_SIZE;
use inferscale_engine::sampling::{History, Rng, logprobs, sample};
use inferscale_engine::{Backend, Engine, FinishReason, NextToken, Sequence, blend_rows};
use inferscale_memory::{Facts, Memory, Mode, Pinned, Session};
use inferscale_model::ModelFiles;
use tracing::{Span, field::Empty, info_span};

use crate::cold::{ColdCosts, Mean};
use crate::config::{AuditShare, ColdKv, WorkerConfig};
use crate::error::{Result, WorkerError};
use crate::kv_reader::KvReader;
use crate::metrics::WorkerMetrics;
use crate::protocol::{
    Change, Command, Event, Events, FactSources, Finished, GenerateJob, Load, Logprobs, MemoryHost, Protocol,
    ProtocolConfig, Shard, Timings, TokenLogprob, Usage, finish_reason,
};
use crate::scheduler::{RequestId, RequestSpec, Scheduler, SchedulerConfig};
use crate::text::{Delta, TextStream};
use crate::throttle::{BACKGROUND_SHARE, RECENTLY_BUSY, StepTime, Throttle};
use inferscale_types::Refusal;

mod admission;
mod audit;
mod idle;
mod layout;
mod step;

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
    /// Sampled for the answer-quality audit (`audit.rs`): the retrieved
    /// facts, best first, until its first token's logits are queued.
    audit: Option<Vec<String>>,
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
/// sizing; of it, the question's embedding and ranking, and the lookup of
/// the retrieved facts' KV with their cold reads queued), layout (header
/// fork and injection), the forward pass with sampling's device part, and
/// the host's sampling and streaming.
#[derive(Default)]
struct Profile {
    on: bool,
    since: Option<Instant>,
    steps: u64,
    rows: u64,
    commands: Duration,
    retrieval: Duration,
    lookup: Duration,
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
            "inferscale worker profile: {:.1} steps/s, {:.1} rows/step; commands {:.0}% (retrieval {:.0}%, KV lookup {:.0}%) layout {:.0}% forward {:.0}% sample+stream {:.0}% (ms/step: forward {:.2})",
            self.steps as f64 / wall.as_secs_f64(),
            self.rows as f64 / self.steps.max(1) as f64,
            pct(self.commands),
            pct(self.retrieval),
            pct(self.lookup),
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
    audit_share: Arc<AuditShare>,
    rx: Receiver<Command>,
    metrics: Arc<WorkerMetrics>,
) -> Result<()> {
    let WorkerParts { files, engine, embedder, mut memory, eos } = parts;
    if files.tokenizer.is_none() {
        return Err(WorkerError::Startup("the model has no tokenizer".into()));
    }
    memory.set_encode_batch(cfg.ingest_batch);
    if cfg.kv_warm_restart
        && let Some(w) = memory.load_resident()
    {
        eprintln!("inferscale worker: warning: {w}");
    }
    let warm_reported = memory.warm_left() == 0;
    let session = Session::new(Arc::new(files), engine, embedder, memory, &cfg.prompts)?;
    let engine = session.engine();
    // Ingest's encodings hold blocks the scheduler never hands to requests.
    let reserve = (cfg.ingest_batch * cfg.ingest_tokens_per_unit).div_ceil(BLOCK_SIZE);
    let free = engine.pool().free_blocks();
    let total_blocks = free.checked_sub(reserve).filter(|&n| n > 0).ok_or_else(|| {
        WorkerError::Startup(format!(
            "the KV cache has {free} free blocks after the header; ingest needs {reserve}: give it more memory"
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
    let reader = KvReader::start(cfg.kv_readers)
        .map_err(|e| WorkerError::Startup(format!("starting the KV reader threads: {e}")))?;
    let mut core = Core {
        session,
        eos,
        cfg,
        sched,
        live: HashMap::new(),
        next_id: 0,
        metrics,
        profile: Profile {
            on: std::env::var("INFERSCALE_WORKER_PROFILE").is_ok_and(|v| v == "1"),
            ..Default::default()
        },
        reader,
        arrivals: Vec::new(),
        waiting: Vec::new(),
        reads_cached: false,
        step_time: StepTime::default(),
        // An ingest a client waits for progresses; encodings may wait for idle.
        ingest_throttle: Throttle::new(BACKGROUND_SHARE, cfg_ingest_batch, true),
        encode_throttle: Throttle::new(BACKGROUND_SHARE, cfg_ingest_batch, false),
        last_busy: Instant::now() - RECENTLY_BUSY,
        last_scrub: Instant::now(),
        last_resident_save: Instant::now(),
        warm_reported,
        audits: audit::Audits::new(audit_share),
        read_s: Mean::default(),
        prefill_s_per_token: Mean::default(),
    };
    'serve: loop {
        core.complete_reads();
        core.start_background_reads();
        core.release_waiting();
        // Idle-time encoding waits until no request ran for a moment.
        let quiet = core.last_busy.elapsed() >= RECENTLY_BUSY;
        let idle = core.live.is_empty() && !protocol.ingesting();
        if idle && quiet {
            core.save_resident(false);
            // Audits first: each is one prefill, and its logits wait in memory.
            match core.audit_some(false) || core.encode_pending() || core.open_users() {
                // Background work done; look for commands before more of it.
                true => match rx.try_recv() {
                    Ok(c) => {
                        dispatch(&mut protocol, &mut core, c);
                        core.admit_arrivals();
                    }
                    Err(TryRecvError::Empty) => continue,
                    Err(TryRecvError::Disconnected) => break 'serve,
                },
                false => core.scrub(),
            }
        }
        let idle = core.live.is_empty() && !protocol.ingesting();
        let first = if idle {
            // Requests waiting for reads are looked at again soon.
            // So are reads in flight and a warm-up's next ones.
            let nap = match core.waiting.is_empty() && !core.reading() {
                true => Duration::from_millis(500),
                false => Duration::from_millis(2),
            };
            match rx.recv_timeout(nap) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break 'serve,
            }
        } else {
            None
        };
        let t0 = Instant::now();
        if let Some(c) = first {
            dispatch(&mut protocol, &mut core, c);
        }
        loop {
            match rx.try_recv() {
                Ok(c) => dispatch(&mut protocol, &mut core, c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => break 'serve,
            }
        }
        core.admit_arrivals();
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
        core.audit_some(busy);
        core.step();
    }
    core.save_resident(true);
    Ok(())
}

/// Hands a command to the protocol. Generate requests wait in
/// [`Core::arrivals`] to be retrieved for together; any other command
/// admits them first, so that commands still take effect in the order they
/// arrived (a request sent before a forget retrieves before it).
fn dispatch<B: Backend>(protocol: &mut Protocol, core: &mut Core<B>, c: Command) {
    if !matches!(c, Command::Generate { .. }) {
        core.admit_arrivals();
    }
    protocol.handle(core, c);
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
    /// Requests the protocol accepted in this loop turn, retrieved for
    /// together (`admit_arrivals`).
    arrivals: Vec<(GenerateJob, Events)>,
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
    /// When the tiers' resident facts were last saved (`idle.rs`).
    last_resident_save: Instant,
    /// Whether the warm-up's end was logged (or there was none to do).
    warm_reported: bool,
    /// The answer-quality audit's sampling and queue.
    audits: audit::Audits,
    /// Running means for `ColdKv::Auto`: one read on a reader thread, and
    /// one prefilled token (from steps of at least [`PREFILL_SAMPLE_TOKENS`]).
    read_s: Mean,
    prefill_s_per_token: Mean,
}

/// Steps this long or longer in tokens measure the prefill rate.
const PREFILL_SAMPLE_TOKENS: usize = 32;

/// The idle-time scrub's pace: this many bytes of KV records a second.
const SCRUB_BYTES: u64 = 16 << 20;
const SCRUB_EVERY: Duration = Duration::from_secs(1);

/// The native engine's side of the protocol: the shard is this thread's,
/// and generation is this thread's scheduler and engine.
impl<B: Backend> MemoryHost for Core<B> {
    /// The request waits in [`Core::arrivals`] until the commands that
    /// arrived with it are handled ([`dispatch`]).
    fn generate(&mut self, job: GenerateJob, events: Events) -> Result<()> {
        self.arrivals.push((job, events));
        Ok(())
    }

    fn load(&self) -> Load {
        Load {
            running: self.sched.running(),
            waiting: self.sched.waiting() + self.waiting.len() + self.arrivals.len(),
            kv_blocks_total: self.session.engine().pool().total_blocks(),
            kv_blocks_free: self.session.engine().pool().free_blocks(),
            max_queue: self.cfg.max_queue,
        }
    }

    fn with_shard<T>(&mut self, f: impl FnOnce(&mut dyn Shard) -> Result<T>) -> Result<T> {
        f(&mut self.session)
    }

    /// Requests that retrieved from the memory and are not laid out yet
    /// fail: as forgotten when units went away, as moving when the user's
    /// copy was replaced or dropped. Writes leave them be: they are laid
    /// out from the memory as it is then.
    fn memory_changed(&mut self, user: &str, change: Change) {
        match change {
            Change::Written => {}
            Change::Removed => self.drop_unstarted(user, WorkerError::Forgotten),
            Change::Moved => self.drop_unstarted(user, WorkerError::Moving),
        }
    }
}
