//! The HTTP surface: every route and what handles it, the middleware that
//! traces and counts each request, and the small endpoints (models, health,
//! readiness, metrics). Generation lives in `generate.rs`, the memory API
//! in `memories.rs` (Mem0's paths over it in `mem0/`), the rules in
//! `validate.rs`, worker calls in `dispatch.rs`.

use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use axum::body::HttpBody as _;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing};
use futures_util::StreamExt;
use inferscale_proto as pb;
use inferscale_telemetry::{prom, propagate};
use serde_json::json;
use tracing::{Instrument, info_span};

use crate::error::{ApiError, Result};
use crate::generate;
use crate::memories;
use crate::reqlog;
use crate::state::{Shared, now_secs, tenant};

pub fn app(state: Shared) -> Router {
    let limit = state.defaults.body_limit;
    STARTED.get_or_init(now_secs);
    Router::new()
        .route("/v1/chat/completions", routing::post(generate::chat))
        .route("/v1/completions", routing::post(generate::completions))
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
        .route("/v1/models/{id}", routing::get(model))
        .route("/healthz", routing::get(|| async { "ok\n" }))
        .route("/readyz", routing::get(readyz))
        .route("/metrics", routing::get(metrics))
        .merge(crate::mem0::routes())
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError::MethodNotAllowed(format!("this endpoint does not take {method}"))
        })
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Traces every request (continuing the client's `traceparent`, if any),
/// counts its response by route and status, and logs it (`reqlog`) when
/// its body has ended.
async fn count(State(s): State<Shared>, mut req: Request, next: Next) -> Response {
    let start = std::time::Instant::now();
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let method = req.method().clone();
    let facts = reqlog::Handle::default();
    if let Ok(t) = tenant(&s, req.headers()) {
        facts.update(|f| f.tenant = Some(t));
    }
    req.extensions_mut().insert(facts.clone());
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
    if let Some(reqlog::ErrorReason(why)) = resp.extensions().get::<reqlog::ErrorReason>() {
        facts.update(|f| f.error = Some(why.clone()));
    }
    let line = reqlog::Line { method: method.to_string(), route, status: resp.status().as_u16(), start, facts };
    if resp.body().size_hint().exact().is_some() {
        // A whole answer: logged now (the line is written when dropped).
        return resp;
    }
    // A stream: logged when its body is dropped, after the last byte or
    // when the client goes away, with what the stream learned.
    resp.map(|b| {
        axum::body::Body::from_stream(b.into_data_stream().map(move |chunk| {
            let _ = &line;
            chunk
        }))
    })
}

/// When this process began serving its model: `/v1/models`' `created`.
static STARTED: OnceLock<u64> = OnceLock::new();

fn model_card(s: &crate::state::AppState) -> serde_json::Value {
    json!({"id": s.model, "object": "model", "created": STARTED.get().copied().unwrap_or(0),
           "owned_by": "inferscale"})
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Result<Json<serde_json::Value>> {
    tenant(&s, &headers)?;
    Ok(Json(json!({"object": "list", "data": [model_card(&s)]})))
}

/// `GET /v1/models/{id}`: the model this server serves, or a 404 naming it.
async fn model(State(s): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Result<Json<serde_json::Value>> {
    tenant(&s, &headers)?;
    match id == s.model {
        true => Ok(Json(model_card(&s))),
        false => Err(ApiError::NotFound(format!("model `{id}` does not exist; this server serves `{}`", s.model))),
    }
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
