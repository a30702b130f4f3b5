//! The worker gRPC API of a vLLM-mode worker, served from background
//! threads of the connector's core, so that a router talks to a vLLM
//! worker exactly as to a native one.
//!
//! The service and its protocol are the worker crate's (the same calls,
//! checks, shard transfers and metrics); this file is only vLLM's
//! [`MemoryHost`]. Memory calls (ingest, list, forget, shard
//! export/import) run on the core's shard, one command at a time on the
//! protocol's thread, taking the core's lock for one ingest batch at a
//! time so that vLLM's loads (which take it on vLLM's thread) wait at most
//! that long.
//! Generate composes the memory layout here and hands the prompt to the
//! co-located vLLM server ([`crate::relay`]), whose connector then loads
//! the plan back from this same core.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use inferscale_model::ModelFiles;
use inferscale_worker::Result as WResult;
use inferscale_worker::metrics::WorkerMetrics;
use inferscale_worker::{
    AdmitError, Change, Events, GenerateJob, Load, MemoryHost, ProtocolConfig, Shard, WorkerError, WorkerInfo,
    WorkerService,
};
use tokio::sync::oneshot;

use crate::error::{ConnectorError, Result};
use crate::memory_core::AnyCore;
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
    /// Most units one ingest request may carry.
    pub max_ingest_units: usize,
    /// Names `/v1/embeddings` may call the retrieval encoder by
    /// (`inferscale_model::fetch::served_names`).
    pub embedder: Vec<String>,
    /// Mutual TLS for the API (`None`: plaintext).
    pub tls: Option<inferscale_worker::TlsFiles>,
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
            max_ingest_units: inferscale_worker::MAX_INGEST_UNITS,
            embedder: inferscale_model::fetch::served_names(inferscale_model::fetch::DEFAULT_EMBEDDER),
            tls: None,
        }
    }
}

/// What the command thread and the relay tasks share.
pub(crate) struct Shared {
    pub(crate) core: Arc<Mutex<AnyCore>>,
    pub(crate) cfg: FrontConfig,
    /// The model's files (the tokenizer), read without the core's lock.
    pub(crate) files: Arc<ModelFiles>,
    /// The model's end-of-sequence ids.
    pub(crate) eos: Vec<u32>,
    /// Generate requests handed to vLLM and not yet seen end.
    pub(crate) in_flight: AtomicUsize,
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
    // TLS files are read and checked before anything binds.
    let security = inferscale_worker::Security::from_files(cfg.tls.as_ref())
        .map_err(|e| ConnectorError::Invalid { what: "TLS settings", reason: e.to_string() })?;
    let listener = std::net::TcpListener::bind(cfg.listen).map_err(|e| io(&format!("binding {}", cfg.listen), e))?;
    listener.set_nonblocking(true).map_err(|e| io("configuring the gRPC listener", e))?;
    let addr = listener.local_addr().map_err(|e| io("reading the bound address", e))?;
    let (files, backend) = {
        let g = core.lock().map_err(|_| ConnectorError::Unsupported("the core was poisoned by a panic".into()))?;
        (each!(&*g, c => c.files().clone()), g.backend_name())
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
    let info = WorkerInfo {
        model: cfg.served_model.clone(),
        backend: format!("vllm+{backend}"),
        embedder: cfg.embedder.clone(),
    };
    let eos = files.eos_ids();
    let protocol =
        ProtocolConfig { max_k: cfg.max_k, ingest_batch: cfg.ingest_batch, max_ingest_units: cfg.max_ingest_units };
    let shared = Arc::new(Shared { core, cfg, files, eos, in_flight: AtomicUsize::new(0) });
    let relay = Relay::new(shared.clone(), runtime.handle().clone())?;
    let (service, _commands) =
        inferscale_worker::spawn_host(move |metrics| Ok(Host { shared, relay, metrics }), protocol, info)
            .map_err(|e| ConnectorError::Unsupported(e.to_string()))?;
    let service = service.with_security(security);
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
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
    let stopped = async {
        let _ = stopped.await;
    };
    service.serve(listener, stopped).await.map_err(|e| e.to_string())
}

/// The connector's errors as the worker API reports them.
pub(crate) fn worker_error(e: ConnectorError) -> WorkerError {
    match e {
        ConnectorError::Memory(m) => m.into(),
        ConnectorError::Engine(e) => e.into(),
        ConnectorError::Model(e) => e.into(),
        ConnectorError::Invalid { what, reason } => WorkerError::InvalidMemory { what, reason },
        other => WorkerError::Internal(other.to_string()),
    }
}

/// vLLM's side of the worker protocol: the shard is the core's (behind
/// its lock, which vLLM's loads also take), and generation is relayed to
/// the co-located vLLM server.
struct Host {
    shared: Arc<Shared>,
    relay: Relay,
    metrics: Arc<WorkerMetrics>,
}

impl MemoryHost for Host {
    /// vLLM computes the prompt in its own forward pass, which our blend
    /// cannot reach into.
    fn blends(&self) -> bool {
        false
    }

    fn generate(&mut self, job: GenerateJob, events: Events) -> WResult<()> {
        // vLLM's log-probabilities would need their own relay; refused,
        // never silently dropped.
        if job.params.logprobs.is_some() {
            return Err(inferscale_types::Refusal::new(
                "logprobs",
                "log-probabilities need the native engine; this worker serves with vLLM",
            )
            .into());
        }
        let in_flight = self.shared.in_flight.load(Ordering::SeqCst);
        if in_flight >= self.shared.cfg.max_in_flight {
            return Err(AdmitError::QueueFull(in_flight).into());
        }
        self.relay.spawn(job, events, self.metrics.clone());
        Ok(())
    }

    fn load(&self) -> Load {
        // vLLM owns the running batch, its queue and its cache: what this
        // worker knows is what it has handed vLLM and not yet seen end.
        Load {
            running: self.shared.in_flight.load(Ordering::Relaxed),
            max_queue: self.shared.cfg.max_in_flight,
            ..Load::default()
        }
    }

    /// The core's session, under the lock vLLM's loads also take.
    fn with_shard<T>(&mut self, f: impl FnOnce(&mut dyn Shard) -> WResult<T>) -> WResult<T> {
        let mut g = self.shared.lock()?;
        each!(&mut *g, c => f(c.session_mut()))
    }

    /// A new memory generation for the user: vLLM's cached blocks of the
    /// old memory are never hit again. Requests already handed to vLLM
    /// carry their plans; vLLM holds no request between retrieval and
    /// layout, so there is none to fail.
    fn memory_changed(&mut self, user: &str, _change: Change) {
        match self.shared.lock() {
            Ok(mut g) => each!(&mut *g, c => c.memory_changed(user)),
            Err(e) => eprintln!("inferscale-vllm: {user}'s memory changed, but the core is unavailable: {e}"),
        }
    }
}
