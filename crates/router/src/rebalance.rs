//! The leader's rebalancing loop: the I/O side of [`inferscale_cluster::plan`].
//!
//! Every round (when this router leads and its view of the store is
//! current) it asks each live worker which users it holds, plans, and
//! carries the actions out one by one. Every placement change is a
//! compare-and-swap on the record's revision, so a second router that
//! wrongly believes it leads cannot flip a user twice, and a failed step
//! leaves the user served where it was; the next round plans it again.
//!
//! A move, from `from` to `to`:
//! 1. `to` forgets any stale copy (unless it is already a writer);
//! 2. the record becomes `{home: from, moving_to: to}`: routers now send
//!    the user's writes to `to` as well;
//! 3. `from` streams the shard to `to` (`SendShard` with freeze: writes to
//!    `from` wait once the snapshot is out, the units that came meanwhile
//!    follow), `to` verifies and commits it;
//! 4. the record flips to `{home: to}` — reads go to `to` from here;
//! 5. `from` is released: it keeps its copy if it is still a writer (the
//!    replica), else drops it and refuses the user as moved for a while.
//!
//! Reads keep going to `from` until step 4; a failure before it puts the
//! record back and unfreezes `from`.
//!
//! Step 3 puts the KV on an NCCL link when the two workers' GPUs share a
//! host ([`Member::nccl_peer`]); a move whose link fails is planned again
//! over gRPC alone, and that pair of workers keeps to gRPC from then on.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferscale_cluster::membership::Campaign;
use inferscale_cluster::plan::{Action, Holdings, plan, stale_replicas};
use inferscale_cluster::store::{Event, KeyValue, Placement, Txn};
use inferscale_cluster::view::{ClusterView, Keys, Member, MemberState, PlacementRecord};
use inferscale_proto as pb;
use tracing::{Instrument, info_span};

use crate::workers::{Worker, Workers, request};

#[derive(Debug, Clone)]
pub struct RebalanceConfig {
    /// Pause between rounds.
    pub every: Duration,
    /// Pace of each shard stream (0: unlimited), so serving latency holds.
    pub max_bytes_per_sec: u64,
    /// Keep a copy of every user's facts on its replica.
    pub replicate: bool,
    /// Fence a worker the leader has not reached for this long (revoke
    /// its lease, see `fence`); `None` waits for its lease to expire.
    pub fence_after: Option<Duration>,
}

impl Default for RebalanceConfig {
    fn default() -> Self {
        RebalanceConfig {
            every: Duration::from_secs(1),
            max_bytes_per_sec: 0,
            replicate: true,
            fence_after: Some(DEFAULT_FENCE_AFTER),
        }
    }
}

/// How long the leader waits, from the first failed health probe (or
/// call), before fencing a worker: two probes' worth, so that one lost
/// probe does not make a live worker rejoin.
pub const DEFAULT_FENCE_AFTER: Duration = Duration::from_secs(2);

/// Totals since start, for `/metrics`.
#[derive(Debug, Default)]
pub struct RebalanceStats {
    pub moves: std::sync::atomic::AtomicU64,
    pub moved_bytes: std::sync::atomic::AtomicU64,
    pub failures: std::sync::atomic::AtomicU64,
    /// Workers fenced (their lease revoked after failed probes).
    pub fenced: std::sync::atomic::AtomicU64,
    /// Users whose replica lacked them or held other units than their
    /// home, at the leader's last round.
    pub stale_replicas: std::sync::atomic::AtomicU64,
    /// Rounds planned as the leader.
    pub rounds: std::sync::atomic::AtomicU64,
}

pub struct Rebalancer {
    pub store: Arc<dyn Placement>,
    pub keys: Keys,
    pub workers: Arc<Workers>,
    pub cfg: RebalanceConfig,
    pub stats: Arc<RebalanceStats>,
    /// Pairs `(from, to)` whose NCCL link failed: their moves use gRPC.
    pub nccl_failed: std::sync::Mutex<BTreeSet<(String, String)>>,
    /// `(user, replica)` pairs out of step last round, with how (see
    /// [`Holdings::stale_before`]).
    pub stale: std::sync::Mutex<std::collections::BTreeMap<(String, String), u64>>,
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

impl Rebalancer {
    /// Runs rounds while `campaign` says this router leads, forever.
    pub fn spawn(self, campaign: Arc<Campaign>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(self.cfg.every).await;
                if !campaign.leading() {
                    continue;
                }
                if let Err(e) = self.round(&campaign).await {
                    eprintln!("inferscale router: rebalancing: {e}");
                }
            }
        })
    }

    /// What every live worker holds, asked of all at once.
    async fn holdings(&self, view: &ClusterView) -> Holdings {
        let asks = view.members.keys().map(|name| async move {
            let w = self.workers.get(name)?;
            let r = w.client().list_users(request(pb::ListUsersRequest {}, Duration::from_secs(5))).await.ok()?;
            Some((name.clone(), r.into_inner()))
        });
        let answers = futures_util::future::join_all(asks).await;
        let mut h = Holdings { complete: answers.iter().all(Option::is_some), ..Default::default() };
        for (name, r) in answers.into_iter().flatten() {
            if r.digests.len() == r.users.len() {
                h.digests.insert(name.clone(), r.users.iter().cloned().zip(r.digests).collect());
            }
            h.by_worker.insert(name, r.users.into_iter().collect());
        }
        h.stale_before = self.stale.lock().map(|s| s.clone()).unwrap_or_default();
        h
    }

    /// One round: plan from fresh holdings and carry it out.
    pub async fn round(&self, campaign: &Campaign) -> Result<(), String> {
        let view = self.workers.view();
        if !view.connected {
            return Ok(()); // no rebalancing from a cached view
        }
        let holdings = self.holdings(&view).await;
        let actions = plan(&view, &holdings, self.cfg.replicate);
        let stale = stale_replicas(&view, &holdings);
        self.stats.stale_replicas.store(stale.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.stats.rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut s) = self.stale.lock() {
            *s = stale;
        }
        for action in actions {
            if !campaign.leading() || !self.workers.view().connected {
                break;
            }
            let what = format!("{action:?}");
            let span = info_span!("migration", otel.name = action.name(), action = %what);
            if let Err(e) = self.act(action, campaign).instrument(span).await {
                self.stats.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                eprintln!("inferscale router: rebalancing: {what}: {e}");
            }
        }
        Ok(())
    }

    /// Removes `w`'s copy of `user` (none is fine).
    async fn forget_copy(&self, w: &Worker, user: &str) -> Result<(), String> {
        let req = pb::ForgetRequest { user: user.into(), unit_id: String::new() };
        match w.client().forget(request(req, Duration::from_secs(30))).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == tonic::Code::NotFound => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn worker(&self, name: &str) -> Result<Arc<Worker>, String> {
        self.workers.get(name).ok_or_else(|| format!("worker {name} is not connected"))
    }

    /// Sets `user`'s record to `record` if it is still at `rev`; returns the
    /// new revision, or `None` when someone changed it first.
    async fn put_record(&self, user: &str, rev: i64, record: &PlacementRecord) -> Result<Option<i64>, String> {
        let key = self.keys.placement(user);
        let r = self.store.txn(Txn::default().when(&key, rev).put(&key, json(record), 0)).await;
        let r = r.map_err(|e| e.to_string())?;
        Ok(r.succeeded.then_some(r.revision))
    }

    async fn act(&self, action: Action, campaign: &Campaign) -> Result<(), String> {
        let view = self.workers.view();
        match action {
            Action::Move { user, from, to } => self.move_user(&view, &user, &from, &to, campaign).await,
            Action::Replicate { user, from, to } => {
                let dest = self.worker(&to)?;
                let req = pb::SendShardRequest {
                    user: user.clone(),
                    to: dest.addr.clone(),
                    with_kv: false,
                    freeze: false,
                    max_bytes_per_sec: self.cfg.max_bytes_per_sec,
                    // Facts only: nothing worth a device link.
                    nccl: false,
                };
                let src = self.worker(&from)?;
                let sent = src.client().send_shard(request(req, Duration::from_secs(600))).await;
                let imported = sent.map_err(|e| e.to_string())?.into_inner().imported.unwrap_or_default();
                eprintln!(
                    "inferscale router: copied the facts of {user:?} {from} -> {to} (its replica): {} facts{}",
                    imported.facts,
                    match imported.dropped {
                        0 => String::new(),
                        n => format!(
                            ", replacing a copy out of step ({n} units it held from before that the home's copy lacks)"
                        ),
                    }
                );
                Ok(())
            }
            Action::Drop { user, worker } => self.forget_copy(&*self.worker(&worker)?, &user).await,
            Action::Activate { worker } => {
                let m = view.members.get(&worker).ok_or_else(|| format!("{worker} is gone"))?;
                let mut member = m.value.clone();
                member.state = MemberState::Active;
                let key = self.keys.member(&worker);
                let txn = Txn::default().when(&key, m.mod_revision).put(&key, json(&member), m.lease);
                self.store.txn(txn).await.map_err(|e| e.to_string())?;
                eprintln!("inferscale router: worker {worker} is active");
                Ok(())
            }
            Action::ClearRecord { user } => {
                let Some(r) = view.records.get(&user) else { return Ok(()) };
                let key = self.keys.placement(&user);
                self.store
                    .txn(Txn::default().when(&key, r.mod_revision).delete(&key))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(())
            }
            Action::ResetRecord { user } => {
                let Some(r) = view.records.get(&user) else { return Ok(()) };
                let home = r.value.home.clone();
                self.put_record(&user, r.mod_revision, &PlacementRecord { home: home.clone(), moving_to: None })
                    .await?;
                // Unfreeze the source the dead leader may have left frozen.
                if let Ok(w) = self.worker(&home) {
                    let req = pb::ReleaseShardRequest { user, drop: false };
                    let _ = w.client().release_shard(request(req, Duration::from_secs(10))).await;
                }
                Ok(())
            }
        }
    }

    async fn move_user(
        &self,
        view: &ClusterView,
        user: &str,
        from: &str,
        to: &str,
        campaign: &Campaign,
    ) -> Result<(), String> {
        let started = Instant::now();
        let (src, dest) = (self.worker(from)?, self.worker(to)?);
        let replicate = self.cfg.replicate;
        // Deleting the destination's copy is the one step no compare-and-swap
        // guards: only a leader sure of its lease may take it.
        if !campaign.leading() {
            return Err("no longer the leader".into());
        }
        if !view.writers(user, replicate).contains(&to) {
            self.forget_copy(&dest, user).await.map_err(|e| format!("clearing {to}'s stale copy: {e}"))?;
        }
        let rev = view.records.get(user).map_or(0, |r| r.mod_revision);
        let moving = PlacementRecord { home: from.into(), moving_to: Some(to.into()) };
        let claim = info_span!("claim", user, from, to);
        let Some(rev) = self.put_record(user, rev, &moving).instrument(claim).await? else {
            return Err("its placement changed meanwhile; planning again".into());
        };
        let pair = (from.to_string(), to.to_string());
        let member = |name| view.members.get(name).map(|m| &m.value);
        let nccl = matches!((member(from), member(to)), (Some(a), Some(b)) if Member::nccl_peer(a, b))
            && !self.nccl_failed.lock().is_ok_and(|f| f.contains(&pair));
        let req = pb::SendShardRequest {
            user: user.into(),
            to: dest.addr.clone(),
            with_kv: true,
            freeze: true,
            max_bytes_per_sec: self.cfg.max_bytes_per_sec,
            nccl,
        };
        let send = info_span!("send_shard", user, from, to, nccl, bytes = tracing::field::Empty);
        let sent = async { src.client().send_shard(request(req, Duration::from_secs(3600))).await }
            .instrument(send.clone())
            .await;
        let back = PlacementRecord { home: from.into(), moving_to: None };
        let release = |drop| pb::ReleaseShardRequest { user: user.into(), drop };
        let sent = match sent {
            Ok(r) => r.into_inner(),
            Err(e) => {
                let _ = self.put_record(user, rev, &back).await;
                let _ = src.client().release_shard(request(release(false), Duration::from_secs(10))).await;
                if nccl && let Ok(mut failed) = self.nccl_failed.lock() {
                    failed.insert(pair);
                    eprintln!("inferscale router: the NCCL link {from} -> {to} failed; moves between them use gRPC");
                }
                return Err(format!("sending the shard from {from} to {to}: {e}"));
            }
        };
        let flipped = PlacementRecord { home: to.into(), moving_to: None };
        let flip = info_span!("flip", user, to);
        let Some(new_rev) = self.put_record(user, rev, &flipped).instrument(flip).await? else {
            let _ = src.client().release_shard(request(release(false), Duration::from_secs(10))).await;
            return Err("its placement changed during the copy; the move is dropped".into());
        };
        // Whether `from` still writes for the user once the flip is seen.
        let mut after = view.clone();
        let kv = KeyValue { key: self.keys.placement(user), value: json(&flipped), mod_revision: new_rev, lease: 0 };
        after.apply(new_rev, &[Event::Put(kv)]);
        let keep = after.writers(user, replicate).contains(&from);
        async { src.client().release_shard(request(release(!keep), Duration::from_secs(30))).await }
            .instrument(info_span!("release", user, worker = from, drop = !keep))
            .await
            .map_err(|e| format!("releasing {from}: {e}"))?;
        let imported = sent.imported.unwrap_or_default();
        send.record("bytes", imported.bytes as i64);
        self.stats.moves.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.stats.moved_bytes.fetch_add(imported.bytes, std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "inferscale router: moved {user:?} {from} -> {to} over {}: {} facts, {:.1} MB in {:.2} s ({:.0} MB/s stream), {:.2} s in all",
            if nccl { "NCCL" } else { "gRPC" },
            imported.facts,
            imported.bytes as f64 / 1e6,
            sent.seconds,
            imported.bytes as f64 / 1e6 / sent.seconds.max(1e-9),
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests;
