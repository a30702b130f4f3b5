//! The workers a router sends to: gRPC clients, health, in-flight counts,
//! and which worker serves which user.
//!
//! Membership and placement come from a [`ClusterView`]: a fixed one for
//! workers given on the command line, or the placement store's, kept
//! current by a watch. Clients follow the view's members (created on
//! first sight, connected lazily).
//!
//! A user's reads go to its home; with replication on (a cluster), a home
//! that fails its health probe hands reads to the next live worker
//! clockwise — the replica, which holds the user's facts — well before the
//! dead worker's lease expires. Writes go to every writer (home, replica,
//! and a migration's destination) and are acknowledged only when all have
//! stored them. Requests without memory follow the ring under bounded load
//! over healthy workers, so no worker takes more than `load_factor` × the
//! average.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use inferscale_cluster::ClusterView;
use inferscale_proto::tls::Security;
use inferscale_proto::worker_client::WorkerClient;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};

use crate::error::{ApiError, Result};

/// Largest message exchanged with a worker.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// What a router's probes and calls have seen of a worker.
#[derive(Debug, Clone, Copy)]
enum Reach {
    /// Never reached (a wrong advertised address, say): not declared dead
    /// by this router.
    Never,
    Reached,
    /// Reached before, and not since this instant (a probe or a call that
    /// got no answer).
    LostSince(Instant),
}

pub struct Worker {
    pub name: String,
    pub addr: String,
    client: WorkerClient<Channel>,
    healthy: AtomicBool,
    /// Whether this router reaches the worker (the leader fences a worker
    /// unreachable for long enough).
    reach: Mutex<Reach>,
    in_flight: AtomicUsize,
    /// The worker's last answer to `Stats`.
    stats: Mutex<Option<inferscale_proto::StatsResponse>>,
}

/// The endpoint of the worker at `addr`; a malformed address is an error here.
/// A call to a worker with a deadline, carrying the current span's trace
/// context (nothing when tracing is off).
pub(crate) fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    inferscale_telemetry::propagate::inject_current(&mut r);
    r
}

/// A lazily connected channel to the worker at `addr` (`host:port`, a URI,
/// or `unix:/path`).
fn channel(addr: &str, security: &Security) -> Result<Channel> {
    security
        .channel_lazy(addr, |ep: Endpoint| ep.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true))
        .map_err(|e| ApiError::Internal(e.to_string()))
}

impl Worker {
    fn new(name: &str, addr: &str, security: &Security) -> Result<Worker> {
        let client = WorkerClient::new(channel(addr, security)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Worker {
            name: name.to_string(),
            addr: addr.to_string(),
            client,
            healthy: AtomicBool::new(false),
            reach: Mutex::new(Reach::Never),
            in_flight: AtomicUsize::new(0),
            stats: Mutex::new(None),
        })
    }

    pub fn stats(&self) -> Option<inferscale_proto::StatsResponse> {
        self.stats.lock().ok().and_then(|s| *s)
    }

    pub fn client(&self) -> WorkerClient<Channel> {
        self.client.clone()
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    /// Marks the worker down until its next successful probe (a call to it
    /// failed to connect).
    pub fn mark_down(&self) {
        self.healthy.store(false, Ordering::SeqCst);
        self.unreachable(Instant::now());
    }

    fn reach(&self) -> Reach {
        self.reach.lock().map_or(Reach::Never, |r| *r)
    }

    fn unreachable(&self, at: Instant) {
        if let Ok(mut r) = self.reach.lock()
            && matches!(*r, Reach::Reached)
        {
            *r = Reach::LostSince(at);
        }
    }

    fn reached(&self) {
        if let Ok(mut r) = self.reach.lock() {
            *r = Reach::Reached;
        }
    }

    /// How long this router has failed to reach the worker, if it has
    /// reached it before and not since.
    pub fn unreachable_for(&self) -> Option<Duration> {
        match self.reach() {
            Reach::LostSince(t) => Some(t.elapsed()),
            Reach::Never | Reach::Reached => None,
        }
    }

    /// Whether the last probe (or call) reached the worker: it answers,
    /// ready or not.
    pub fn reachable(&self) -> bool {
        matches!(self.reach(), Reach::Reached)
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
    view: watch::Receiver<Arc<ClusterView>>,
    clients: RwLock<HashMap<String, Arc<Worker>>>,
    load_factor: f64,
    /// Writes reach the replica too, and reads fail over to it.
    replicate: bool,
    /// How workers are dialled: plaintext or mutual TLS.
    security: Security,
    /// The sender of a fixed view, kept so the view never reads as closed.
    _fixed: Option<watch::Sender<Arc<ClusterView>>>,
}

impl Workers {
    /// Workers as `view` has them; `replicate` for a cluster whose users
    /// have replicas.
    pub fn new(
        view: watch::Receiver<Arc<ClusterView>>,
        load_factor: f64,
        replicate: bool,
        security: Security,
    ) -> Workers {
        let w = Workers { view, clients: RwLock::default(), load_factor, replicate, security, _fixed: None };
        w.sync();
        w
    }

    /// The fixed set of workers at `addrs` (each named by its address).
    pub fn fixed(addrs: &[String], load_factor: f64, security: Security) -> Result<Workers> {
        if addrs.is_empty() {
            return Err(ApiError::Internal("no workers configured".into()));
        }
        // Addresses are checked now, not at the first request.
        for a in addrs {
            channel(a, &security)?;
        }
        let members: Vec<(String, String)> = addrs.iter().map(|a| (a.clone(), a.clone())).collect();
        let view = ClusterView::fixed(&members, inferscale_cluster::DEFAULT_VNODES);
        let (tx, rx) = watch::channel(Arc::new(view));
        Ok(Workers { _fixed: Some(tx), ..Workers::new(rx, load_factor, false, security) })
    }

    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// The view as it changes.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view.clone()
    }

    /// Whether writes reach a replica too.
    pub fn replicates(&self) -> bool {
        self.replicate
    }

    /// Brings the clients in line with the view's members.
    fn sync(&self) {
        let view = self.view();
        let Ok(mut clients) = self.clients.write() else { return };
        clients.retain(|name, w| view.member(name).is_some_and(|m| m.addr == w.addr));
        for m in view.members.values() {
            let m = &m.value;
            if !clients.contains_key(&m.name) {
                match Worker::new(&m.name, &m.addr, &self.security) {
                    Ok(w) => {
                        clients.insert(m.name.clone(), Arc::new(w));
                    }
                    Err(e) => eprintln!("inferscale router: worker {}: {e}", m.name),
                }
            }
        }
    }

    /// Every worker of the view, by name.
    pub fn all(&self) -> Vec<Arc<Worker>> {
        let mut all: Vec<Arc<Worker>> = self.clients.read().map(|c| c.values().cloned().collect()).unwrap_or_default();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    pub fn get(&self, name: &str) -> Option<Arc<Worker>> {
        self.clients.read().ok().and_then(|c| c.get(name).cloned())
    }

    fn healthy(&self, name: &str) -> bool {
        self.get(name).is_some_and(|w| w.is_healthy())
    }

    fn take(w: Arc<Worker>) -> InFlight {
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(w)
    }

    /// The worker that answers `user`'s reads now.
    pub fn reader(&self, user: &str) -> Result<InFlight> {
        self.reader_skipping(user, &[])
    }

    /// [`Workers::reader`] among the workers not in `skip` (those that
    /// refused the user: its memory is damaged there).
    pub fn reader_skipping(&self, user: &str, skip: &[String]) -> Result<InFlight> {
        let view = self.view();
        let ok = |w: &str| self.healthy(w) && !skip.iter().any(|s| s == w);
        let name = match self.replicate {
            true => view.reader(user, ok),
            false => view.home(user).filter(|w| ok(w)),
        };
        let Some(name) = name else {
            return Err(match view.home(user) {
                Some(home) => ApiError::Unavailable(format!(
                    "worker {home} holding this user's memory is unavailable; retry later"
                )),
                None => ApiError::Unavailable("no workers".into()),
            });
        };
        let w = self.get(name).ok_or_else(|| ApiError::Unavailable(format!("worker {name} is not connected yet")))?;
        Ok(Self::take(w))
    }

    /// Every worker a write of `user` must reach, home first.
    pub fn writers(&self, user: &str) -> Result<Vec<Arc<Worker>>> {
        let view = self.view();
        let names = view.writers(user, self.replicate);
        if names.is_empty() {
            return Err(ApiError::Unavailable("no workers".into()));
        }
        names
            .into_iter()
            .map(|n| self.get(n).ok_or_else(|| ApiError::Unavailable(format!("worker {n} is not connected yet"))))
            .collect()
    }

    /// Whether `user`'s memory is being moved between workers.
    pub fn moving(&self, user: &str) -> bool {
        self.view().moving(user)
    }

    /// A worker for a request that needs no memory: bounded load over the
    /// healthy workers, starting at `user`'s place on the ring; `skip`
    /// excludes workers already tried.
    pub fn any(&self, user: &str, skip: &[String]) -> Result<InFlight> {
        let view = self.view();
        let eligible = |name: &str| self.healthy(name) && !skip.iter().any(|s| s == name);
        let load = |name: &str| self.get(name).map_or(0, |w| w.in_flight());
        let name = view
            .ring()
            .assign_among(user, eligible, load, self.load_factor)
            .ok_or_else(|| ApiError::Unavailable("no healthy worker".into()))?;
        let w = self.get(name).ok_or_else(|| ApiError::Internal(format!("unknown worker {name}")))?;
        Ok(Self::take(w))
    }

    /// Probes every worker once, all at once (health, then stats); returns
    /// how many are healthy. A worker that does not answer its health
    /// check (any error: refused, reset, no answer in 2 s) counts as
    /// unreachable from the probe's start; one that answers, ready or not,
    /// as reached.
    pub async fn probe(&self) -> usize {
        let healthy = self.check_health().await;
        self.collect_stats().await;
        healthy
    }

    /// Asks every worker's health at once; returns how many are ready.
    async fn check_health(&self) -> usize {
        self.sync();
        let checks = self.all().into_iter().map(|w| async move {
            let sent = Instant::now();
            let req = request(inferscale_proto::HealthRequest {}, Duration::from_secs(2));
            let ready = match w.client().health(req).await {
                Ok(r) => {
                    w.reached();
                    r.into_inner().ready
                }
                Err(_) => {
                    w.unreachable(sent);
                    false
                }
            };
            w.healthy.store(ready, Ordering::SeqCst);
            ready
        });
        futures_util::future::join_all(checks).await.into_iter().filter(|&ready| ready).count()
    }

    /// Asks every healthy worker's stats at once (answered between its
    /// engine's steps, so slower than a health check).
    async fn collect_stats(&self) {
        let asks = self.all().into_iter().map(|w| async move {
            let req = request(inferscale_proto::StatsRequest {}, Duration::from_secs(2));
            let stats = match w.is_healthy() {
                true => w.client().stats(req).await.ok().map(tonic::Response::into_inner),
                false => None,
            };
            if let Ok(mut s) = w.stats.lock() {
                *s = stats;
            }
        });
        futures_util::future::join_all(asks).await;
    }

    /// Keeps probing every `every` in the background — health, and at
    /// once when the view changes (a new worker is probed before it takes
    /// requests); stats on a loop of their own, so that a busy worker's
    /// slow stats never delay noticing a dead one.
    pub fn watch(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                me.collect_stats().await;
                tokio::time::sleep(every).await;
            }
        });
        let me = self.clone();
        let mut changes = self.view.clone();
        tokio::spawn(async move {
            loop {
                me.check_health().await;
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    r = changes.changed() => if r.is_err() { tokio::time::sleep(every).await },
                }
            }
        })
    }
}
