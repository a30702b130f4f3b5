//! The worker gRPC API of a vLLM-mode worker, served from background
//! threads of the connector's core, so that a router talks to a vLLM
//! worker exactly as to a native one.
//!
//! The service itself is the worker crate's (the same calls, checks,
//! shard transfers and metrics); only what carries its commands out
//! differs. Memory calls (ingest, list, forget, shard export/import)
//! run here on the core's shard, one command at a time on the command
//! thread, taking the core's lock for a few units at a time so that
//! vLLM's loads (which take it on vLLM's thread) wait at most that long.
//! Generate composes the memory layout here and hands the prompt to the
//! co-located vLLM server ([`crate::relay`]), whose connector then loads
//! the plan back from this same core.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use inferscale_memory::{Fact, Memory, MemoryError, Turn};
use inferscale_model::ModelFiles;
use inferscale_worker::core::{Command, Event, Moves, ShardCommand, Stats};
use inferscale_worker::error::{Result as WResult, WorkerError};
use inferscale_worker::metrics::WorkerMetrics;
use inferscale_worker::scheduler::AdmitError;
use inferscale_worker::{WorkerInfo, WorkerService};
use tokio::sync::oneshot;

use crate::core::AnyCore;
use crate::error::{ConnectorError, Result};
use crate::relay::Relay;

/// How the front serves.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// gRPC address of the worker API.
    pub listen: SocketAddr,
    /// The co-located vLLM server's OpenAI-compatible API, `http://host:port`.
    pub vllm_url: String,
    /// The model name that server serves (the `model` of its requests and
    /// of health answers).
    pub served_model: String,
    /// Largest `k` a request may ask for.
    pub max_k: usize,
    /// Generate requests in flight (at vLLM) beyond which new ones are
    /// refused (`RESOURCE_EXHAUSTED`), as a native worker's queue bound.
    pub max_in_flight: usize,
    /// Units encoded per hold of the core's lock during an ingest.
    pub ingest_batch: usize,
}

impl FrontConfig {
    pub fn new(listen: SocketAddr, vllm_url: &str, served_model: &str) -> FrontConfig {
        FrontConfig {
            listen,
            vllm_url: vllm_url.trim_end_matches('/').to_string(),
            served_model: served_model.to_string(),
            max_k: 200,
            max_in_flight: 256,
            ingest_batch: 4,
        }
    }
}

/// Request counters of the front (a native worker keeps the same).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) in_flight: AtomicUsize,
    pub(crate) finished: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) failed: AtomicU64,
}

/// What the command thread and the relay tasks share.
pub(crate) struct Shared {
    pub(crate) core: Arc<Mutex<AnyCore>>,
    pub(crate) cfg: FrontConfig,
    /// The model's files (the tokenizer), for the process's life.
    pub(crate) files: &'static ModelFiles,
    /// The model's end-of-sequence ids.
    pub(crate) eos: Vec<u32>,
    /// The context window the shard's KV is encoded with (fixed per shard).
    pub(crate) window: usize,
    pub(crate) counters: Counters,
}

impl Shared {
    pub(crate) fn lock(&self) -> WResult<MutexGuard<'_, AnyCore>> {
        self.core.lock().map_err(|_| WorkerError::Internal("the connector's core was poisoned by a panic".into()))
    }
}

/// A running front; dropping it stops the gRPC server (the core lives on
/// with the process).
pub struct Front {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

impl Front {
    /// The bound gRPC address (the listen address with its port resolved).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

/// Serves the worker API for `core` on `cfg.listen`. Returns once the
/// port is bound (a bind error is returned, not logged).
pub fn serve(core: Arc<Mutex<AnyCore>>, cfg: FrontConfig) -> Result<Front> {
    let io = |what: &str, source| ConnectorError::Io { what: what.to_string(), source };
    let listener = std::net::TcpListener::bind(cfg.listen).map_err(|e| io(&format!("binding {}", cfg.listen), e))?;
    listener.set_nonblocking(true).map_err(|e| io("configuring the gRPC listener", e))?;
    let addr = listener.local_addr().map_err(|e| io("reading the bound address", e))?;
    let (files, window, backend) = {
        let g = core.lock().map_err(|_| ConnectorError::Unsupported("the core was poisoned by a panic".into()))?;
        (each!(&*g, c => c.files()), each!(&*g, c => c.memory().spec().window), g.backend_name())
    };
    if files.tokenizer.is_none() {
        return Err(ConnectorError::Unsupported("the model has no tokenizer to render prompts and answers".into()));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("inferscale-front")
        .enable_all()
        .build()
        .map_err(|e| io("starting the front's async runtime", e))?;
    let info = WorkerInfo { model: cfg.served_model.clone(), backend: format!("vllm+{backend}") };
    let eos = files.eos_ids();
    let shared = Arc::new(Shared { core, cfg, files, eos, window, counters: Counters::default() });
    let relay = Relay::new(shared.clone(), runtime.handle().clone())?;
    let (service, _commands) =
        inferscale_worker::spawn_handler(move |rx, metrics| run(&shared, &relay, rx, metrics), info)
            .map_err(|e| ConnectorError::Unsupported(e.to_string()))?;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = std::thread::Builder::new()
        .name("inferscale-grpc".into())
        .spawn(move || {
            if let Err(e) = runtime.block_on(grpc(listener, service, stopped)) {
                eprintln!("inferscale-vllm: the worker API stopped: {e}");
            }
        })
        .map_err(|e| io("starting the gRPC thread", e))?;
    Ok(Front { addr, stop: Some(stop), server: Some(server) })
}

async fn grpc(
    listener: std::net::TcpListener,
    service: WorkerService,
    stopped: oneshot::Receiver<()>,
) -> std::result::Result<(), String> {
    use tokio_stream::StreamExt;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
    // Token events are small writes: without TCP_NODELAY, Nagle's
    // algorithm holds each one until the peer's delayed ACK (~40 ms).
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        s.inspect(|tcp| {
            let _ = tcp.set_nodelay(true);
        })
    });
    tonic::transport::Server::builder()
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        })
        .await
        .map_err(|e| e.to_string())
}

/// The connector's errors as the worker API reports them.
pub(crate) fn worker_error(e: ConnectorError) -> WorkerError {
    match e {
        ConnectorError::Memory(m) => m.into(),
        ConnectorError::Engine(e) => e.into(),
        ConnectorError::Model(e) => e.into(),
        ConnectorError::Invalid { what, reason } => WorkerError::Invalid(format!("invalid {what}: {reason}")),
        other => WorkerError::Internal(other.to_string()),
    }
}

/// The command thread: carries out the service's commands until every
/// clone of the service is gone.
fn run(shared: &Shared, relay: &Relay, rx: Receiver<Command>, metrics: Arc<WorkerMetrics>) -> WResult<()> {
    let mut moves = Moves::default();
    while let Ok(command) = rx.recv() {
        match command {
            Command::Generate { job, events } => {
                let admitted = moves.check_read(&job.user).and_then(|()| admit(shared, &job));
                match admitted {
                    Ok(()) => relay.spawn(job, events, metrics.clone()),
                    Err(e) => {
                        shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                        let _ = events.send(Event::Failed(e));
                    }
                }
            }
            Command::Ingest { user, window, units, defer_kv, reply } => {
                let r = check_window(shared, window)
                    .and_then(|()| Ok(Memory::<inferscale_engine::CpuBackend>::validate(&user, &units)?))
                    .and_then(|()| moves.check_write(&user))
                    .and_then(|()| ingest(shared, &user, &units, defer_kv));
                let _ = reply.send(r);
            }
            Command::List { user, reply } => {
                let r = shared.lock().and_then(|g| {
                    let units: Vec<Turn> = each!(&*g, c => c.memory().facts(&user)?.iter().map(Fact::unit).collect());
                    Ok((units, shared.window))
                });
                let _ = reply.send(r);
            }
            Command::Forget { user, unit, reply } => {
                let r = moves.check_write(&user).and_then(|()| forget(shared, &user, unit));
                let _ = reply.send(r);
            }
            Command::Stats { memory_bytes, reply } => {
                if let Ok(s) = stats(shared, memory_bytes) {
                    let _ = reply.send(s);
                }
            }
            Command::Shard(c) => shard(shared, &mut moves, c),
        }
    }
    Ok(())
}

fn check_window(shared: &Shared, window: Option<usize>) -> WResult<()> {
    let ours = shared.window;
    match window {
        Some(w) if w != ours => Err(WorkerError::Invalid(format!(
            "window {w}: this worker's memory is encoded with a context window of {ours} turns"
        ))),
        _ => Ok(()),
    }
}

/// The checks a native worker makes at admission, before vLLM sees anything.
fn admit(shared: &Shared, job: &inferscale_worker::core::GenerateJob) -> WResult<()> {
    check_window(shared, job.window)?;
    job.params.validate()?;
    if job.params.max_tokens == 0 {
        return Err(WorkerError::Invalid("max_tokens must be at least 1".into()));
    }
    if job.question.trim().is_empty() {
        return Err(WorkerError::Invalid("the question (last user message) is empty".into()));
    }
    if job.k > shared.cfg.max_k {
        return Err(WorkerError::Invalid(format!("k = {} is more than this worker's {}", job.k, shared.cfg.max_k)));
    }
    let in_flight = shared.counters.in_flight.load(Ordering::SeqCst);
    if in_flight >= shared.cfg.max_in_flight {
        return Err(AdmitError::QueueFull(in_flight).into());
    }
    Ok(())
}

/// Stores `units` a few at a time (the lock is released between batches);
/// on a failure, says how many of the request's units are stored.
fn ingest(shared: &Shared, user: &str, units: &[Turn], defer_kv: bool) -> WResult<inferscale_memory::IngestReport> {
    let mut report = inferscale_memory::IngestReport::default();
    for batch in units.chunks(shared.cfg.ingest_batch.max(1)) {
        let r = each!(&mut *shared.lock()?, c => c.ingest_with(user, batch, defer_kv));
        match r {
            Ok(r) => {
                report.added += r.added;
                report.skipped += r.skipped;
                report.encoded_tokens += r.encoded_tokens;
            }
            Err(e) => {
                return Err(match worker_error(e) {
                    WorkerError::Memory(m) if report.added > 0 => WorkerError::Invalid(format!(
                        "{m} (the first {} units of this request are stored)",
                        report.added
                    )),
                    e => e,
                });
            }
        }
    }
    Ok(report)
}

fn forget(shared: &Shared, user: &str, unit: Option<String>) -> WResult<()> {
    let r = each!(&mut *shared.lock()?, c => c.forget(user, unit.as_deref()));
    r.map_err(|e| match (e, unit) {
        (ConnectorError::Memory(MemoryError::Invalid { .. }), Some(id)) => {
            WorkerError::UnknownUnit { user: user.to_string(), id }
        }
        (e, _) => worker_error(e),
    })
}

fn stats(shared: &Shared, memory_bytes: bool) -> WResult<Stats> {
    let g = shared.lock()?;
    let n = &shared.counters;
    let mut s = Stats {
        // vLLM owns the running batch, its queue and its cache: what this
        // worker knows is what it has handed vLLM and not yet seen end.
        running: n.in_flight.load(Ordering::Relaxed),
        finished: n.finished.load(Ordering::Relaxed),
        cancelled: n.cancelled.load(Ordering::Relaxed),
        failed: n.failed.load(Ordering::Relaxed),
        max_queue: shared.cfg.max_in_flight,
        window: shared.window,
        ..Default::default()
    };
    each!(&*g, c => {
        let m = c.memory();
        s.users = m.users().count();
        s.facts = m.users().map(|u| m.facts(u).map_or(0, <[_]>::len)).sum();
        if memory_bytes {
            let f = m.footprint();
            s.kv_resident_bytes = f.kv_resident_bytes;
            s.kv_host_tier_bytes = f.kv_host_tier_bytes;
            s.disk_bytes = f.disk_bytes;
        }
    });
    Ok(s)
}

/// Shard moves, as a native worker carries them out (its `core::moves`):
/// ingests run to completion on this thread, so a freeze sees them all.
fn shard(shared: &Shared, moves: &mut Moves, c: ShardCommand) {
    match c {
        ShardCommand::ListUsers { reply } => {
            let users = shared
                .lock()
                .map(|g| each!(&*g, c => c.memory().users().map(str::to_string).collect()))
                .unwrap_or_default();
            let _ = reply.send(users);
        }
        ShardCommand::ExportBegin { user, reply } => {
            let r = shared.lock().and_then(|g| {
                each!(&*g, c => match c.memory().has_user(&user) {
                    true => Ok((c.memory().kv_header().clone(), c.memory().fact_ids(&user))),
                    false => Err(WorkerError::UnknownUser(user)),
                })
            });
            let _ = reply.send(r);
        }
        ShardCommand::Export { user, ids, with_kv, max_bytes, reply } => {
            let r = shared
                .lock()
                .and_then(|g| each!(&*g, c => c.export(&user, &ids, with_kv, max_bytes)).map_err(worker_error));
            let _ = reply.send(r);
        }
        ShardCommand::Freeze { user, reply } => {
            moves.freeze(&user);
            let ids = shared.lock().map(|g| each!(&*g, c => c.memory().fact_ids(&user))).unwrap_or_default();
            let _ = reply.send(ids);
        }
        ShardCommand::ImportTarget { reply } => {
            if let Ok(g) = shared.lock() {
                let _ = reply.send(each!(&*g, c => c.import_target()));
            }
        }
        ShardCommand::CommitImport { user, staged, reply } => {
            let r = shared
                .lock()
                .and_then(|mut g| each!(&mut *g, c => c.commit_import(&user, staged)).map_err(worker_error));
            if r.is_ok() {
                moves.imported(&user);
            }
            let _ = reply.send(r);
        }
        ShardCommand::Release { user, drop, reply } => {
            moves.release(&user, drop);
            let r = match drop {
                false => Ok(()),
                true => shared.lock().and_then(|mut g| {
                    each!(&mut *g, c => match c.memory().has_user(&user) {
                        true => c.forget(&user, None).map_err(worker_error),
                        false => Ok(()),
                    })
                }),
            };
            let _ = reply.send(r);
        }
    }
}
