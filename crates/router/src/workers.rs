//! The workers a router sends to: gRPC clients, health, in-flight counts,
//! and which worker serves which user.
//!
//! A user's memory lives on its home worker (the consistent-hash ring over
//! every configured worker), so everything that reads or writes memory goes
//! there; when that worker is down the request fails with 503 rather than
//! landing on a worker without the user's facts. Requests without memory
//! may go anywhere: they follow the ring under bounded load over healthy
//! workers, so no worker takes more than `load_factor` × the average.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use inferscale_cluster::Ring;
use inferscale_proto::worker_client::WorkerClient;
use tonic::transport::{Channel, Endpoint};

use crate::error::{ApiError, Result};

pub struct Worker {
    pub name: String,
    pub addr: String,
    client: WorkerClient<Channel>,
    healthy: AtomicBool,
    in_flight: AtomicUsize,
    /// The worker's last answer to `Stats`.
    stats: std::sync::Mutex<Option<inferscale_proto::StatsResponse>>,
}

impl Worker {
    pub fn stats(&self) -> Option<inferscale_proto::StatsResponse> {
        self.stats.lock().ok().and_then(|s| *s)
    }

    pub fn client(&self) -> WorkerClient<Channel> {
        self.client.clone()
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// Counts a request against a worker while it lives.
pub struct InFlight(Arc<Worker>);

impl InFlight {
    pub fn worker(&self) -> &Arc<Worker> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct Workers {
    all: Vec<Arc<Worker>>,
    ring: Ring,
    load_factor: f64,
}

impl Workers {
    /// Clients for `addrs` (`host:port`), connected lazily.
    pub fn new(addrs: &[String], load_factor: f64) -> Result<Workers> {
        if addrs.is_empty() {
            return Err(ApiError::Internal("no workers configured".into()));
        }
        let mut all = Vec::new();
        for addr in addrs {
            let uri = if addr.contains("://") { addr.clone() } else { format!("http://{addr}") };
            let endpoint = Endpoint::from_shared(uri)
                .map_err(|e| ApiError::Internal(format!("worker address {addr:?}: {e}")))?
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true);
            let client = WorkerClient::new(endpoint.connect_lazy())
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20);
            all.push(Arc::new(Worker {
                name: addr.clone(),
                addr: addr.clone(),
                client,
                healthy: AtomicBool::new(false),
                in_flight: AtomicUsize::new(0),
                stats: std::sync::Mutex::new(None),
            }));
        }
        let ring = Ring::new(all.iter().map(|w| w.name.clone()), inferscale_cluster::ring::DEFAULT_VNODES);
        Ok(Workers { all, ring, load_factor })
    }

    pub fn all(&self) -> &[Arc<Worker>] {
        &self.all
    }

    fn by_name(&self, name: &str) -> Option<&Arc<Worker>> {
        self.all.iter().find(|w| w.name == name)
    }

    fn take(w: &Arc<Worker>) -> InFlight {
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(w.clone())
    }

    /// The worker holding `user`'s memory, if it is healthy.
    pub fn home(&self, user: &str) -> Result<InFlight> {
        let name = self.ring.home(user).ok_or_else(|| ApiError::Unavailable("no workers".into()))?;
        let w = self.by_name(name).ok_or_else(|| ApiError::Internal(format!("ring names unknown worker {name}")))?;
        if !w.is_healthy() {
            return Err(ApiError::Unavailable(format!(
                "worker {} holding this user's memory is unavailable; retry later",
                w.name
            )));
        }
        Ok(Self::take(w))
    }

    /// A worker for a request that needs no memory: bounded load over the
    /// healthy workers, starting at `user`'s place on the ring; `skip`
    /// excludes workers already tried.
    pub fn any(&self, user: &str, skip: &[String]) -> Result<InFlight> {
        let eligible = |name: &str| self.by_name(name).is_some_and(|w| w.is_healthy() && !skip.contains(&w.name));
        let load = |name: &str| self.by_name(name).map_or(0, |w| w.in_flight());
        let name = self
            .ring
            .assign_among(user, eligible, load, self.load_factor)
            .ok_or_else(|| ApiError::Unavailable("no healthy worker".into()))?;
        let w = self.by_name(name).ok_or_else(|| ApiError::Internal(format!("unknown worker {name}")))?;
        Ok(Self::take(w))
    }

    /// Probes every worker once (health, then stats); returns how many are healthy.
    pub async fn probe(&self) -> usize {
        let mut n = 0;
        for w in &self.all {
            let mut c = w.client();
            let mut req = tonic::Request::new(inferscale_proto::HealthRequest {});
            req.set_timeout(Duration::from_secs(2));
            let ok = c.health(req).await.is_ok_and(|r| r.into_inner().ready);
            w.healthy.store(ok, Ordering::SeqCst);
            n += usize::from(ok);
            let mut req = tonic::Request::new(inferscale_proto::StatsRequest {});
            req.set_timeout(Duration::from_secs(2));
            let stats = if ok { c.stats(req).await.ok().map(tonic::Response::into_inner) } else { None };
            if let Ok(mut s) = w.stats.lock() {
                *s = stats;
            }
        }
        n
    }

    /// Keeps probing every `every` in the background.
    pub fn watch(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                me.probe().await;
                tokio::time::sleep(every).await;
            }
        })
    }
}
