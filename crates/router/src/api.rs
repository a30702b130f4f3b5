//! HTTP handlers: chat completions (JSON or SSE), memories, models, health
//! and metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing};
use futures_util::{Stream, StreamExt};
use inferscale_proto as pb;
use inferscale_telemetry::{prom, propagate};
use serde_json::json;
use tracing::{Instrument, info_span};

use crate::auth::{Keys, scoped};
use crate::error::{ApiError, Result};
use crate::memories;
use crate::metrics::{Metrics, mode_index};
use crate::openai::{self, ChatRequest};
use crate::workers::{InFlight, Workers, request};
use inferscale_types::Mode;

/// Response header naming the worker that served a chat request.
pub const WORKER_HEADER: &str = "x-inferscale-worker";

/// Server-side defaults and limits of the chat API.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub mode: Mode,
    /// The share of injected tokens a blend request recomputes unless it says.
    pub blend_ratio: f32,
    pub k: u32,
    pub max_k: u32,
    pub max_tokens: u32,
    /// Deadline of every worker call.
    pub deadline: Duration,
    /// Deadline of an ingest job's calls (`"async": true`, `jobs.rs`).
    pub job_deadline: Duration,
    pub body_limit: usize,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            mode: Mode::Kv,
            blend_ratio: inferscale_types::DEFAULT_BLEND_RATIO,
            k: 20,
            max_k: 200,
            max_tokens: 256,
            deadline: Duration::from_secs(120),
            job_deadline: Duration::from_secs(6 * 3600),
            body_limit: 4 << 20,
        }
    }
}

pub struct AppState {
    pub workers: Arc<Workers>,
    pub keys: Keys,
    /// The model name clients must send (as `/v1/models` lists it).
    pub model: String,
    pub defaults: Defaults,
    pub metrics: Metrics,
    /// Moves made by this router while it led.
    pub rebalance: Arc<crate::rebalance::RebalanceStats>,
    /// Ingest jobs (`"async": true`).
    pub jobs: crate::jobs::Jobs,
}

pub(crate) type Shared = Arc<AppState>;

pub fn app(state: Shared) -> Router {
    let limit = state.defaults.body_limit;
    Router::new()
        .route("/v1/chat/completions", routing::post(chat))
        .route("/v1/completions", routing::post(completions))
        .route("/v1/embeddings", routing::post(crate::embeddings::embeddings))
        .route("/v1/memories", routing::post(memories::ingest))
        .route("/v1/memories/search", routing::post(memories::search))
        .route("/v1/memories/jobs/{id}", routing::get(crate::jobs::status).delete(crate::jobs::cancel))
        .route("/v1/memories/{user}", routing::get(memories::list).delete(memories::forget_user))
        .route(
            "/v1/memories/{user}/{unit}",
            routing::get(memories::get).put(memories::update).delete(memories::forget_unit),
        )
        .route("/v1/memories/{user}/{unit}/history", routing::get(memories::history))
        .route("/v1/models", routing::get(models))
        .route("/healthz", routing::get(|| async { "ok\n" }))
        .route("/readyz", routing::get(readyz))
        .route("/metrics", routing::get(metrics))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError::MethodNotAllowed(format!("this endpoint does not take {method}"))
        })
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Traces every request (continuing the client's `traceparent`, if any)
/// and counts its response by route and status.
async fn count(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let method = req.method().clone();
    let span = info_span!(
        "http.request",
        otel.name = %format_args!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    propagate::continue_from_headers(&span, req.headers());
    let resp = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", i64::from(resp.status().as_u16()));
    s.metrics.request(&route, resp.status().as_u16());
    resp
}

pub(crate) fn body(b: std::result::Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes> {
    b.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge(limit),
        _ => ApiError::BadRequest(format!("cannot read the request body: {e}")),
    })
}

pub(crate) fn tenant(s: &AppState, headers: &HeaderMap) -> Result<String> {
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
    s.keys.tenant(auth)
}

/// A value unique within this process and, through the clock, across
/// restarts: response ids and the seeds of unseeded requests.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    inferscale_cluster::ring::hash64(&[nanos.to_le_bytes(), n.to_le_bytes()].concat())
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Which OpenAI endpoint a generation answers: the response shapes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `/v1/chat/completions`: `chat.completion` objects, `message`/`delta`.
    Chat,
    /// `/v1/completions`: `text_completion` objects, `text`.
    Text,
}

/// A validated chat request, ready for a worker.
struct Chat {
    req: pb::GenerateRequest,
    kind: Kind,
    mode: Mode,
    stream: bool,
    include_usage: bool,
    user: String,
}

/// Validates a chat request, or with `prompt` a completion (whose other
/// parameters arrive as a chat request without messages).
fn validate(s: &AppState, tenant: &str, r: ChatRequest, prompt: Option<String>) -> Result<Chat> {
    if r.model != s.model {
        return Err(ApiError::NotFound(format!(
            "model `{}` does not exist; this server serves `{}`",
            r.model, s.model
        )));
    }
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::BadRequest("only n = 1 is supported".into()));
    }
    if r.messages.is_empty() && prompt.is_none() {
        return Err(ApiError::BadRequest("`messages` is empty".into()));
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant") {
            return Err(ApiError::BadRequest(format!("messages[{i}].role {:?} is not supported", m.role)));
        }
        messages.push(pb::ChatMessage { role: m.role.clone(), content: m.content.text()? });
    }
    if prompt.is_none() && messages.last().is_none_or(|m| m.role != "user") {
        return Err(ApiError::BadRequest("the last message must have role `user` (the question)".into()));
    }
    let mem = r.memory.unwrap_or_default();
    // A request without a user has no memory to use: unless it asks for a
    // memory mode explicitly, it is answered without one.
    let mode = match (mem.mode, &r.user) {
        (Some(m), _) => m,
        (None, None) => Mode::None,
        (None, Some(_)) => s.defaults.mode,
    };
    let pmode = pb::MemoryMode::from(mode);
    let blend_ratio = match (mode, mem.blend_ratio) {
        (Mode::Blend, r) => Some(
            inferscale_types::check_blend_ratio(r.unwrap_or(s.defaults.blend_ratio))
                .map_err(|e| ApiError::BadRequest(format!("memory.{e}")))?,
        ),
        (_, None) => None,
        (_, Some(_)) => {
            return Err(ApiError::BadRequest(format!(
                "memory.blend_ratio applies to memory.mode = \"blend\", not {mode:?}",
                mode = mode.as_str()
            )));
        }
    };
    let k = mem.k.unwrap_or(u64::from(s.defaults.k));
    if pmode != pb::MemoryMode::None && (k == 0 || k > u64::from(s.defaults.max_k)) {
        return Err(ApiError::BadRequest(format!("memory.k = {k}: must be between 1 and {}", s.defaults.max_k)));
    }
    let user = match (&r.user, pmode) {
        (Some(u), _) => {
            openai::check_user(u)?;
            u.clone()
        }
        (None, pb::MemoryMode::None) => String::new(),
        (None, _) => {
            return Err(ApiError::BadRequest(format!(
                "`user` is required when memory is used (memory.mode = {mode}); leave memory.mode out or send \"none\" to chat without memory"
            )));
        }
    };
    let max_tokens = r.max_completion_tokens.or(r.max_tokens).unwrap_or(s.defaults.max_tokens);
    if max_tokens == 0 {
        return Err(ApiError::BadRequest("max_tokens must be at least 1".into()));
    }
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::BadRequest(format!("temperature {temperature} is outside [0, 2]")));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::BadRequest(format!("top_p {top_p} is outside (0, 1]")));
    }
    let stop = r.stop.map(openai::Stop::into_vec).unwrap_or_default();
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::BadRequest(format!(
            "stop takes up to 4 non-empty strings of at most {MAX_STOP_BYTES} bytes"
        )));
    }
    let req = pb::GenerateRequest {
        request_id: String::new(),
        user: if user.is_empty() { String::new() } else { scoped(tenant, &user) },
        messages,
        mode: pmode as i32,
        k: k as u32,
        window: mem.window,
        sampling: Some(pb::Sampling {
            temperature,
            top_p,
            top_k: 0,
            // Unseeded requests differ from one another, as OpenAI's do.
            seed: r.seed.unwrap_or_else(unique),
            max_tokens,
            stop,
            ignore_eos: r.ignore_eos.unwrap_or(false),
        }),
        deadline_ms: s.defaults.deadline.as_millis().min(u128::from(u32::MAX)) as u32,
        blend_ratio,
        prompt,
        agent_id: mem.agent_id.clone().unwrap_or_default(),
        run_id: mem.run_id.clone().unwrap_or_default(),
    };
    let include_usage = r.stream_options.is_some_and(|o| o.include_usage);
    let kind = if req.prompt.is_some() { Kind::Text } else { Kind::Chat };
    Ok(Chat { req, kind, mode, stream: r.stream, include_usage, user })
}

/// Longest stop string: a stop is matched against the generated text at
/// every token, so a long one costs every step and can never match.
const MAX_STOP_BYTES: usize = 1024;

/// How long a request keeps retrying a user's memory while it moves
/// between workers or its home fails over to its replica.
pub(crate) const RETRY_FOR: Duration = Duration::from_secs(15);
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(150);

/// Whether a failed call means the worker itself is unreachable (rather
/// than a refusal it answered with): its health is then re-probed before
/// it gets more requests.
fn unreachable(e: &tonic::Status) -> bool {
    // A marked refusal (moving, damaged) comes from a worker that is up.
    (e.code() == tonic::Code::Unavailable && pb::ErrorKind::of(e).is_none()) || crate::error::connection_lost(e)
}

/// Awaits `fut`, unless the cluster view changes first so that `gone`
/// holds (then `None`): a call to a worker that hangs rather than fails is
/// abandoned once the leader fences that worker.
async fn unless_view<T>(
    changes: &mut tokio::sync::watch::Receiver<Arc<inferscale_cluster::ClusterView>>,
    gone: impl Fn(&inferscale_cluster::ClusterView) -> bool,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            r = &mut fut => return Some(r),
            Ok(()) = changes.changed() => {
                if gone(&changes.borrow_and_update()) {
                    return None;
                }
            }
        }
    }
}

/// Sends `chat` to a worker and waits for its first event. Nothing has been
/// streamed to the client yet, so a retryable failure is retried: a
/// request without memory once, on another worker; a request with memory
/// for up to [`RETRY_FOR`], on whichever worker answers the user's reads
/// by then (its new home after a move, its replica after a crash). A
/// worker that leaves the view before its first event (fenced: it hangs)
/// counts as a failure to connect.
async fn start(
    s: &AppState,
    chat: &Chat,
) -> Result<(InFlight, tonic::Streaming<pb::GenerateEvent>, Option<pb::GenerateEvent>)> {
    let memory = chat.req.mode != pb::MemoryMode::None as i32;
    let until = Instant::now() + RETRY_FOR;
    let (mut tried, mut damaged, mut refused) = (Vec::new(), Vec::new(), None);
    let mut changes = s.workers.subscribe();
    loop {
        changes.mark_unchanged();
        let picked = match memory {
            false => s.workers.any(&chat.user, &tried),
            // Workers where the user's memory is damaged are skipped: a
            // replica may hold it whole.
            true => s.workers.reader_skipping(&chat.req.user, &damaged),
        };
        let w = match picked {
            Ok(w) => w,
            // Waiting helps only while the memory moves (it lands soon): a
            // user whose workers are known down is told at once (503,
            // Retry-After), not after the retry window.
            Err(e) if memory && e.retryable() && Instant::now() < until && s.workers.moving(&chat.req.user) => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
            // No other worker holds it whole: the damaged one's answer says why.
            Err(e) => return Err(refused.take().unwrap_or(e)),
        };
        let span = info_span!("route", worker = %w.worker().name, attempt = tried.len() as i64 + 1, memory);
        let name = w.worker().name.clone();
        let attempt = async {
            let mut stream =
                w.worker().client().generate(request(chat.req.clone(), s.defaults.deadline)).await?.into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        };
        let left = |v: &inferscale_cluster::ClusterView| !v.alive(&name);
        let attempt = unless_view(&mut changes, left, attempt.instrument(span)).await;
        let attempt = attempt.unwrap_or_else(|| Err(tonic::Status::unavailable(format!("worker {name} was fenced"))));
        match attempt {
            Ok((stream, first)) => return Ok((w, stream, first)),
            Err(status) => {
                if unreachable(&status) {
                    w.worker().mark_down();
                }
                let is_damaged = pb::ErrorKind::of(&status) == Some(pb::ErrorKind::Damaged);
                let e = ApiError::from(status);
                if is_damaged {
                    damaged.push(w.worker().name.clone());
                    refused = Some(ApiError::Unavailable(e.to_string()));
                    continue;
                }
                let again = match memory {
                    false => tried.is_empty(),
                    true => Instant::now() < until,
                };
                if !(e.retryable() && again) {
                    return Err(e);
                }
                tried.push(w.worker().name.clone());
                if memory {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }
}

/// Runs `call` on every writer of `user` at once (told whether it is the
/// home) and succeeds when all do, returning the home's answer. A retryable failure (a writer frozen by a
/// move, or unreachable until the view drops it) is retried for up to
/// [`RETRY_FOR`] against the writers of the view by then; the calls are
/// idempotent (ingest skips units it has), so a retry stores nothing twice.
/// When the view changes the user's writers mid-call (a hung writer was
/// fenced), the calls are abandoned and sent to the new writers: a write
/// is acknowledged by the writers of the view it completes in.
/// `tolerate` lets a non-home writer's error count as success (a replica
/// that does not have what is being deleted).
pub(crate) async fn write_all<T, F, Fut>(
    s: &AppState,
    user: &str,
    tolerate: fn(&tonic::Status) -> bool,
    call: F,
) -> Result<T>
where
    F: Fn(WorkerClient, bool) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let until = Instant::now() + RETRY_FOR;
    let mut changes = s.workers.subscribe();
    loop {
        changes.mark_unchanged();
        let writers = s.workers.writers(user)?;
        let names: Vec<&str> = writers.iter().map(|w| w.name.as_str()).collect();
        let calls = writers.iter().enumerate().map(|(i, w)| call(w.client(), i == 0));
        let moved = |v: &inferscale_cluster::ClusterView| v.writers(user, s.workers.replicates()) != names;
        let results = unless_view(&mut changes, moved, futures_util::future::join_all(calls)).await;
        let Some(results) = results else {
            if Instant::now() < until {
                continue;
            }
            return Err(ApiError::Unavailable("this user's writers kept changing; retry".into()));
        };
        let mut home = None;
        let mut failed = None;
        for (i, (r, w)) in results.into_iter().zip(&writers).enumerate() {
            match r {
                Ok(resp) if i == 0 => home = Some(resp.into_inner()),
                Ok(_) => {}
                Err(e) if i > 0 && tolerate(&e) => {}
                Err(e) => {
                    if unreachable(&e) {
                        w.mark_down();
                    }
                    failed.get_or_insert(e);
                }
            }
        }
        // Every writer known down and nothing moving: no retry can land
        // before one comes back, so the caller hears it now.
        let all_down = writers.iter().all(|w| !w.is_healthy() && w.unreachable_for().is_some());
        match (failed, home) {
            (None, Some(answer)) => return Ok(answer),
            (Some(e), _) if all_down && !s.workers.moving(user) => return Err(e.into()),
            (Some(e), _) if ApiError::from(e.clone()).retryable() && Instant::now() < until => {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            (Some(e), _) => return Err(e.into()),
            (None, None) => return Err(ApiError::Internal("no answer from the user's home worker".into())),
        }
    }
}

pub(crate) type WorkerClient = inferscale_proto::worker_client::WorkerClient<tonic::transport::Channel>;

fn usage(mode: Mode, f: &pb::Finished) -> openai::Usage {
    let u = f.usage.unwrap_or_default();
    openai::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens + u.completion_tokens,
        // Recomputed memory tokens were computed, not taken from a cache.
        prompt_tokens_details: openai::PromptDetails {
            cached_tokens: (u.cached_tokens + u.injected_tokens).saturating_sub(u.recomputed_tokens),
        },
        memory: openai::MemoryUsage {
            mode,
            facts: u.facts,
            injected_tokens: u.injected_tokens,
            recomputed_tokens: (mode == Mode::Blend).then_some(u.recomputed_tokens),
            fact_ids: f.fact_ids.clone(),
            sources: u.sources.filter(|_| mode.injects()).map(|s| openai::FactSources {
                device: s.device,
                host: s.host,
                disk: s.disk,
                prefilled: s.prefilled,
            }),
        },
    }
}

fn timings(f: &pb::Finished) -> serde_json::Value {
    let t = f.timings.unwrap_or_default();
    json!({"queue_ms": t.queue_ms, "retrieve_ms": t.retrieve_ms, "inject_ms": t.inject_ms,
           "prefill_ms": t.prefill_ms, "first_token_ms": t.first_token_ms, "total_ms": t.total_ms})
}

/// Latency bookkeeping of one chat request.
struct Clock {
    start: Instant,
    first: Option<Instant>,
    tokens: u64,
}

impl Clock {
    fn token(&mut self) {
        self.first.get_or_insert_with(Instant::now);
        self.tokens += 1;
    }

    fn record(&self, m: &Metrics, mode: Mode, f: &pb::Finished) {
        let i = mode_index(mode);
        m.e2e[i].observe(self.start.elapsed().as_secs_f64());
        m.prompt_tokens.fetch_add(f.usage.as_ref().map_or(0, |u| u64::from(u.prompt_tokens)), Ordering::Relaxed);
        if let Some(first) = self.first {
            m.ttft[i].observe((first - self.start).as_secs_f64());
            if self.tokens > 1 {
                m.tpot[i].observe(first.elapsed().as_secs_f64() / (self.tokens - 1) as f64);
            }
        }
        m.output_tokens.fetch_add(self.tokens, Ordering::Relaxed);
    }
}

async fn chat(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    let clock = Clock { start: Instant::now(), first: None, tokens: 0 };
    let (tenant, parsed) = openai_request(&s, &headers, b)?;
    let chat = validate(&s, &tenant, parsed, None)?;
    generate(s, &tenant, chat, clock).await
}

/// The tenant and the parsed body of an OpenAI generation request, with
/// the parameters we do not implement refused by name.
fn openai_request<T: serde::de::DeserializeOwned>(
    s: &AppState,
    headers: &HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<(String, T)> {
    let tenant = tenant(s, headers)?;
    let bytes = body(b, s.defaults.body_limit)?;
    let parsed = openai::parse(&bytes)?;
    openai::check_unsupported(&bytes)?;
    Ok((tenant, parsed))
}

async fn completions(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    let clock = Clock { start: Instant::now(), first: None, tokens: 0 };
    let (tenant, parsed): (String, openai::CompletionRequest) = openai_request(&s, &headers, b)?;
    let (prompt, rest) = parsed.split()?;
    if prompt.trim().is_empty() {
        return Err(ApiError::Param { param: "prompt", message: "the prompt is empty".into() });
    }
    let chat = validate(&s, &tenant, rest, Some(prompt))?;
    generate(s, &tenant, chat, clock).await
}

/// Runs a validated request on a worker and answers it, streamed or whole.
async fn generate(s: Shared, tenant: &str, chat: Chat, clock: Clock) -> Result<Response> {
    let (guard, stream, first) = start(&s, &chat).await.map_err(|e| e.unscope(tenant))?;
    let prefix = match chat.kind {
        Kind::Chat => "chatcmpl",
        Kind::Text => "cmpl",
    };
    let id = format!("{prefix}-{:016x}", unique());
    let worker = guard.worker().name.clone();
    let mut resp = if chat.stream {
        let st = SseState {
            s: s.clone(),
            chat,
            id,
            created: now_secs(),
            _guard: guard,
            stream,
            pending: first,
            clock,
            sent_role: false,
            done: false,
            _span: tracing::Span::current(),
        };
        sse(st).into_response()
    } else {
        let r = complete(&s, chat, id, stream, first, clock).await;
        drop(guard);
        r?.into_response()
    };
    if let Ok(v) = header::HeaderValue::from_str(&worker) {
        resp.headers_mut().insert(WORKER_HEADER, v);
    }
    Ok(resp)
}

async fn complete(
    s: &AppState,
    chat: Chat,
    id: String,
    mut stream: tonic::Streaming<pb::GenerateEvent>,
    mut next: Option<pb::GenerateEvent>,
    mut clock: Clock,
) -> Result<Json<serde_json::Value>> {
    use pb::generate_event::Event as E;
    let mut text = String::new();
    loop {
        match next.and_then(|e| e.event) {
            Some(E::Token(t)) => {
                clock.token();
                text.push_str(&t.text);
            }
            Some(E::Finished(f)) => {
                clock.record(&s.metrics, chat.mode, &f);
                let usage = usage(chat.mode, &f);
                let body = match chat.kind {
                    Kind::Chat => serde_json::to_value(openai::ChatResponse {
                        id,
                        object: "chat.completion",
                        created: now_secs(),
                        model: s.model.clone(),
                        choices: vec![openai::Choice {
                            index: 0,
                            message: openai::AssistantMessage { role: "assistant", content: text },
                            finish_reason: f.reason.clone(),
                        }],
                        usage,
                        timings: timings(&f),
                    })
                    .map_err(|e| ApiError::Internal(format!("encoding the response: {e}")))?,
                    Kind::Text => json!({
                        "id": id, "object": "text_completion", "created": now_secs(), "model": s.model,
                        "choices": [{"index": 0, "text": text, "finish_reason": f.reason, "logprobs": null}],
                        "usage": usage, "timings": timings(&f),
                    }),
                };
                return Ok(Json(body));
            }
            None => return Err(ApiError::Internal("the worker ended the stream without finishing".into())),
        }
        next = stream.message().await?;
    }
}

struct SseState {
    s: Shared,
    chat: Chat,
    id: String,
    created: u64,
    _guard: InFlight,
    stream: tonic::Streaming<pb::GenerateEvent>,
    pending: Option<pb::GenerateEvent>,
    clock: Clock,
    sent_role: bool,
    done: bool,
    /// The request's span lives as long as its stream, so the trace
    /// covers the whole answer rather than the response headers.
    _span: tracing::Span,
}

/// One streamed piece: a chat `delta` (for a completion, its `content`
/// becomes the choice's `text`), or the finish.
fn chunk(st: &SseState, delta: serde_json::Value, finish: Option<&str>) -> SseEvent {
    let body = match st.chat.kind {
        Kind::Chat => json!({"id": st.id, "object": "chat.completion.chunk", "created": st.created,
                             "model": st.s.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        Kind::Text => json!({"id": st.id, "object": "text_completion", "created": st.created, "model": st.s.model,
                             "choices": [{"index": 0, "text": delta.get("content").and_then(|c| c.as_str()).unwrap_or(""),
                                          "finish_reason": finish, "logprobs": null}]}),
    };
    SseEvent::default().data(body.to_string())
}

/// Streams OpenAI chunks; dropping this stream (the client went away)
/// drops the worker call, which cancels the request and frees its blocks.
fn sse(st: SseState) -> Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let events = futures_util::stream::unfold(st, |mut st| async move {
        use pb::generate_event::Event as E;
        if st.done {
            return None;
        }
        let next = match st.pending.take() {
            Some(e) => Ok(Some(e)),
            None => st.stream.message().await,
        };
        let mut out = Vec::new();
        match next {
            Ok(Some(pb::GenerateEvent { event: Some(E::Token(t)) })) => {
                st.clock.token();
                let mut delta = json!({"content": t.text});
                if !st.sent_role {
                    delta["role"] = json!("assistant");
                    st.sent_role = true;
                }
                out.push(chunk(&st, delta, None));
            }
            Ok(Some(pb::GenerateEvent { event: Some(E::Finished(f)) })) => {
                st.clock.record(&st.s.metrics, st.chat.mode, &f);
                out.push(chunk(&st, json!({}), Some(&f.reason)));
                if st.chat.include_usage {
                    let object = match st.chat.kind {
                        Kind::Chat => "chat.completion.chunk",
                        Kind::Text => "text_completion",
                    };
                    let body = json!({"id": st.id, "object": object, "created": st.created,
                                      "model": st.s.model, "choices": [], "usage": usage(st.chat.mode, &f),
                                      "timings": timings(&f)});
                    out.push(SseEvent::default().data(body.to_string()));
                }
                out.push(SseEvent::default().data("[DONE]"));
                st.done = true;
            }
            Ok(_) => {
                let e = ApiError::Internal("the worker ended the stream without finishing".into());
                out.push(SseEvent::default().data(e.body().to_string()));
                st.done = true;
            }
            Err(status) => {
                out.push(SseEvent::default().data(ApiError::from(status).body().to_string()));
                st.done = true;
            }
        }
        Some((futures_util::stream::iter(out.into_iter().map(Ok)), st))
    })
    .flatten();
    Sse::new(events).keep_alive(KeepAlive::default())
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Result<Json<serde_json::Value>> {
    tenant(&s, &headers)?;
    Ok(Json(json!({"object": "list", "data": [{"id": s.model, "object": "model", "created": 0,
                                                "owned_by": "inferscale"}]})))
}

async fn readyz(State(s): State<Shared>) -> Response {
    let all = s.workers.all();
    let healthy = all.iter().filter(|w| w.is_healthy()).count();
    let status = if healthy > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"ready": healthy > 0, "healthy_workers": healthy, "workers": all.len()}))).into_response()
}

async fn metrics(State(s): State<Shared>) -> Response {
    let all = s.workers.all();
    let healthy = all.iter().filter(|w| w.is_healthy()).count() as f64;
    let in_flight = all.iter().map(|w| w.in_flight()).sum::<usize>() as f64;
    let view = s.workers.view();
    let r = &s.rebalance;
    let mut text = s.metrics.render(&[
        ("inferscale_workers_healthy", "Workers answering health checks.", healthy),
        ("inferscale_requests_in_flight", "Requests the router has at workers.", in_flight),
        ("inferscale_cluster_members", "Workers registered in the placement view.", view.members.len() as f64),
        ("inferscale_cluster_ring_workers", "Workers in the ring (active).", view.ring().workers().len() as f64),
        ("inferscale_cluster_placement_records", "Users placed off the ring.", view.records.len() as f64),
        (
            "inferscale_cluster_view_connected",
            "1 while the placement store is reachable.",
            f64::from(u8::from(view.connected)),
        ),
        ("inferscale_migrations_total", "Shard moves made by this router.", r.moves.load(Ordering::Relaxed) as f64),
        (
            "inferscale_migrated_bytes_total",
            "Bytes of shards moved by this router.",
            r.moved_bytes.load(Ordering::Relaxed) as f64,
        ),
        (
            "inferscale_rebalance_failures_total",
            "Rebalancing steps that failed.",
            r.failures.load(Ordering::Relaxed) as f64,
        ),
        (
            "inferscale_rebalance_rounds_total",
            "Rebalancing rounds planned as the leader.",
            r.rounds.load(Ordering::Relaxed) as f64,
        ),
        (
            "inferscale_cluster_replicas_out_of_step",
            "Users whose replica lacks them or holds other units than their home (leader only, last round).",
            r.stale_replicas.load(Ordering::Relaxed) as f64,
        ),
        (
            "inferscale_cluster_fenced_total",
            "Workers this router fenced (lease revoked after failed health probes).",
            r.fenced.load(Ordering::Relaxed) as f64,
        ),
    ]);
    // The workers' load as the last Stats calls saw it, under the names
    // and types each worker's own /metrics uses, labelled by worker.
    use prom::worker::*;
    type Field = fn(&pb::StatsResponse) -> f64;
    let fields: [(&str, &str, Field); 6] = [
        (REQUESTS_RUNNING, "Requests in the worker's running batch.", |s| s.running.into()),
        (REQUESTS_WAITING, "Requests waiting for admission at the worker.", |s| s.waiting.into()),
        (KV_BLOCKS, "KV cache blocks of the worker (capacity).", |s| s.kv_blocks_total.into()),
        (KV_BLOCKS_FREE, "Free KV cache blocks of the worker.", |s| s.kv_blocks_free.into()),
        (USERS, "Users with memory on the worker.", |s| s.users.into()),
        (MEMORY_UNITS, "Memory units stored on the worker.", |s| s.facts as f64),
    ];
    let stats: Vec<(String, pb::StatsResponse)> =
        all.iter().filter_map(|w| w.stats().map(|st| (prom::label(&w.name), st))).collect();
    for (name, help, get) in fields {
        prom::header(&mut text, name, "gauge", help);
        for (worker, st) in &stats {
            text.push_str(&format!("{name}{{worker=\"{worker}\"}} {}\n", get(st)));
        }
    }
    prom::header(&mut text, REQUESTS_TOTAL, "counter", "Requests that left the worker, by how.");
    for (worker, st) in &stats {
        for (status, v) in
            [("finished", st.requests_finished), ("cancelled", st.requests_cancelled), ("failed", st.requests_failed)]
        {
            text.push_str(&format!("{REQUESTS_TOTAL}{{worker=\"{worker}\",status=\"{status}\"}} {v}\n"));
        }
    }
    prom::build_info(&mut text, "router", env!("CARGO_PKG_VERSION"));
    prom::process(&mut text);
    ([(header::CONTENT_TYPE, prom::CONTENT_TYPE)], text).into_response()
}
