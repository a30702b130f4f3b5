//! The gRPC `Worker` service: translates calls into [`Command`]s for the
//! engine thread and its events back into messages.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use inferscale_engine::Backend;
use inferscale_memory::{EventKind, MemoryUnit, UnitUpdate};
use inferscale_proto as pb;
use inferscale_proto::tls::Security;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, wrappers::UnboundedReceiverStream};
use tonic::{Request, Response, Status};
use tracing::{Instrument, info_span};

use crate::config::{AuditShare, WorkerConfig};
use crate::engine_thread::{WorkerParts, run};
use crate::error::{Result, WorkerError};
use crate::handle::Handle;
use crate::link::Links;
use crate::metrics::WorkerMetrics;
use crate::protocol::{
    Command, Event, GenerateJob, MemoryHost, Protocol, ProtocolConfig, SearchQuery, ShardCommand, TokenLogprob,
    finish_reason,
};
use inferscale_telemetry::propagate;
use inferscale_types::Refusal;

/// What a worker serves, for health answers.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    pub model: String,
    pub backend: String,
    /// Names of the retrieval encoder `/v1/embeddings` may ask for, the
    /// one it reports first.
    pub embedder: Vec<String>,
}

struct NotReadyOnDrop(Arc<AtomicBool>);

impl Drop for NotReadyOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// The gRPC face of one engine thread; cheap to clone.
#[derive(Clone)]
pub struct WorkerService {
    /// The way to the engine, and how the API is served and this worker
    /// dials others (shard moves): plaintext or mutual TLS.
    handle: Handle,
    info: WorkerInfo,
    ready: Arc<AtomicBool>,
    /// The audited share the engine thread reads; `None` for a worker whose
    /// generation is another engine's (nothing to audit).
    audit_share: Option<Arc<AuditShare>>,
}

/// Starts the engine thread: `load` builds the engine, embedder and memory
/// on that thread (so backends need not be `Send`). Returns once they are
/// loaded, with the service to mount, or with the load error.
pub fn spawn<B, F>(load: F, cfg: WorkerConfig, info: WorkerInfo) -> Result<(WorkerService, JoinHandle<()>)>
where
    B: Backend,
    F: FnOnce() -> Result<WorkerParts<B>> + Send + 'static,
{
    let audit_share = Arc::new(AuditShare::new(cfg.audit_share));
    let read_by_engine = audit_share.clone();
    let (service, thread) = start(
        "inferscale-engine",
        info,
        move |_| load(),
        move |parts, rx, metrics| {
            if let Err(e) = run(parts, cfg, read_by_engine, rx, metrics) {
                eprintln!("inferscale worker: engine thread stopped: {e}");
            }
        },
    )?;
    Ok((WorkerService { audit_share: Some(audit_share), ..service }, thread))
}

/// Starts a thread that carries out the service's commands on a host of
/// another engine, made on that thread by `make` (so it need not be
/// `Send`): the vLLM-mode worker, whose generation is vLLM's, serves the
/// same API this way. Ingests run to completion between commands, a batch
/// at a time. Returns once the host is made, or with `make`'s error; the
/// thread ends when every clone of the service is gone.
pub fn spawn_host<H, F>(make: F, cfg: ProtocolConfig, info: WorkerInfo) -> Result<(WorkerService, JoinHandle<()>)>
where
    H: MemoryHost,
    F: FnOnce(Arc<WorkerMetrics>) -> Result<H> + Send + 'static,
{
    start("inferscale-commands", info, make, move |mut host, rx, metrics| {
        let mut protocol = Protocol::new(cfg, metrics);
        while let Ok(c) = rx.recv() {
            protocol.handle(&mut host, c);
            while protocol.ingest_some(&mut host, usize::MAX, false) > 0 {}
        }
    })
}

/// Starts the thread `name`: `build` makes what it serves there, then
/// `serve` carries out the service's commands until every clone of the
/// service is gone. The service is ready from the end of `build` until the
/// thread ends (a panic included). Returns once built, or with `build`'s
/// error.
fn start<T, F, S>(name: &str, info: WorkerInfo, build: F, serve: S) -> Result<(WorkerService, JoinHandle<()>)>
where
    F: FnOnce(Arc<WorkerMetrics>) -> Result<T> + Send + 'static,
    S: FnOnce(T, Receiver<Command>, Arc<WorkerMetrics>) + Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel::<Command>();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<Result<()>>();
    let ready = Arc::new(AtomicBool::new(false));
    let flag = ready.clone();
    let metrics = Arc::new(WorkerMetrics::default());
    let observed = metrics.clone();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let built = match build(observed.clone()) {
                Ok(b) => b,
                Err(e) => {
                    let _ = started_tx.send(Err(e));
                    return;
                }
            };
            flag.store(true, Ordering::SeqCst);
            // Not ready from the moment the thread ends, panics included.
            let _ready = NotReadyOnDrop(flag);
            let _ = started_tx.send(Ok(()));
            serve(built, rx, observed);
        })
        .map_err(|e| WorkerError::Startup(format!("starting thread {name}: {e}")))?;
    started_rx.recv().map_err(|_| WorkerError::Startup(format!("thread {name} exited while starting")))??;
    let handle = Handle { tx, metrics, links: None, security: Security::Plaintext };
    Ok((WorkerService { handle, info, ready, audit_share: None }, thread))
}

impl WorkerService {
    /// Serves the worker API on `listener` until `shutdown` resolves, with
    /// mutual TLS when the service has it ([`WorkerService::with_security`]).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<()> {
        // Token events are small writes: without TCP_NODELAY, Nagle's
        // algorithm holds each one until the peer's delayed ACK (~40 ms).
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
            s.inspect(|tcp| {
                let _ = tcp.set_nodelay(true);
            })
        });
        let mut server = self.handle.security.server().map_err(|e| WorkerError::Startup(e.to_string()))?;
        server
            .add_service(self.into_server())
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
            .map_err(|e| WorkerError::Internal(format!("the worker API stopped: {e}")))
    }

    /// [`WorkerService::serve`] on a Unix socket (plaintext; the socket's
    /// permissions decide who may connect): `serve`'s link between its
    /// router and its worker, which no other user of the machine reaches.
    pub async fn serve_unix(
        self,
        listener: tokio::net::UnixListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<()> {
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        tonic::transport::Server::builder()
            .add_service(self.into_server())
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
            .map_err(|e| WorkerError::Internal(format!("the worker API stopped: {e}")))
    }

    pub fn into_server(self) -> pb::worker_server::WorkerServer<WorkerService> {
        pb::worker_server::WorkerServer::new(self)
            .max_decoding_message_size(crate::transfer::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(crate::transfer::MAX_MESSAGE_BYTES)
    }

    /// Whether the engine is loaded and its thread runs.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    pub fn metrics(&self) -> &WorkerMetrics {
        &self.handle.metrics
    }

    /// Audits the share `share` (0..=1) of kv and blend requests from the
    /// next one laid out on (`WorkerConfig::audit_share` was the first).
    pub fn set_audit_share(&self, share: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&share) {
            return Err(Refusal::new("audit_share", format!("an audit share is between 0 and 1, not {share}")).into());
        }
        let Some(s) = &self.audit_share else {
            return Err(
                Refusal::new("audit_share", "this worker's generation is another engine's: nothing to audit").into()
            );
        };
        s.set(share);
        Ok(())
    }

    /// Lets this worker move shards' KV over device links (see
    /// [`crate::link`]).
    pub fn with_links(mut self, links: Arc<dyn Links>) -> WorkerService {
        self.handle.links = Some(links);
        self
    }

    /// Serves with, and dials other workers with, `security`.
    pub fn with_security(mut self, security: Security) -> WorkerService {
        self.handle.security = security;
        self
    }

    /// The way to the engine (for the worker's HTTP side).
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Whether the API is served with mutual TLS.
    pub fn is_tls(&self) -> bool {
        self.handle.security.is_tls()
    }
}

fn to_event(e: Event) -> std::result::Result<pb::GenerateEvent, Status> {
    use pb::generate_event::Event as E;
    let event = match e {
        Event::Token { id, text, logprobs } => E::Token(pb::Token {
            id,
            text,
            logprobs: logprobs.map(|l| {
                let one = |t: TokenLogprob| pb::TokenLogprob { id: t.id, token: t.token, logprob: t.logprob };
                pb::Logprobs { chosen: Some(one(l.chosen)), top: l.top.into_iter().map(one).collect() }
            }),
        }),
        Event::Finished(f) => E::Finished(pb::Finished {
            reason: finish_reason(f.reason).into(),
            usage: Some(pb::Usage {
                prompt_tokens: f.usage.prompt_tokens as u32,
                injected_tokens: f.usage.injected_tokens as u32,
                cached_tokens: f.usage.cached_tokens as u32,
                completion_tokens: f.usage.completion_tokens as u32,
                facts: f.usage.facts as u32,
                recomputed_tokens: f.usage.recomputed_tokens as u32,
                sources: f.usage.sources.map(pb::FactSources::from),
            }),
            timings: Some(pb::Timings {
                queue_ms: f.timings.queue_ms,
                retrieve_ms: f.timings.retrieve_ms,
                inject_ms: f.timings.inject_ms,
                prefill_ms: f.timings.prefill_ms,
                first_token_ms: f.timings.first_token_ms,
                total_ms: f.timings.total_ms,
            }),
            fact_ids: f.fact_ids,
        }),
        Event::Failed(e) => return Err(e.into()),
    };
    Ok(pb::GenerateEvent { event: Some(event) })
}

type EventStream = Pin<Box<dyn Stream<Item = std::result::Result<pb::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn ingest(
        &self,
        req: Request<pb::IngestRequest>,
    ) -> std::result::Result<Response<pb::IngestResponse>, Status> {
        let span = info_span!("ingest", otel.kind = "server", units = req.get_ref().units.len() as i64);
        propagate::continue_from_metadata(&span, req.metadata());
        let r = req.into_inner();
        let units = r
            .units
            .into_iter()
            .map(MemoryUnit::try_from)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(Status::invalid_argument)?;
        let window = r.window.map(|w| w as usize);
        let (user, defer_kv) = (r.user, r.defer_kv);
        let report = self
            .handle
            .call(|reply| Command::Ingest { user, window, units, defer_kv, reply })
            .instrument(span)
            .await??;
        Ok(Response::new(pb::IngestResponse {
            added: report.added as u32,
            skipped: report.skipped as u32,
            encoded_tokens: report.encoded_tokens as u64,
        }))
    }

    type GenerateStream = EventStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> std::result::Result<Response<EventStream>, Status> {
        let arrived = Instant::now();
        let r = req.get_ref();
        let mode = pb::MemoryMode::try_from(r.mode).map_or("unknown", |m| m.to_mode().as_str());
        // Ended when the engine thread lets go of the request.
        let span = info_span!(
            "generate",
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            mode,
            k = i64::from(r.k),
            finish_reason = tracing::field::Empty,
        );
        propagate::continue_from_metadata(&span, req.metadata());
        let r = req.into_inner();
        let deadline = (r.deadline_ms > 0).then(|| Duration::from_millis(r.deadline_ms.into()));
        let request = r.generation().map_err(|e| pb::refused(&e))?;
        let job = GenerateJob::new(request, deadline, arrived, span);
        let (events, rx) = mpsc::unbounded_channel();
        self.handle.send(Command::Generate { job: Box::new(job), events })?;
        let stream = UnboundedReceiverStream::new(rx).map(to_event);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_memories(
        &self,
        req: Request<pb::ListMemoriesRequest>,
    ) -> std::result::Result<Response<pb::ListMemoriesResponse>, Status> {
        let r = req.into_inner();
        let user = r.user.clone();
        let (units, window) = self.handle.call(|reply| Command::List { user, reply }).await??;
        let units = match r.ids.is_empty() {
            true => units,
            false => {
                let mut by_id: std::collections::HashMap<String, inferscale_types::StoredUnit> =
                    units.into_iter().map(|u| (u.unit.id.clone(), u)).collect();
                r.ids
                    .iter()
                    .map(|id| {
                        by_id
                            .remove(id)
                            .ok_or_else(|| WorkerError::UnknownUnit { user: r.user.clone(), id: id.clone() })
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let units = units.into_iter().map(pb::MemoryUnit::from).collect();
        Ok(Response::new(pb::ListMemoriesResponse { units, window: window as u32 }))
    }

    async fn update_memory(
        &self,
        req: Request<pb::UpdateMemoryRequest>,
    ) -> std::result::Result<Response<pb::UpdateMemoryResponse>, Status> {
        let r = req.into_inner();
        let metadata = match r.metadata {
            None => None,
            Some(m) => Some(
                serde_json::from_str(&m)
                    .map_err(|e| Status::invalid_argument(format!("`metadata` is not a JSON object: {e}")))?,
            ),
        };
        let change = UnitUpdate { text: r.text, metadata };
        let (user, id, defer_kv) = (r.user, r.id, r.defer_kv);
        let report = self.handle.call(|reply| Command::Update { user, id, change, defer_kv, reply }).await??;
        Ok(Response::new(pb::UpdateMemoryResponse {
            changed: report.changed,
            encoded_tokens: report.encoded_tokens as u64,
        }))
    }

    async fn unit_history(
        &self,
        req: Request<pb::UnitHistoryRequest>,
    ) -> std::result::Result<Response<pb::UnitHistoryResponse>, Status> {
        let r = req.into_inner();
        let (user, id) = (r.user, r.id);
        let events = self.handle.call(|reply| Command::History { user, id, reply }).await??;
        let json = |m: serde_json::Map<String, serde_json::Value>| serde_json::Value::Object(m).to_string();
        let events = events
            .into_iter()
            .map(|e| pb::HistoryEvent {
                event: match e.kind {
                    EventKind::Add => "ADD".into(),
                    EventKind::Update => "UPDATE".into(),
                },
                at_ms: e.at_ms,
                old_text: e.old_text,
                new_text: e.new_text,
                old_metadata: e.old_metadata.map(json),
                new_metadata: json(e.new_metadata),
            })
            .collect();
        Ok(Response::new(pb::UnitHistoryResponse { events }))
    }

    async fn search_memories(
        &self,
        req: Request<pb::SearchMemoriesRequest>,
    ) -> std::result::Result<Response<pb::SearchMemoriesResponse>, Status> {
        let r = req.into_inner();
        let filters = match r.filters.is_empty() {
            true => serde_json::Map::new(),
            false => serde_json::from_str(&r.filters)
                .map_err(|e| Status::invalid_argument(format!("`filters` is not a JSON object: {e}")))?,
        };
        let query = SearchQuery {
            scope: pb::scope(&r.agent_id, &r.run_id),
            user: r.user,
            query: r.query,
            top_k: r.top_k as usize,
            threshold: r.threshold,
            filters,
        };
        let hits = self.handle.call(|reply| Command::Search { query, reply }).await??;
        let hits = hits.into_iter().map(|(u, score)| pb::SearchHit { unit: Some(u.into()), score }).collect();
        Ok(Response::new(pb::SearchMemoriesResponse { hits }))
    }

    async fn forget(
        &self,
        req: Request<pb::ForgetRequest>,
    ) -> std::result::Result<Response<pb::ForgetResponse>, Status> {
        let r = req.into_inner();
        let unit = (!r.unit_id.is_empty()).then_some(r.unit_id);
        self.handle.call(|reply| Command::Forget { user: r.user, unit, reply }).await??;
        Ok(Response::new(pb::ForgetResponse {}))
    }

    async fn embed(&self, req: Request<pb::EmbedRequest>) -> std::result::Result<Response<pb::EmbedResponse>, Status> {
        let r = req.into_inner();
        let names = &self.info.embedder;
        if !names.iter().any(|n| n.eq_ignore_ascii_case(&r.model)) {
            let have = names.first().map_or("none", String::as_str);
            return Err(Status::not_found(format!(
                "model `{}` does not exist for embeddings; this server embeds with `{have}`",
                r.model
            )));
        }
        let texts = r.input;
        let out = self.handle.call(|reply| Command::Embed { texts, reply }).await??;
        Ok(Response::new(pb::EmbedResponse {
            data: out.vectors.into_iter().map(|values| pb::Embedding { values }).collect(),
            prompt_tokens: out.tokens as u32,
            model: names.first().cloned().unwrap_or_default(),
        }))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> std::result::Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse {
            ready: self.ready.load(Ordering::SeqCst),
            model: self.info.model.clone(),
            backend: self.info.backend.clone(),
        }))
    }

    async fn stats(&self, _: Request<pb::StatsRequest>) -> std::result::Result<Response<pb::StatsResponse>, Status> {
        let s = self.handle.call(|reply| Command::Stats { memory_bytes: false, reply }).await?;
        Ok(Response::new(pb::StatsResponse {
            running: s.load.running as u32,
            waiting: s.load.waiting as u32,
            kv_blocks_total: s.load.kv_blocks_total as u32,
            kv_blocks_free: s.load.kv_blocks_free as u32,
            users: s.users as u32,
            facts: s.facts as u64,
            requests_finished: s.finished,
            requests_cancelled: s.cancelled,
            requests_failed: s.failed,
            window: s.window as u32,
            max_queue: s.load.max_queue as u32,
            damaged_users: s.damaged_users as u32,
            unsettled_users: s.unsettled_users as u32,
            disk_full: self.handle.metrics.disk_full(),
        }))
    }

    async fn list_users(
        &self,
        _: Request<pb::ListUsersRequest>,
    ) -> std::result::Result<Response<pb::ListUsersResponse>, Status> {
        let (users, digests) = self.handle.call(|reply| Command::Shard(ShardCommand::ListUsers { reply })).await?;
        Ok(Response::new(pb::ListUsersResponse { users, digests }))
    }

    type ExportShardStream = crate::transfer::ChunkStream;

    async fn export_shard(
        &self,
        req: Request<pb::ExportShardRequest>,
    ) -> std::result::Result<Response<Self::ExportShardStream>, Status> {
        let span = info_span!("export_shard", otel.kind = "server", user = %req.get_ref().user);
        propagate::continue_from_metadata(&span, req.metadata());
        Ok(Response::new(crate::transfer::export(self.handle.clone(), req.into_inner(), span)))
    }

    async fn import_shard(
        &self,
        req: Request<tonic::Streaming<pb::ShardChunk>>,
    ) -> std::result::Result<Response<pb::ImportShardResponse>, Status> {
        let span = info_span!("import_shard", otel.kind = "server", bytes = tracing::field::Empty);
        propagate::continue_from_metadata(&span, req.metadata());
        let r = crate::transfer::import(&self.handle, req.into_inner()).instrument(span.clone()).await?;
        span.record("bytes", r.bytes as i64);
        Ok(Response::new(r))
    }

    async fn send_shard(
        &self,
        req: Request<pb::SendShardRequest>,
    ) -> std::result::Result<Response<pb::SendShardResponse>, Status> {
        let span = info_span!("send_shard", otel.kind = "server", user = %req.get_ref().user, to = %req.get_ref().to);
        propagate::continue_from_metadata(&span, req.metadata());
        Ok(Response::new(crate::transfer::send(&self.handle, req.into_inner()).instrument(span).await?))
    }

    async fn release_shard(
        &self,
        req: Request<pb::ReleaseShardRequest>,
    ) -> std::result::Result<Response<pb::ReleaseShardResponse>, Status> {
        let r = req.into_inner();
        self.handle.call(|reply| Command::Shard(ShardCommand::Release { user: r.user, drop: r.drop, reply })).await??;
        Ok(Response::new(pb::ReleaseShardResponse {}))
    }
}
