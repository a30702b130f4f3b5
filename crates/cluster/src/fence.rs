//! Which workers the leader fences, and what fencing one changes. Pure:
//! the router's health probes are the input, the placement-store writes
//! the output (`crates/router/src/fence.rs` carries them out).
//!
//! A worker killed outright stays registered until its lease expires (the
//! lease TTL, 30 s by default), and until then every write of its users
//! waits for it: a write is acknowledged only once all of the user's
//! writers stored it. Reads fail over at once (to the replica), writes
//! cannot — unless the dead worker stops being a writer. Fencing does that
//! without waiting: the leader, having failed to reach a worker for
//! `after`, revokes the worker's lease. Its membership key goes at that
//! revision, every router watching the store drops it from the ring in the
//! same revision, and its users' writes go to the remaining writers, which
//! hold every acknowledged write (each was acknowledged by all writers of
//! its time, the survivor among them).
//!
//! Fencing is safe against a worker that was alive after all (a partition
//! between it and the leader): its next keep-alive finds the lease gone,
//! and it registers again as *joining*; a joining worker is no user's home
//! or replica until the rebalancer has moved each user to it, replacing
//! its stale copy wholesale, and where it becomes a replica its copy,
//! out of step with the home's, is replaced by the home's (`plan`). So its
//! copy, which missed the writes made while it was fenced, is never served. Before the lease goes
//! the leader also changes every placement record that names the worker:
//! a record whose home it is is deleted, a move to it loses its
//! destination. Each is a compare-and-swap, so a move in flight to or from
//! it cannot flip afterwards and make the stale copy a home.

use std::time::Duration;

use crate::store::LeaseId;
use crate::view::{ClusterView, PlacementRecord};

/// A worker to fence: its name and the lease its record lives under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub worker: String,
    pub lease: LeaseId,
}

/// Workers the leader should fence now: members it has failed to reach
/// for at least `after` (`unreachable_for`, from its probes), as long as it
/// reaches some other member (`reachable`). A leader that reaches no
/// worker is more likely cut off itself than looking at a cluster of dead
/// workers, and fencing every worker would only make all of them rejoin.
/// Members without a lease (a fixed view) are never fenced.
pub fn to_fence(
    view: &ClusterView,
    after: Duration,
    unreachable_for: impl Fn(&str) -> Option<Duration>,
    reachable: impl Fn(&str) -> bool,
) -> Vec<Fence> {
    let due: Vec<Fence> = view
        .members
        .iter()
        .filter(|(name, m)| m.lease != 0 && unreachable_for(name).is_some_and(|d| d >= after))
        .map(|(name, m)| Fence { worker: name.clone(), lease: m.lease })
        .collect();
    let witness = view.members.keys().any(|name| !due.iter().any(|f| &f.worker == name) && reachable(name));
    if witness { due } else { Vec::new() }
}

/// A change to a placement record that fencing makes, guarded by the
/// record's modification revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordChange {
    /// The record's home is the fenced worker: delete it (the user's home
    /// becomes its ring home, i.e. its replica).
    Delete { user: String, mod_revision: i64 },
    /// A move to the fenced worker: keep the home, drop the destination.
    Put { user: String, mod_revision: i64, record: PlacementRecord },
}

/// The record changes that fencing `worker` needs.
pub fn record_changes(view: &ClusterView, worker: &str) -> Vec<RecordChange> {
    view.records
        .iter()
        .filter_map(|(user, r)| {
            let (user, mod_revision) = (user.clone(), r.mod_revision);
            if r.value.home == worker {
                Some(RecordChange::Delete { user, mod_revision })
            } else if r.value.moving_to.as_deref() == Some(worker) {
                let record = PlacementRecord { home: r.value.home.clone(), moving_to: None };
                Some(RecordChange::Put { user, mod_revision, record })
            } else {
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{KeyValue, Snapshot};
    use crate::view::Keys;

    fn view(members: &[(&str, i64)], records: &[(&str, &str)]) -> ClusterView {
        let k = Keys::default();
        let mut kvs: Vec<KeyValue> = members
            .iter()
            .map(|(n, lease)| KeyValue {
                key: k.member(n),
                value: format!(r#"{{"name":"{n}","addr":"127.0.0.1:1","state":"active"}}"#).into_bytes(),
                mod_revision: 1,
                lease: *lease,
            })
            .collect();
        kvs.extend(records.iter().enumerate().map(|(i, (user, rec))| KeyValue {
            key: k.placement(user),
            value: rec.as_bytes().to_vec(),
            mod_revision: 10 + i as i64,
            lease: 0,
        }));
        ClusterView::from_snapshot(&k, 16, &Snapshot { revision: 20, kvs }).0
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_worker_unreachable_long_enough_is_fenced_by_its_lease() {
        let v = view(&[("a", 7), ("b", 8), ("c", 9)], &[]);
        let down = |w: &str| (w == "b").then_some(3 * S);
        let fences = to_fence(&v, 2 * S, down, |w| w != "b");
        assert_eq!(fences, vec![Fence { worker: "b".into(), lease: 8 }]);
        // Not yet at 2 s; never for a worker that answers.
        assert!(to_fence(&v, 4 * S, down, |w| w != "b").is_empty());
        assert!(to_fence(&v, 2 * S, |_| None, |_| true).is_empty());
    }

    #[test]
    fn a_leader_that_reaches_no_worker_fences_none() {
        let v = view(&[("a", 7), ("b", 8)], &[]);
        assert!(to_fence(&v, S, |_| Some(5 * S), |_| false).is_empty(), "cut off itself, most likely");
        // Two of three down at once (a host with two workers): both go.
        let v = view(&[("a", 7), ("b", 8), ("c", 9)], &[]);
        let down = |w: &str| (w != "a").then_some(5 * S);
        assert_eq!(to_fence(&v, S, down, |w| w == "a").len(), 2);
        // The last worker is never fenced: no other answers.
        let v = view(&[("a", 7)], &[]);
        assert!(to_fence(&v, S, |_| Some(5 * S), |_| false).is_empty());
    }

    #[test]
    fn a_fixed_view_has_no_leases_to_revoke() {
        let v = ClusterView::fixed(&[("a".into(), "x:1".into()), ("b".into(), "x:2".into())], 16);
        assert!(to_fence(&v, S, |w| (w == "a").then_some(9 * S), |w| w == "b").is_empty());
    }

    #[test]
    fn records_naming_the_fenced_worker_change_under_their_revision() {
        let v = view(
            &[("a", 7), ("b", 8), ("c", 9)],
            &[
                ("u-home", r#"{"home":"b"}"#),
                ("u-leaving", r#"{"home":"b","moving_to":"c"}"#),
                ("u-arriving", r#"{"home":"a","moving_to":"b"}"#),
                ("u-other", r#"{"home":"a","moving_to":"c"}"#),
            ],
        );
        let mut changes = record_changes(&v, "b");
        changes.sort_by_key(|c| match c {
            RecordChange::Delete { user, .. } | RecordChange::Put { user, .. } => user.clone(),
        });
        let rev = |u: &str| v.records[u].mod_revision;
        assert_eq!(
            changes,
            vec![
                RecordChange::Put {
                    user: "u-arriving".into(),
                    mod_revision: rev("u-arriving"),
                    record: PlacementRecord { home: "a".into(), moving_to: None },
                },
                RecordChange::Delete { user: "u-home".into(), mod_revision: rev("u-home") },
                RecordChange::Delete { user: "u-leaving".into(), mod_revision: rev("u-leaving") },
            ]
        );
    }
}
