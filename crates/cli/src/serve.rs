//! `inferscale serve`, `inferscale worker` and `inferscale router`: the
//! serving processes. `serve` runs a router and one worker in one process
//! (the worker's gRPC on an ephemeral loopback port), for one machine, with
//! the embedded placement store; `worker` and `router` given `--etcd` form
//! a cluster (docs/cluster.md), or the router takes a fixed `--worker` list.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use inferscale_cluster::Placement;
use inferscale_cluster::etcd::{Etcd, EtcdOptions, EtcdTlsFiles};
use inferscale_cluster::membership::Registration;
use inferscale_cluster::view::{GpuId, Member, MemberState};
use inferscale_engine::Backend;
use inferscale_memory::Mode;
use inferscale_router::{Defaults, Keys, Membership, RebalanceConfig, RouterConfig, Security, TlsFiles};
use inferscale_worker::{ColdKv, PrefixCache, WorkerConfig, WorkerError, WorkerInfo, WorkerParts, WorkerService};
use tokio::net::TcpListener;

use crate::memory_cmd::{MemoryArgs, open_memory};
use crate::runtime::load_on;

/// Most facts a chat request may ask for (`memory.k`).
const MAX_K: u32 = 200;

#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub(crate) mem: MemoryArgs,
    /// Requests running at once.
    #[arg(long, env = "INFERSCALE_MAX_RUNNING", default_value_t = 64)]
    pub(crate) max_running: usize,
    /// Requests waiting beyond which new ones are refused (HTTP 429).
    #[arg(long, env = "INFERSCALE_MAX_QUEUE", default_value_t = 256)]
    pub(crate) max_queue: usize,
    /// Largest `k` a request may ask for.
    #[arg(long, env = "INFERSCALE_MAX_K", default_value_t = 200)]
    pub(crate) max_k: u32,
    /// Most memory units one ingest request may carry (HTTP 400 beyond): an
    /// ingest is answered once all of it is stored, so this bounds its work.
    #[arg(long, env = "INFERSCALE_MAX_INGEST_UNITS", default_value_t = inferscale_worker::MAX_INGEST_UNITS)]
    pub(crate) max_ingest_units: usize,
    /// What a kv-mode request does with retrieved facts whose KV is on disk
    /// only (not cached in the device or host tier): `prefill` them as text
    /// with the question while their KV is read for the next request (never
    /// a wait for the disk), `read` them on the engine thread before the
    /// request runs, `wait` up to --cold-kv-wait-ms for the reader threads'
    /// reads (outside the engine) and prefill what is still unread, or
    /// `auto` (the default): per request, wait for the reads that cost less
    /// than their prefill (from measured read and prefill times, the
    /// readers' queue, and the sequences a prefill would slow), up to
    /// --cold-kv-wait-ms, and prefill the rest; before anything is measured
    /// it waits, as `wait` does.
    #[arg(long, env = "INFERSCALE_COLD_KV", default_value = "auto", value_parser = parse_cold_kv)]
    pub(crate) cold_kv: ColdKv,
    /// With --cold-kv wait or auto: the most a request waits for its facts' reads.
    #[arg(long, env = "INFERSCALE_COLD_KV_WAIT_MS", default_value_t = inferscale_worker::COLD_KV_WAIT.as_millis() as u64)]
    pub(crate) cold_kv_wait_ms: u64,
    /// Threads that read facts' KV from disk (reads in flight at once; an
    /// NVMe drive serves several in parallel): more let more of a request's
    /// cold facts arrive within --cold-kv-wait-ms instead of being prefilled.
    #[arg(long, env = "INFERSCALE_KV_READERS", default_value_t = inferscale_worker::KV_READERS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub(crate) kv_readers: usize,
    /// Save which facts the KV tiers hold when the server stops (and every
    /// minute while idle), in the memory directory's `resident` file, and
    /// read them back after a start on reader threads requests leave free,
    /// so that a restart's first requests find the popular facts resident
    /// (docs/serving.md, "Restarts"). `false` (the default): every start
    /// is cold.
    #[arg(long, env = "INFERSCALE_KV_WARM_RESTART", default_value_t = false, action = clap::ArgAction::Set)]
    pub(crate) kv_warm_restart: bool,
    /// Which prompt- and none-mode requests may reuse each other's computed
    /// prompt blocks: `user` (one user's own earlier prompts only, so that
    /// timing reveals nothing of other users'; the default), `shared` (any
    /// request's), or `off` (the default of `bench serve`, whose clients
    /// repeat one question).
    #[arg(long, env = "INFERSCALE_PREFIX_CACHE", value_parser = parse_prefix_cache)]
    pub(crate) prefix_cache: Option<PrefixCache>,
    /// Share of kv and blend requests (0 to 1) whose first token is also
    /// computed as prompt mode would, in the engine's spare time, and the
    /// two compared: first-token KL and top-1 agreement as metrics and trace
    /// attributes (docs/serving.md, "Auditing kv mode's answers"). 0: none.
    #[arg(long, env = "INFERSCALE_AUDIT_SHARE", default_value_t = 0.0, value_parser = parse_share)]
    pub(crate) audit_share: f64,
}

#[derive(Args, Debug, Clone)]
pub struct RouterArgs {
    /// File of API keys, one `tenant:key` per line. Also `INFERSCALE_API_KEYS=tenant:key,…`.
    #[arg(long, env = "INFERSCALE_API_KEYS_FILE")]
    api_keys: Option<PathBuf>,
    /// Memory mode when a request does not say (kv, blend, prompt, none).
    #[arg(long, env = "INFERSCALE_DEFAULT_MODE", value_enum, default_value_t = Mode::Kv)]
    default_mode: Mode,
    /// Blend ratio (share of injected tokens recomputed, 0..=1) when a
    /// blend request does not say.
    #[arg(long, env = "INFERSCALE_DEFAULT_BLEND_RATIO", default_value_t = inferscale_types::DEFAULT_BLEND_RATIO,
          value_parser = crate::runtime::blend_ratio)]
    default_blend_ratio: f32,
    /// Facts retrieved when a request does not say (1–200, the API's range).
    #[arg(long, env = "INFERSCALE_DEFAULT_K", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=MAX_K as i64))]
    default_k: u32,
    /// Tokens generated when a request does not say (at least 1).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    default_max_tokens: u32,
    /// Deadline of every worker call, in seconds.
    #[arg(long, env = "INFERSCALE_DEADLINE_S", default_value_t = 120)]
    deadline_s: u64,
    /// Deadline of an ingest job (`POST /v1/memories` with `"async":
    /// true`), in seconds.
    #[arg(long, env = "INFERSCALE_JOB_DEADLINE_S", default_value_t = 6 * 3600)]
    job_deadline_s: u64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    body_limit: usize,
    /// Bounded load: no worker above this × the average in-flight.
    #[arg(long, default_value_t = 1.25)]
    load_factor: f64,
}

/// Mutual TLS on the workers' gRPC: a worker serves with it (and accepts
/// only clients with a certificate from the CA); routers, other workers and
/// `inferscale cluster` dial workers with it. All three files, or none.
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// This process's certificate chain (PEM); a worker's must name the
    /// address it advertises (DNS or IP SAN).
    #[arg(long, env = "INFERSCALE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "INFERSCALE_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    pub(crate) tls_key: Option<PathBuf>,
    /// The CA certificates (PEM) that peers' certificates must chain to.
    #[arg(long, env = "INFERSCALE_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub(crate) tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The security these flags ask for; the files are read and checked now.
    pub(crate) fn security(&self) -> Result<Security> {
        Ok(Security::from_files(self.files()?.as_ref())?)
    }

    /// The three files, when given.
    pub(crate) fn files(&self) -> Result<Option<TlsFiles>> {
        let (cert, key, ca) = (self.tls_cert.clone(), self.tls_key.clone(), self.tls_ca.clone());
        Ok(TlsFiles::from_parts(cert, key, ca, "--tls-cert, --tls-key and --tls-ca")?)
    }
}

/// Refuses a worker API beyond loopback without TLS, unless the operator
/// vouches for the network: anyone who reaches the port could read, forget
/// or import any user's memory.
pub(crate) fn check_exposure(listen: SocketAddr, security: &Security, insecure: bool) -> Result<()> {
    if !listen.ip().is_loopback() && !security.is_tls() && !insecure {
        bail!(
            "--listen {listen}: the worker API beyond loopback needs mutual TLS (--tls-cert, --tls-key, --tls-ca); \
             on a network you trust, --insecure-plaintext serves it without"
        );
    }
    Ok(())
}

/// Cluster membership and placement in etcd.
#[derive(Args, Debug, Clone, Default)]
pub struct ClusterArgs {
    /// etcd endpoints (`host:port`, repeat or separate with commas): join
    /// the cluster whose membership and placement live there.
    #[arg(long, env = "INFERSCALE_ETCD", value_delimiter = ',')]
    pub(crate) etcd: Vec<String>,
    /// Key prefix of this cluster in etcd (several clusters may share one).
    #[arg(long, env = "INFERSCALE_CLUSTER_ROOT", default_value = "/inferscale")]
    pub(crate) cluster_root: String,
    /// Lease TTL in seconds: how long a dead process stays registered.
    #[arg(long, env = "INFERSCALE_LEASE_TTL_S", default_value_t = 30)]
    pub(crate) lease_ttl_s: u64,
    /// Name in the cluster (default: the advertised address).
    #[arg(long, env = "INFERSCALE_NAME")]
    pub(crate) name: Option<String>,
    /// CA certificate (PEM) of etcd's server certificate: speak TLS to
    /// etcd (endpoints become https).
    #[arg(long, env = "INFERSCALE_ETCD_CA")]
    pub(crate) etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd that requires one
    /// (`--client-cert-auth`); needs --etcd-key and --etcd-ca.
    #[arg(long, env = "INFERSCALE_ETCD_CERT", requires_all = ["etcd_key", "etcd_ca"])]
    pub(crate) etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert.
    #[arg(long, env = "INFERSCALE_ETCD_KEY", requires = "etcd_cert")]
    pub(crate) etcd_key: Option<PathBuf>,
    /// User for etcd's authentication; its password from
    /// --etcd-password-file.
    #[arg(long, env = "INFERSCALE_ETCD_USER", requires = "etcd_password_file")]
    pub(crate) etcd_user: Option<String>,
    /// File holding the etcd user's password (one line; a file, so that the
    /// password is in no process list or environment dump).
    #[arg(long, env = "INFERSCALE_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub(crate) etcd_password_file: Option<PathBuf>,
}

impl ClusterArgs {
    pub(crate) fn keys(&self) -> inferscale_cluster::view::Keys {
        inferscale_cluster::view::Keys::new(&self.cluster_root)
    }

    pub(crate) fn ttl(&self) -> Result<Duration> {
        if !(2..=3600).contains(&self.lease_ttl_s) {
            bail!("--lease-ttl-s must be between 2 and 3600");
        }
        Ok(Duration::from_secs(self.lease_ttl_s))
    }

    /// The etcd settings, with the TLS and password files read and checked
    /// (nothing dialled yet), so that a bad one fails at start.
    pub(crate) fn etcd_options(&self) -> Result<EtcdOptions> {
        let user = match (&self.etcd_user, &self.etcd_password_file) {
            (Some(user), Some(file)) => {
                let text = std::fs::read_to_string(file)
                    .with_context(|| format!("--etcd-password-file {}", file.display()))?;
                let password = text.trim_end_matches(['\n', '\r']).to_string();
                if password.is_empty() {
                    bail!("--etcd-password-file {}: empty", file.display());
                }
                Some((user.clone(), password))
            }
            _ => None,
        };
        let tls = self
            .etcd_ca
            .as_ref()
            .map(|ca| EtcdTlsFiles { ca: ca.clone(), identity: self.etcd_cert.clone().zip(self.etcd_key.clone()) });
        let options = EtcdOptions { endpoints: self.etcd.clone(), tls, user };
        if !options.endpoints.is_empty() {
            options.load()?;
        }
        Ok(options)
    }
}

/// Connects to etcd (authenticating now when a user is set).
pub(crate) async fn connect_etcd(options: &EtcdOptions) -> Result<Arc<dyn Placement>> {
    Ok(Arc::new(Etcd::connect(options).await?))
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// HTTP address of the OpenAI-compatible API.
    #[arg(long, env = "INFERSCALE_API_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// HTTP address of the worker's own `/metrics`, `/healthz` and
    /// `/readyz` (off by default; the router's `/metrics` has the rest).
    #[arg(long, env = "INFERSCALE_WORKER_HTTP_LISTEN")]
    worker_http_listen: Option<SocketAddr>,
    #[command(flatten)]
    router: RouterArgs,
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Args, Debug)]
pub struct WorkerCmd {
    /// gRPC address to serve on (beyond loopback only with TLS, or with
    /// --insecure-plaintext).
    #[arg(long, env = "INFERSCALE_GRPC_LISTEN", default_value = "127.0.0.1:50051")]
    pub(crate) listen: SocketAddr,
    /// Address routers and other workers reach this one at (default: the
    /// bound listen address).
    #[arg(long, env = "INFERSCALE_ADVERTISE")]
    pub(crate) advertise: Option<String>,
    /// HTTP address of `/metrics` (Prometheus), `/healthz` and `/readyz`
    /// (off unless given).
    #[arg(long, env = "INFERSCALE_WORKER_HTTP_LISTEN")]
    pub(crate) http_listen: Option<SocketAddr>,
    /// Who generates: `native` (our engine) or `vllm` (vLLM 0.26 with our KV
    /// connector, started and supervised by this process; docs/vllm.md).
    #[arg(long, env = "INFERSCALE_ENGINE", default_value = "native", value_parser = ["native", "vllm"])]
    pub(crate) engine: String,
    #[command(flatten)]
    pub(crate) vllm: crate::vllm_cmd::VllmArgs,
    #[command(flatten)]
    pub(crate) cluster: ClusterArgs,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// Serve the gRPC API beyond loopback without TLS (a network you trust).
    #[arg(long, env = "INFERSCALE_INSECURE_PLAINTEXT")]
    pub(crate) insecure_plaintext: bool,
    #[command(flatten)]
    pub(crate) worker: WorkerArgs,
}

#[derive(Args, Debug)]
pub struct RouterCmd {
    /// HTTP address of the OpenAI-compatible API.
    #[arg(long, env = "INFERSCALE_API_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Worker gRPC addresses (repeat, or separate with commas): a fixed set,
    /// instead of a cluster in etcd.
    #[arg(long = "worker", env = "INFERSCALE_WORKERS", value_delimiter = ',', conflicts_with = "etcd")]
    workers: Vec<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    tls: TlsArgs,
    /// Keep a copy of each user's facts on a second worker (cluster only).
    #[arg(long, env = "INFERSCALE_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    replicas: u8,
    /// Pace of each shard move in MB/s (0: unlimited), to keep serving latency.
    #[arg(long, env = "INFERSCALE_MIGRATE_MB_S", default_value_t = 0)]
    migrate_mb_s: u64,
    /// Seconds a worker may fail the leader's health probes before it is
    /// fenced (its lease revoked, so its users' writes go on without it);
    /// 0 waits for its lease to expire instead (--lease-ttl-s).
    #[arg(long, env = "INFERSCALE_FENCE_AFTER_S", default_value_t = inferscale_router::DEFAULT_FENCE_AFTER.as_secs_f64())]
    fence_after_s: f64,
    #[command(flatten)]
    router: RouterArgs,
}

/// Loads the engine, embedder and memory on the engine thread.
fn parts<B: Backend>(a: &WorkerArgs, backend: B) -> std::result::Result<WorkerParts<B>, WorkerError> {
    let fail = |e: anyhow::Error| WorkerError::Startup(format!("{e:#}"));
    let loaded = load_on(&a.mem.model, backend).map_err(fail)?;
    let eos = loaded.eos_ids();
    let (embedder, memory) = open_memory(&a.mem, &loaded, true).map_err(fail)?;
    let (dir, users) = (a.mem.dir(), memory.users().count());
    eprintln!("inferscale worker: memory {} ({users} users, window {})", dir.display(), a.mem.window());
    Ok(WorkerParts { files: loaded.files, engine: loaded.engine, embedder, memory, eos })
}

/// Starts the engine thread; `backend` runs on it, so the backend is
/// created (and, for CUDA, its context bound) on the thread that uses it.
fn start<B, F>(a: &WorkerArgs, backend: F) -> Result<(WorkerService, std::thread::JoinHandle<()>)>
where
    B: Backend,
    F: FnOnce() -> Result<B> + Send + 'static,
{
    let cfg = WorkerConfig {
        max_running: a.max_running,
        max_queue: a.max_queue,
        max_k: a.max_k as usize,
        max_ingest_units: a.max_ingest_units,
        prompts: a.mem.prompts(),
        cold_kv: a.cold_kv,
        cold_kv_wait: std::time::Duration::from_millis(a.cold_kv_wait_ms),
        kv_readers: a.kv_readers,
        kv_warm_restart: a.kv_warm_restart,
        prefix_cache: a.prefix_cache.unwrap_or_default(),
        audit_share: a.audit_share,
        ..Default::default()
    };
    let info = WorkerInfo {
        model: a.mem.model.shape.clone().unwrap_or_else(|| model_name(a.mem.model.model())),
        backend: a.mem.model.backend.clone(),
        embedder: inferscale_model::fetch::served_names(&a.mem.embedder),
    };
    let args = a.clone();
    let load = move || {
        let be = backend().map_err(|e| WorkerError::Startup(format!("{e:#}")))?;
        parts(&args, be)
    };
    Ok(inferscale_worker::spawn(load, cfg, info)?)
}

fn parse_cold_kv(s: &str) -> std::result::Result<ColdKv, String> {
    match s {
        "prefill" => Ok(ColdKv::Prefill),
        "read" => Ok(ColdKv::Read),
        "wait" => Ok(ColdKv::Wait),
        "auto" => Ok(ColdKv::Auto),
        other => Err(format!("{other:?}: choose prefill, read, wait or auto")),
    }
}

/// A share: a number in 0..=1.
fn parse_share(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is outside 0..=1")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

fn parse_prefix_cache(s: &str) -> std::result::Result<PrefixCache, String> {
    match s {
        "user" => Ok(PrefixCache::User),
        "shared" => Ok(PrefixCache::Shared),
        "off" => Ok(PrefixCache::Off),
        other => Err(format!("{other:?}: choose user, shared or off")),
    }
}

/// The name clients use for a model: its packaged name, or the file stem.
pub(crate) fn model_name(model: &str) -> String {
    std::path::Path::new(model).file_stem().map_or(model.to_string(), |s| s.to_string_lossy().into_owned())
}

/// Starts a worker's engine thread; the thread ends once every clone of
/// the service is dropped. A CUDA worker with libnccl can move shards' KV
/// over NCCL links; the GPU identity to register is returned with it.
pub(crate) fn start_worker(a: &WorkerArgs) -> Result<(WorkerService, std::thread::JoinHandle<()>, Option<GpuId>)> {
    let (service, engine) = start_engine(a)?;
    Ok(match crate::links::nccl(a) {
        Some((links, gpu)) => (service.with_links(links), engine, Some(gpu)),
        None => (service, engine, None),
    })
}

impl WorkerArgs {
    /// The worker's limits, checked before the model loads.
    pub(crate) fn check(&self) -> Result<()> {
        if self.max_running == 0 || self.max_queue == 0 || self.max_k == 0 || self.max_ingest_units == 0 {
            bail!("--max-running, --max-queue, --max-k and --max-ingest-units must be at least 1");
        }
        let m = &self.mem.model;
        if m.kv_cache_mb == 0 || m.max_batch_tokens == 0 {
            bail!("--kv-cache-mb and --max-batch-tokens must be at least 1");
        }
        Ok(())
    }
}

fn start_engine(a: &WorkerArgs) -> Result<(WorkerService, std::thread::JoinHandle<()>)> {
    a.check()?;
    match a.mem.model.backend.as_str() {
        "cpu" => start(a, || Ok(inferscale_engine::CpuBackend)),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let device = a.mem.model.device;
            start(a, move || crate::runtime::cuda_backend(device))
        }
        other => bail!("backend `{other}` is not built into this binary"),
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn keys(a: &RouterArgs) -> Result<Keys> {
    let mut keys = match &a.api_keys {
        Some(path) => Keys::from_file(path)?,
        None => Keys::default(),
    };
    if keys.is_empty()
        && let Ok(v) = std::env::var("INFERSCALE_API_KEYS")
    {
        keys = Keys::from_env_value(&v)?;
    }
    Ok(keys)
}

/// The router's settings checked, and its keys read, before anything
/// slow starts (a model load, a connection to etcd).
fn check_router(a: &RouterArgs, listen: SocketAddr) -> Result<Keys> {
    let keys = keys(a)?;
    if keys.is_empty() && !listen.ip().is_loopback() {
        bail!("--listen {listen}: without API keys the API listens on loopback only; give --api-keys FILE");
    }
    if !(1.0..=10.0).contains(&a.load_factor) {
        bail!("--load-factor must be between 1 and 10");
    }
    if a.deadline_s == 0 || a.job_deadline_s == 0 {
        bail!("--deadline-s and --job-deadline-s must be at least 1");
    }
    if a.body_limit < 1024 {
        bail!("--body-limit {}: every request would be refused as too large; give at least 1024", a.body_limit);
    }
    Ok(keys)
}

fn router_config(a: &RouterArgs, membership: Membership, keys: Keys, security: Security) -> Result<RouterConfig> {
    match keys.is_empty() {
        true => eprintln!("inferscale: no API keys configured: listening on loopback only, accepting any key"),
        false => eprintln!("inferscale: {} API keys loaded", keys.len()),
    }
    Ok(RouterConfig {
        membership,
        keys,
        model: None,
        defaults: Defaults {
            mode: a.default_mode,
            blend_ratio: a.default_blend_ratio,
            k: a.default_k,
            max_k: MAX_K,
            max_tokens: a.default_max_tokens,
            deadline: Duration::from_secs(a.deadline_s),
            job_deadline: Duration::from_secs(a.job_deadline_s),
            body_limit: a.body_limit,
        },
        load_factor: a.load_factor,
        security,
    })
}

async fn serve_http(listen: SocketAddr, cfg: RouterConfig) -> Result<()> {
    let app = inferscale_router::build(cfg, Duration::from_secs(30)).await?;
    let listener = TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
    eprintln!("inferscale: OpenAI-compatible API on http://{}/v1", listener.local_addr()?);
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle's
    // algorithm holds each one until the client's delayed ACK (~40 ms).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await?;
    Ok(())
}

/// Serves the worker's `/metrics` and probes on `listen`, if given.
async fn serve_worker_http(listen: Option<SocketAddr>, service: WorkerService) -> Result<()> {
    let Some(listen) = listen else { return Ok(()) };
    let listener = TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
    eprintln!("inferscale worker: metrics on http://{}/metrics", listener.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = inferscale_worker::http::serve(listener, service, shutdown_signal()).await {
            eprintln!("inferscale worker: metrics server stopped: {e}");
        }
    });
    Ok(())
}

pub(crate) async fn serve_grpc(listener: TcpListener, service: WorkerService) -> Result<()> {
    if let Ok(addr) = listener.local_addr() {
        let how = if service.is_tls() { "mutual TLS" } else { "plaintext" };
        eprintln!("inferscale worker: gRPC on {addr} ({how})");
    }
    Ok(service.serve(listener, shutdown_signal()).await?)
}

/// Registers this process's worker in `store` as `name` at `addr`.
pub(crate) async fn register(
    store: Arc<dyn Placement>,
    c: &ClusterArgs,
    name: String,
    addr: String,
    gpu: Option<GpuId>,
) -> Result<Registration> {
    let member = Member { name: name.clone(), addr: addr.clone(), state: MemberState::Joining, gpu };
    let mut reg = Registration::spawn(store.clone(), c.keys(), member, c.ttl()?);
    match tokio::time::timeout(Duration::from_secs(30), reg.registered()).await {
        Ok(()) => eprintln!("inferscale worker: registered as {name} ({addr}) in {}", store.describe()),
        Err(_) => eprintln!("inferscale worker: not registered in {} yet; still trying", store.describe()),
    }
    Ok(reg)
}

pub fn serve(mut a: ServeArgs) -> Result<()> {
    // Everything that needs no model is checked before the model loads.
    crate::config::refuse_retired_env()?;
    let keys = check_router(&a.router, a.listen)?;
    if a.router.default_k > a.worker.max_k {
        bail!(
            "--default-k {} is above --max-k {}: every request that does not name its k would be refused",
            a.router.default_k,
            a.worker.max_k
        );
    }
    a.worker.check()?;
    a.worker.mem.resolve()?;
    let (service, engine, _) = start_worker(&a.worker)?;
    serve_then_release(engine, async move {
        let tracing = inferscale_telemetry::init("inferscale")?;
        serve_worker_http(a.worker_http_listen, service.clone()).await?;
        // The router reaches its worker over a Unix socket in a directory
        // only this user can enter: no port another process could call.
        let link = PrivateDir::create()?;
        let socket = link.0.join("worker.sock");
        let grpc = tokio::net::UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
        let addr = format!("unix:{}", socket.display());
        // One node: membership and placement in the embedded store, kept
        // beside the memory so that placement survives a restart.
        let path = a.worker.mem.dir().join("placement.json");
        let store: Arc<dyn Placement> = inferscale_cluster::embedded::Embedded::open(&path)?;
        let cluster = ClusterArgs { cluster_root: "/inferscale".into(), lease_ttl_s: 10, ..Default::default() };
        // The one worker and the one router share the node's name.
        let reg = register(store.clone(), &cluster, "local".into(), addr, None).await?;
        let membership = Membership::Store {
            store,
            keys: cluster.keys(),
            name: "local".into(),
            ttl: cluster.ttl()?,
            // One worker: nothing to fence it for.
            rebalance: RebalanceConfig { replicate: false, fence_after: None, ..Default::default() },
        };
        // The worker is behind a private socket in this process: plaintext.
        let cfg = router_config(&a.router, membership, keys, Security::Plaintext)?;
        let worker =
            tokio::spawn(async move { service.serve_unix(grpc, shutdown_signal()).await.map_err(anyhow::Error::from) });
        let r = tokio::select! {
            r = serve_http(a.listen, cfg) => r,
            r = worker => r.context("worker task")?,
        };
        reg.leave().await;
        tracing.shutdown().await;
        r
    })
}

/// Runs `serve` to its end on a runtime of its own, then drops the runtime
/// — and with it every handle to the worker — and waits for the engine
/// thread ([`release_engine`]).
fn serve_then_release(engine: std::thread::JoinHandle<()>, serve: impl Future<Output = Result<()>>) -> Result<()> {
    let rt = runtime()?;
    let served = rt.block_on(serve);
    drop(rt);
    release_engine(engine);
    served
}

/// How long a stopping process waits for its engine thread.
const ENGINE_EXIT_WAIT: Duration = Duration::from_secs(10);

/// Waits (at most [`ENGINE_EXIT_WAIT`]) for the engine thread to end, once
/// every handle to the worker is gone: the thread sees its command channel
/// close at its next turn and drops the engine, which frees the device's
/// memory in order and lets the backend report what it gathered (`INFERSCALE_CUDA_PROFILE`'s per-op table of a served
/// run). Without the wait the process could exit under it mid-step.
fn release_engine(engine: std::thread::JoinHandle<()>) {
    let start = std::time::Instant::now();
    while !engine.is_finished() {
        if start.elapsed() >= ENGINE_EXIT_WAIT {
            eprintln!("inferscale: the engine thread did not stop within {ENGINE_EXIT_WAIT:?}; exiting without it");
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if engine.join().is_ok() {
        eprintln!("inferscale: the engine stopped");
    }
}

/// A directory only this process's user may enter (mode 0700), removed
/// when dropped: where `serve` puts its worker's socket.
struct PrivateDir(std::path::PathBuf);

impl PrivateDir {
    fn create() -> Result<PrivateDir> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        for attempt in 0..16u32 {
            let name = format!("inferscale-serve-{}-{:x}", std::process::id(), nanos.wrapping_add(attempt));
            let dir = std::env::temp_dir().join(name);
            // `create`, not `create_all`: an existing path (anyone's) is never reused.
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(PrivateDir(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
            }
        }
        bail!("could not create a private directory for the worker's socket in {}", std::env::temp_dir().display())
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn worker(mut a: WorkerCmd) -> Result<()> {
    // Everything that needs no model is checked before the model loads.
    crate::config::refuse_retired_env()?;
    a.cluster.ttl()?;
    let security = a.tls.security()?;
    check_exposure(a.listen, &security, a.insecure_plaintext)?;
    let etcd = a.cluster.etcd_options()?;
    a.worker.check()?;
    a.worker.mem.resolve()?;
    if a.engine == "vllm" {
        return crate::vllm_cmd::worker(a, security, etcd);
    }
    let (service, engine, gpu) = start_worker(&a.worker)?;
    let service = service.with_security(security);
    serve_then_release(engine, async move {
        let tracing = inferscale_telemetry::init("inferscale-worker")?;
        let listener = TcpListener::bind(a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let bound = listener.local_addr()?;
        serve_worker_http(a.http_listen, service.clone()).await?;
        let reg = match a.cluster.etcd.is_empty() {
            true => None,
            false => {
                let addr = a.advertise.clone().unwrap_or_else(|| bound.to_string());
                let name = a.cluster.name.clone().unwrap_or_else(|| addr.clone());
                Some(register(connect_etcd(&etcd).await?, &a.cluster, name, addr, gpu).await?)
            }
        };
        let r = serve_grpc(listener, service).await;
        // Deregister at once on shutdown rather than after the lease TTL.
        if let Some(reg) = reg {
            reg.leave().await;
        }
        tracing.shutdown().await;
        r
    })
}

fn fence_after(s: f64) -> Result<Option<Duration>> {
    if !(0.0..=3600.0).contains(&s) {
        bail!("--fence-after-s must be between 0 (off) and 3600, got {s}");
    }
    if s > 0.0 && s < 1.0 {
        bail!("--fence-after-s {s}: under a second is less than one health probe; give at least 1 (or 0 for off)");
    }
    Ok((s > 0.0).then(|| Duration::from_secs_f64(s)))
}

pub fn router(a: RouterCmd) -> Result<()> {
    crate::config::refuse_retired_env()?;
    let keys = check_router(&a.router, a.listen)?;
    let fence_after = fence_after(a.fence_after_s)?;
    let security = a.tls.security()?;
    let etcd = a.cluster.etcd_options()?;
    // The etcd client's channel needs the runtime from its creation on.
    runtime()?.block_on(async move {
        let membership = match (a.workers.is_empty(), a.cluster.etcd.is_empty()) {
            (false, true) => Membership::Fixed(a.workers.clone()),
            (true, false) => Membership::Store {
                store: connect_etcd(&etcd).await?,
                keys: a.cluster.keys(),
                name: a.cluster.name.clone().unwrap_or_else(|| format!("router-{}", std::process::id())),
                ttl: a.cluster.ttl()?,
                rebalance: RebalanceConfig {
                    replicate: a.replicas > 0,
                    max_bytes_per_sec: a.migrate_mb_s * 1_000_000,
                    fence_after,
                    ..Default::default()
                },
            },
            _ => bail!("give the router its workers with --worker ADDR,… or a cluster with --etcd HOST:PORT,…"),
        };
        let cfg = router_config(&a.router, membership, keys, security)?;
        let tracing = inferscale_telemetry::init("inferscale-router")?;
        let r = serve_http(a.listen, cfg).await;
        tracing.shutdown().await;
        r
    })
}
