//! The router's shared state — its workers, keys, model, defaults, metrics,
//! jobs — and the small helpers every handler uses to read a request's
//! body and tenant.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode, header};
use inferscale_types::Mode;

use crate::auth::Keys;
use crate::error::{ApiError, Result};
use crate::metrics::Metrics;
use crate::workers::Workers;

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
    pub jobs: crate::job_table::Jobs,
}

pub(crate) type Shared = Arc<AppState>;

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
pub(crate) fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    inferscale_cluster::ring::hash64(&[nanos.to_le_bytes(), n.to_le_bytes()].concat())
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
