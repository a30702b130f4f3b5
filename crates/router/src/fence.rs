//! The leader's fencing loop: the I/O side of [`inferscale_cluster::fence`].
//!
//! Four times a second, while this router leads and its view of the store
//! is current, it looks for members its health probes have failed to reach
//! for `--fence-after-s`, rewrites the placement records naming each
//! (compare-and-swap) and revokes its lease. Every router sees the worker
//! leave in that revision, and its users' writes go on without it —
//! seconds after a crash, instead of a lease TTL. It runs beside the
//! rebalancer, not inside its rounds: a round may be streaming a shard for
//! minutes, and fencing must not wait for it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use inferscale_cluster::fence::{Fence, RecordChange, record_changes, to_fence};
use inferscale_cluster::membership::Campaign;
use inferscale_cluster::store::{LeaseId, Placement, Txn};
use inferscale_cluster::view::{ClusterView, Keys};

use crate::rebalance::RebalanceStats;
use crate::workers::Workers;

/// How often the leader looks for workers to fence.
const EVERY: Duration = Duration::from_millis(250);

pub struct Fencer {
    pub store: Arc<dyn Placement>,
    pub keys: Keys,
    pub workers: Arc<Workers>,
    /// How long a worker must be unreachable before it is fenced.
    pub after: Duration,
    /// Counts the workers fenced, for `/metrics`.
    pub stats: Arc<RebalanceStats>,
}

impl Fencer {
    pub fn spawn(self, campaign: Arc<Campaign>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            // Leases already revoked, so that one fence is done (and
            // logged) once while the watch catches up.
            let mut revoked: BTreeSet<LeaseId> = BTreeSet::new();
            loop {
                tokio::time::sleep(EVERY).await;
                let view = self.workers.view();
                if !campaign.leading() || !view.connected {
                    continue;
                }
                revoked.retain(|l| view.members.values().any(|m| m.lease == *l));
                let unreachable_for = |w: &str| self.workers.get(w).and_then(|w| w.unreachable_for());
                let reachable = |w: &str| self.workers.get(w).is_some_and(|w| w.reachable());
                for f in to_fence(&view, self.after, unreachable_for, reachable) {
                    if revoked.contains(&f.lease) {
                        continue;
                    }
                    if !campaign.leading() {
                        break;
                    }
                    match self.fence(&view, &f).await {
                        Ok(()) => {
                            revoked.insert(f.lease);
                            self.stats.fenced.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => eprintln!("inferscale router: fencing {}: {e}", f.worker),
                    }
                }
            }
        })
    }

    /// Rewrites the records naming `f.worker`, then revokes its lease.
    async fn fence(&self, view: &ClusterView, f: &Fence) -> Result<(), String> {
        let down = self.workers.get(&f.worker).and_then(|w| w.unreachable_for()).unwrap_or_default();
        for change in record_changes(view, &f.worker) {
            let txn = match &change {
                RecordChange::Delete { user, mod_revision } => {
                    let key = self.keys.placement(user);
                    Txn::default().when(&key, *mod_revision).delete(&key)
                }
                RecordChange::Put { user, mod_revision, record } => {
                    let key = self.keys.placement(user);
                    let value = serde_json::to_vec(record).map_err(|e| e.to_string())?;
                    Txn::default().when(&key, *mod_revision).put(&key, value, 0)
                }
            };
            // A record changed meanwhile no longer names the worker as it
            // did; the rebalancer's next round sees it as it is now.
            self.store.txn(txn).await.map_err(|e| format!("rewriting a placement record: {e}"))?;
        }
        self.store.revoke(f.lease).await.map_err(|e| format!("revoking lease {:x}: {e}", f.lease))?;
        eprintln!(
            "inferscale router: fenced worker {}: unreachable for {:.1} s; its lease {:x} is revoked and its users' \
             writes go on without it (it rejoins when it is back)",
            f.worker,
            down.as_secs_f64(),
            f.lease
        );
        Ok(())
    }
}
