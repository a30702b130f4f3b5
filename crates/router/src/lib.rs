//! The router (design.md §4): an OpenAI-compatible HTTP API in front of
//! gRPC workers. Users are placed on workers by consistent hashing; each
//! request is validated here (clear 4xx errors) before a worker sees it.

pub mod api;
pub mod auth;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod workers;

use std::sync::Arc;
use std::time::Duration;

pub use api::{AppState, Defaults};
pub use auth::Keys;
pub use error::{ApiError, Result};
pub use workers::Workers;

/// Everything a router needs to start.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Worker gRPC addresses (`host:port`).
    pub workers: Vec<String>,
    pub keys: Keys,
    /// Model name clients send; `None` takes the first worker's.
    pub model: Option<String>,
    pub defaults: Defaults,
    /// Bounded-load factor: no worker above this × the average in-flight
    /// (for requests that may go to any worker).
    pub load_factor: f64,
}

/// Connects to the workers, waits up to `wait` for one to be healthy, and
/// returns the HTTP app.
pub async fn build(cfg: RouterConfig, wait: Duration) -> Result<axum::Router> {
    let workers = Arc::new(Workers::new(&cfg.workers, cfg.load_factor)?);
    let deadline = tokio::time::Instant::now() + wait;
    while workers.probe().await == 0 {
        if tokio::time::Instant::now() > deadline {
            return Err(ApiError::Unavailable(format!("no worker of {:?} became healthy", cfg.workers)));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let model = match cfg.model {
        Some(m) => m,
        None => {
            let mut c = workers.all()[0].client();
            c.health(inferscale_proto::HealthRequest {}).await?.into_inner().model
        }
    };
    workers.watch(Duration::from_secs(1));
    let state =
        AppState { workers, keys: cfg.keys, model, defaults: cfg.defaults, metrics: metrics::Metrics::default() };
    Ok(api::app(Arc::new(state)))
}
