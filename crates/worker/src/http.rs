//! The worker's HTTP port: `/metrics` (Prometheus), `/healthz` (the
//! process answers and its engine thread runs) and `/readyz` (the engine
//! is loaded and its thread runs) — what a scraper and an orchestrator's probes need, apart from
//! the gRPC service.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Router, routing};
use inferscale_telemetry::prom;

use crate::protocol::Command;
use crate::service::WorkerService;

pub fn app(svc: WorkerService) -> Router {
    Router::new()
        .route("/metrics", routing::get(metrics))
        .route("/healthz", routing::get(healthz))
        .route("/readyz", routing::get(readyz))
        .with_state(svc)
}

/// Serves [`app`] on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    svc: WorkerService,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(svc)).with_graceful_shutdown(shutdown).await
}

/// Liveness: the process answers and its engine thread runs. A worker
/// whose engine thread stopped (a fatal error) serves nothing again: a
/// liveness probe must see it and restart it.
async fn healthz(State(svc): State<WorkerService>) -> Response {
    match svc.is_ready() {
        true => "ok\n".into_response(),
        false => {
            (StatusCode::SERVICE_UNAVAILABLE, "the engine thread has stopped: restart the worker\n").into_response()
        }
    }
}

/// Readiness: the engine runs. It stays ready with a full disk — reads
/// are served, writes answer 507 — and says so here (and in
/// `inferscale_worker_disk_full`).
async fn readyz(State(svc): State<WorkerService>) -> Response {
    match (svc.is_ready(), svc.metrics().disk_full()) {
        (true, false) => "ready\n".into_response(),
        (true, true) => "ready (the memory's disk is full: reads are served, writes are refused)\n".into_response(),
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "the engine is not running\n").into_response(),
    }
}

async fn metrics(State(svc): State<WorkerService>) -> Response {
    match svc.handle().call(|reply| Command::Stats { memory_bytes: true, reply }).await {
        Ok(stats) => {
            let tier = if svc.info().backend == "cpu" { "host" } else { "device" };
            ([(header::CONTENT_TYPE, prom::CONTENT_TYPE)], svc.metrics().render(&stats, tier)).into_response()
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("{}\n", e.message())).into_response(),
    }
}
