//! Living in the placement store: a worker's registration under a lease,
//! the routers' leader election, and the watcher that keeps each process's
//! [`ClusterView`] current.
//!
//! Each runs as a task that never gives up: a store that is away is
//! retried with jittered backoff, a lease that expired is replaced and the
//! keys written again (a worker must not stay silently unroutable), and a
//! watch that broke is resumed from a fresh snapshot. Meanwhile the last
//! view stays in place, so routers keep serving through a store outage.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::error::ClusterError;
use crate::ring::hash64;
use crate::store::{LeaseId, Placement, Txn};
use crate::view::{ClusterView, Keys, Member};

/// The registration lease's time to live when none is configured: a dead
/// worker's key lingers at most this long (reads fail over sooner, on the
/// router's health probes).
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// `base` scaled by a factor in [0.5, 1.5), different per process and per
/// call, so that many processes retrying after one outage do not arrive in
/// step.
pub fn jitter(base: Duration, salt: &str) -> Duration {
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let h = hash64(format!("{salt}:{nanos}:{}", std::process::id()).as_bytes());
    base.mul_f64(0.5 + (h % 1000) as f64 / 1000.0)
}

fn log(what: &str, e: &ClusterError) {
    eprintln!("inferscale cluster: {what}: {e}");
}

/// Grants a lease, retrying with backoff until the store answers or `stop`
/// fires (then `None`).
async fn grant(store: &dyn Placement, ttl: Duration, salt: &str, stop: &mut oneshot::Receiver<()>) -> Option<LeaseId> {
    let mut backoff = Duration::from_millis(100);
    let mut reported = false;
    loop {
        match store.grant(ttl).await {
            Ok(lease) => return Some(lease),
            Err(e) => {
                if !reported {
                    log(&format!("{salt}: cannot get a lease from {} (retrying)", store.describe()), &e);
                    reported = true;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(jitter(backoff, salt)) => {}
            _ = &mut *stop => return None,
        }
        backoff = (backoff * 2).min(ttl / 3);
    }
}

/// Keeps `lease` alive every `ttl / 3` until it is lost — then returns
/// `true` — or `stop` fires (returns `false`). The lease counts as lost
/// when the store says it expired, or, with `patience`, when it could not
/// be renewed for that long (a leader must step down before a rival can
/// take over; a worker instead waits out a store outage, since etcd keeps
/// leases across its restarts and re-registering would make the worker
/// join again from scratch). `on_renew` hears, for each renewal, when its
/// request was sent: the lease lives at least `ttl` past that instant.
async fn keep_alive(
    store: &dyn Placement,
    lease: LeaseId,
    ttl: Duration,
    patience: Option<Duration>,
    salt: &str,
    stop: &mut oneshot::Receiver<()>,
    on_renew: &(dyn Fn(Instant) + Sync),
) -> bool {
    let mut renewed = Instant::now();
    let mut reported = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(jitter(ttl / 3, salt)) => {}
            _ = &mut *stop => return false,
        }
        let sent = Instant::now();
        match store.keep_alive(lease).await {
            Ok(true) => {
                if reported {
                    eprintln!("inferscale cluster: {salt}: lease {lease:x} renewed again");
                }
                renewed = sent;
                on_renew(sent);
                reported = false;
            }
            Ok(false) => {
                eprintln!("inferscale cluster: {salt}: lease {lease:x} expired");
                return true;
            }
            Err(e) if patience.is_some_and(|p| renewed.elapsed() >= p) => {
                log(&format!("{salt}: lease {lease:x} not renewed for {:?}, giving it up", renewed.elapsed()), &e);
                return true;
            }
            Err(e) => {
                if !reported {
                    log(&format!("{salt}: cannot renew lease {lease:x} (retrying)"), &e);
                    reported = true;
                }
            }
        }
    }
}

/// A worker's membership: its [`Member`] record under a lease kept alive.
pub struct Registration {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    lease: watch::Receiver<LeaseId>,
}

impl Registration {
    /// Registers `member` and keeps it registered until [`Registration::leave`]
    /// (or drop). Returns at once; the task retries until the store answers.
    pub fn spawn(store: Arc<dyn Placement>, keys: Keys, member: Member, ttl: Duration) -> Registration {
        let (stop_tx, mut stop) = oneshot::channel();
        let (lease_tx, lease_rx) = watch::channel(0);
        let task = tokio::spawn(async move {
            let key = keys.member(&member.name);
            let salt = format!("worker {}", member.name);
            let value = match serde_json::to_vec(&member) {
                Ok(v) => v,
                Err(e) => return eprintln!("inferscale cluster: {salt}: cannot encode its record: {e}"),
            };
            loop {
                let Some(lease) = grant(&*store, ttl, &salt, &mut stop).await else { return };
                if let Err(e) = store.txn(Txn::default().put(&key, value.clone(), lease)).await {
                    log(&format!("{salt}: cannot register (retrying)"), &e);
                    // The unused lease expires on its own.
                    tokio::time::sleep(jitter(ttl / 10, &salt)).await;
                    continue;
                }
                let _ = lease_tx.send(lease);
                if !keep_alive(&*store, lease, ttl, None, &salt, &mut stop, &|_| {}).await {
                    // Leaving: delete the record now rather than in a TTL.
                    if let Err(e) = store.revoke(lease).await {
                        log(&format!("{salt}: cannot revoke its lease (it expires in {ttl:?})"), &e);
                    }
                    return;
                }
                let _ = lease_tx.send(0);
            }
        });
        Registration { stop: Some(stop_tx), task, lease: lease_rx }
    }

    /// The current lease (0 until registered): a record written for this
    /// worker by others (its state) must carry it.
    pub fn lease(&self) -> LeaseId {
        *self.lease.borrow()
    }

    /// Waits until the worker is registered.
    pub async fn registered(&mut self) {
        let _ = self.lease.wait_for(|&l| l != 0).await;
    }

    /// Deregisters (the record is deleted at once) and ends the task.
    pub async fn leave(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Leader election among routers: at most one holds `<root>/leader` (under
/// its lease) at a time; the others retry every `ttl / 3`.
///
/// Holding the key is not enough to act on: a leader cut off from etcd
/// learns it lost the lease only at its next failed renewal, after etcd may
/// have let a rival win. So [`Campaign::leading`] counts only until two
/// thirds of a TTL after the last renewal *was sent* — the lease surely
/// lives until then — and the leader stops acting before a rival can start.
pub struct Campaign {
    stop: Option<oneshot::Sender<()>>,
    leading: watch::Receiver<bool>,
    until: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl Campaign {
    pub fn spawn(store: Arc<dyn Placement>, keys: Keys, name: String, ttl: Duration) -> Campaign {
        let (stop_tx, mut stop) = oneshot::channel();
        let (leading_tx, leading) = watch::channel(false);
        let until: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
        let safe = ttl.mul_f64(2.0 / 3.0);
        let valid = until.clone();
        let set = move |v: Option<Instant>| {
            if let Ok(mut u) = valid.lock() {
                *u = v;
            }
        };
        tokio::spawn(async move {
            let key = keys.leader();
            let salt = format!("router {name}");
            loop {
                let Some(lease) = grant(&*store, ttl, &salt, &mut stop).await else { return };
                // Try for the key while the lease lives; hold it while it lives.
                let mut renewed = Instant::now();
                loop {
                    let sent = Instant::now();
                    let won = store.txn(Txn::default().when(&key, 0).put(&key, name.clone().into_bytes(), lease)).await;
                    if matches!(won, Ok(r) if r.succeeded) {
                        set(Some(sent + safe));
                        let _ = leading_tx.send(true);
                        let renew = |at: Instant| set(Some(at + safe));
                        let stopped = !keep_alive(&*store, lease, ttl, Some(safe), &salt, &mut stop, &renew).await;
                        set(None);
                        let _ = leading_tx.send(false);
                        if stopped {
                            let _ = store.revoke(lease).await;
                            return;
                        }
                        break;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(jitter(ttl / 3, &salt)) => {}
                        _ = &mut stop => {
                            let _ = store.revoke(lease).await;
                            return;
                        }
                    }
                    match store.keep_alive(lease).await {
                        Ok(true) => renewed = Instant::now(),
                        Ok(false) => break,
                        Err(_) if renewed.elapsed() >= ttl => break,
                        Err(_) => {}
                    }
                }
            }
        });
        Campaign { stop: Some(stop_tx), leading, until }
    }

    /// Whether this process may act as the leader now.
    pub fn leading(&self) -> bool {
        *self.leading.borrow() && self.until.lock().ok().and_then(|u| *u).is_some_and(|u| Instant::now() < u)
    }

    /// Changes of leadership (won, lost), to wake a waiting leader's loop.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }
}

impl Drop for Campaign {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Keeps a [`ClusterView`] of the store current: a snapshot, then a watch
/// from the revision after it; on any break, the last view is republished
/// marked disconnected and the cycle starts again after a jittered pause.
pub fn watch_view(store: Arc<dyn Placement>, keys: Keys, vnodes: usize) -> watch::Receiver<Arc<ClusterView>> {
    let (tx, rx) = watch::channel(Arc::new(ClusterView::default()));
    tokio::spawn(async move {
        let prefix = keys.prefix();
        let salt = format!("view of {prefix}");
        let mut backoff = Duration::from_millis(100);
        let mut reported = false;
        loop {
            let attempt = async {
                let snapshot = store.range(&prefix).await?;
                let stream = store.watch(&prefix, snapshot.revision + 1).await?;
                Ok::<_, ClusterError>((snapshot, stream))
            };
            let (snapshot, mut stream) = match attempt.await {
                Ok(s) => s,
                Err(e) => {
                    if !reported {
                        log(&format!("cannot read the cluster from {} (serving the last view)", store.describe()), &e);
                        reported = true;
                    }
                    tokio::time::sleep(jitter(backoff, &salt)).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            if reported {
                eprintln!("inferscale cluster: reconnected to {}", store.describe());
            }
            reported = false;
            backoff = Duration::from_millis(100);
            let (mut view, errors) = ClusterView::from_snapshot(&keys, vnodes, &snapshot);
            errors.iter().for_each(|e| log("ignored a placement key", e));
            if tx.send(Arc::new(view.clone())).is_err() {
                return;
            }
            let broke = loop {
                match stream.recv().await {
                    Some(Ok(batch)) => {
                        view.apply(batch.revision, &batch.events)
                            .iter()
                            .for_each(|e| log("ignored a placement key", e));
                        if tx.send(Arc::new(view.clone())).is_err() {
                            return;
                        }
                    }
                    Some(Err(e)) => break e,
                    None => break ClusterError::Unavailable("watch ended".into()),
                }
            };
            if !matches!(broke, ClusterError::Compacted { .. }) {
                log(&format!("lost the watch on {} (serving the last view)", store.describe()), &broke);
                reported = true;
                view.connected = false;
                if tx.send(Arc::new(view)).is_err() {
                    return;
                }
                tokio::time::sleep(jitter(backoff, &salt)).await;
            }
        }
    });
    rx
}
