//! The router (docs/design.md §4): an OpenAI-compatible HTTP API in front of
//! gRPC workers. Users are placed on workers by consistent hashing; each
//! request is validated here (clear 4xx errors) before a worker sees it.
//! In a cluster the router also watches membership and placement in the
//! placement store, and the elected one rebalances (`rebalance`).

mod api;
mod auth;
mod b64;
mod dispatch;
mod embeddings;
mod error;
#[cfg(test)]
mod fake_worker;
mod fence;
mod generate;
mod ingest;
mod job_table;
mod jobs;
mod mem0;
mod memories;
mod metrics;
mod openai;
mod rebalance;
pub mod reqlog;
mod state;
mod validate;
mod workers;

use std::sync::Arc;
use std::time::Duration;

use inferscale_cluster::Placement;
use inferscale_cluster::membership::{Campaign, watch_view};
use inferscale_cluster::view::Keys as ClusterKeys;

pub use auth::Keys;
pub use error::{ApiError, Result};
pub use generate::WORKER_HEADER;
pub use inferscale_proto::tls::{Security, TlsFiles};
pub use rebalance::{DEFAULT_FENCE_AFTER, RebalanceConfig, RebalanceStats};
pub use state::{AppState, Defaults};
pub use workers::Workers;

/// Where the router learns its workers.
#[derive(Clone)]
pub enum Membership {
    /// A fixed list of worker gRPC addresses (`host:port`): no placement
    /// store, no replication, no rebalancing.
    Fixed(Vec<String>),
    /// Workers registered in a placement store (etcd, or embedded for one
    /// node); this router watches it and, when elected leader, rebalances.
    Store {
        store: Arc<dyn Placement>,
        keys: ClusterKeys,
        /// This router's name in the leader election.
        name: String,
        /// Lease TTL of the leader key.
        ttl: Duration,
        rebalance: RebalanceConfig,
    },
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Membership::Fixed(w) => write!(f, "Fixed({w:?})"),
            Membership::Store { store, name, .. } => write!(f, "Store({}, router {name})", store.describe()),
        }
    }
}

/// Everything a router needs to start.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub membership: Membership,
    pub keys: Keys,
    /// Model name clients send; `None` takes the first worker's.
    pub model: Option<String>,
    pub defaults: Defaults,
    /// Bounded-load factor: no worker above this × the average in-flight
    /// (for requests that may go to any worker).
    pub load_factor: f64,
    /// How workers are dialled: plaintext or mutual TLS.
    pub security: Security,
}

/// Connects to the workers, waits up to `wait` for one to be healthy (and,
/// in a cluster, in the ring), and returns the HTTP app.
pub async fn build(cfg: RouterConfig, wait: Duration) -> Result<axum::Router> {
    reqlog::configure_from_env().map_err(ApiError::BadRequest)?;
    let rebalance_stats = Arc::new(RebalanceStats::default());
    let workers = match &cfg.membership {
        Membership::Fixed(addrs) => Arc::new(Workers::fixed(addrs, cfg.load_factor, cfg.security.clone())?),
        Membership::Store { store, keys, name, ttl, rebalance } => {
            let view = watch_view(store.clone(), keys.clone(), inferscale_cluster::DEFAULT_VNODES);
            let workers = Arc::new(Workers::new(view, cfg.load_factor, rebalance.replicate, cfg.security.clone()));
            let campaign = Arc::new(Campaign::spawn(store.clone(), keys.clone(), name.clone(), *ttl));
            if let Some(after) = rebalance.fence_after {
                let fencer = fence::Fencer {
                    store: store.clone(),
                    keys: keys.clone(),
                    workers: workers.clone(),
                    after,
                    stats: rebalance_stats.clone(),
                };
                fencer.spawn(campaign.clone());
            }
            let rebalancer = rebalance::Rebalancer {
                store: store.clone(),
                keys: keys.clone(),
                workers: workers.clone(),
                cfg: rebalance.clone(),
                stats: rebalance_stats.clone(),
                nccl_failed: Default::default(),
                stale: Default::default(),
            };
            rebalancer.spawn(campaign);
            workers
        }
    };
    let deadline = tokio::time::Instant::now() + wait;
    while workers.probe().await == 0 || workers.view().ring().is_empty() {
        if tokio::time::Instant::now() > deadline {
            return Err(ApiError::Unavailable(format!("no worker of {:?} became healthy", cfg.membership)));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let model = match cfg.model {
        Some(m) => m,
        None => {
            let first = workers.all().into_iter().find(|w| w.is_healthy());
            let first = first.ok_or_else(|| ApiError::Unavailable("no healthy worker".into()))?;
            let mut c = first.client();
            c.health(inferscale_proto::HealthRequest {}).await?.into_inner().model
        }
    };
    workers.watch(Duration::from_secs(1));
    let state = AppState {
        workers,
        keys: cfg.keys,
        model,
        defaults: cfg.defaults,
        metrics: metrics::Metrics::default(),
        rebalance: rebalance_stats,
        jobs: job_table::Jobs::default(),
    };
    Ok(api::app(Arc::new(state)))
}
