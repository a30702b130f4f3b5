//! What the rebalancer should do next, from the cluster view and what each
//! worker holds. Pure: no I/O, so every case is a unit test.
//!
//! The cluster converges on the *target ring* (active and joining
//! members). Each round the leader asks every worker which users it holds,
//! computes these actions, carries out what it can, and asks again; a step
//! that failed is simply planned again next round. The rules:
//!
//! - users whose home did not answer are left alone this round;
//! - a user whose home (placement record, else the ring of active members)
//!   is not its home on the target ring moves there, from its home (or,
//!   when the home lacks it, from any worker that holds it);
//! - a user at its right home gets a copy of its facts on its replica when
//!   the replica lacks one, or holds other units than the home, by the
//!   same difference two rounds running (a worker back from a crash holds
//!   stale copies; a replica made by a failover takes writes before its
//!   copy): the copy replaces the replica's, keeping only what reached it
//!   during the copy. A write on its way to both copies makes a difference
//!   that the next round does not repeat, so it costs no copy;
//! - once home and replica hold a user, copies elsewhere are dropped;
//! - a joining member becomes active once no user is still moving to it;
//! - a placement record is cleared once the ring agrees with it, its home
//!   is gone, or the user has no memory anywhere; a record left mid-move
//!   by a leader that died is reset to its home.

use std::collections::{BTreeMap, BTreeSet};

use crate::view::{ClusterView, MemberState};

/// The users each reachable worker holds (from `ListUsers`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub by_worker: BTreeMap<String, BTreeSet<String>>,
    /// Every live member answered. Copies are dropped only then: a worker
    /// that did not answer may hold the only other copy.
    pub complete: bool,
    /// The digest of each user's units on each worker, where it said.
    pub digests: BTreeMap<String, BTreeMap<String, u64>>,
    /// `(user, replica)` pairs out of step in the previous round, with how
    /// ([`stale_replicas`]). A replica that holds the user is replaced only
    /// when out of step by the same difference twice running, so writes
    /// that reached the home a moment before the replica cost no copy.
    pub stale_before: BTreeMap<(String, String), u64>,
}

impl Holdings {
    fn holders(&self, user: &str) -> Vec<&str> {
        self.by_worker.iter().filter(|(_, us)| us.contains(user)).map(|(w, _)| w.as_str()).collect()
    }

    fn digest(&self, worker: &str, user: &str) -> Option<u64> {
        self.digests.get(worker).and_then(|us| us.get(user)).copied()
    }

    /// How `replica`'s copy of `user` differs from `home`'s: the XOR of the
    /// two digests, which is the XOR of the digests of the units only one
    /// of them holds (0: the same units). `None` unless both said.
    fn difference(&self, user: &str, home: &str, replica: &str) -> Option<u64> {
        Some(self.digest(home, user)? ^ self.digest(replica, user)?)
    }
}

/// The `(user, replica)` pairs whose replica lacks the user (difference:
/// the home's digest) or holds other units than its home (the
/// [`Holdings::difference`]), as far as both answered: the rebalancer
/// keeps them for the next round's [`Holdings::stale_before`], and counts
/// them for its metrics (replicas out of step).
pub fn stale_replicas(view: &ClusterView, holdings: &Holdings) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for (home, users) in &holdings.by_worker {
        for user in users {
            if view.home(user) != Some(home.as_str()) {
                continue;
            }
            let Some(replica) = view.replica(user) else { continue };
            let Some(held) = holdings.by_worker.get(replica) else { continue };
            let difference = match held.contains(user) {
                false => holdings.digest(home, user).unwrap_or(u64::MAX),
                true => holdings.difference(user, home, replica).unwrap_or(0),
            };
            if !held.contains(user) || difference != 0 {
                out.insert((user.clone(), replica.to_string()), difference);
            }
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Move `user`'s shard (facts and KV) and flip its placement.
    Move { user: String, from: String, to: String },
    /// Copy `user`'s facts to its replica (KV is encoded there when needed).
    Replicate { user: String, from: String, to: String },
    /// Remove a copy no longer needed.
    Drop { user: String, worker: String },
    /// Put a joining member into the ring.
    Activate { worker: String },
    /// Delete `user`'s placement record.
    ClearRecord { user: String },
    /// A record left mid-move: back to its home, without the destination.
    ResetRecord { user: String },
}

impl Action {
    /// The action's kind, for logs and trace span names.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Move { .. } => "move",
            Action::Replicate { .. } => "replicate",
            Action::Drop { .. } => "drop",
            Action::Activate { .. } => "activate",
            Action::ClearRecord { .. } => "clear_record",
            Action::ResetRecord { .. } => "reset_record",
        }
    }
}

/// The next actions, moves first (so a round's copies see its moves).
pub fn plan(view: &ClusterView, holdings: &Holdings, replicate: bool) -> Vec<Action> {
    let target = view.target_ring();
    let mut actions = Vec::new();
    let mut users: BTreeSet<&str> = holdings.by_worker.values().flatten().map(String::as_str).collect();
    users.extend(view.records.keys().map(String::as_str));
    let mut arriving: BTreeSet<&str> = BTreeSet::new();
    for user in users {
        let holders = holdings.holders(user);
        let record = view.records.get(user).map(|r| &r.value);
        if record.is_some_and(|r| r.moving_to.is_some()) {
            actions.push(Action::ResetRecord { user: user.into() });
            continue;
        }
        if let Some(r) = record {
            let ring_agrees = view.ring().home(user) == Some(r.home.as_str());
            let gone = !view.alive(&r.home);
            let nowhere = holdings.complete && holders.is_empty();
            if ring_agrees || gone || nowhere {
                actions.push(Action::ClearRecord { user: user.into() });
            }
        }
        let (Some(home), Some(want)) = (view.home(user), target.home(user)) else { continue };
        if !holdings.by_worker.contains_key(home) {
            // The home did not answer (it may have just died): what it holds
            // is unknown, and its users are served by their replicas until
            // its lease settles the question.
            continue;
        }
        if home != want {
            let from = if holders.contains(&home) { Some(home) } else { holders.first().copied() };
            if let Some(from) = from {
                actions.push(Action::Move { user: user.into(), from: from.into(), to: want.into() });
                arriving.insert(want);
            }
            continue;
        }
        if !holders.contains(&home) {
            // Nothing to serve it from at home; only a move can fix that,
            // and a holder elsewhere will be moved in a later round.
            if let Some(&from) = holders.first() {
                actions.push(Action::Move { user: user.into(), from: from.into(), to: home.into() });
            }
            continue;
        }
        let replica = if replicate { view.replica(user) } else { None };
        match replica {
            // A replica that did not answer may hold it already, or be dead.
            Some(r) if !holdings.by_worker.contains_key(r) => {}
            Some(r) if !holders.contains(&r) => {
                actions.push(Action::Replicate { user: user.into(), from: home.into(), to: r.into() });
            }
            Some(r)
                if holdings.difference(user, home, r).is_some_and(|d| {
                    d != 0 && holdings.stale_before.get(&(user.to_string(), r.to_string())) == Some(&d)
                }) =>
            {
                actions.push(Action::Replicate { user: user.into(), from: home.into(), to: r.into() });
            }
            _ if holdings.complete => {
                let writers = view.writers(user, replicate);
                for h in holders {
                    if !writers.contains(&h) {
                        actions.push(Action::Drop { user: user.into(), worker: h.into() });
                    }
                }
            }
            _ => {}
        }
    }
    for m in view.members.values() {
        if m.value.state == MemberState::Joining && !arriving.contains(m.value.name.as_str()) {
            actions.push(Action::Activate { worker: m.value.name.clone() });
        }
    }
    actions.sort_by_key(|a| match a {
        Action::ResetRecord { .. } => 0,
        Action::Move { .. } => 1,
        Action::Replicate { .. } => 2,
        Action::Activate { .. } => 3,
        Action::ClearRecord { .. } => 4,
        Action::Drop { .. } => 5,
    });
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Event, KeyValue, Snapshot};
    use crate::view::Keys;

    fn kv(key: String, value: String, rev: i64) -> KeyValue {
        KeyValue { key, value: value.into_bytes(), mod_revision: rev, lease: 0 }
    }

    fn member(name: &str, state: &str) -> KeyValue {
        let v = format!(r#"{{"name":"{name}","addr":"127.0.0.1:1","state":"{state}"}}"#);
        kv(Keys::default().member(name), v, 1)
    }

    fn view(members: &[(&str, &str)]) -> ClusterView {
        let kvs = members.iter().map(|(n, s)| member(n, s)).collect();
        ClusterView::from_snapshot(&Keys::default(), 64, &Snapshot { revision: 1, kvs }).0
    }

    fn users() -> Vec<String> {
        (0..60).map(|i| format!("user-{i}")).collect()
    }

    /// Holdings as a settled cluster has them: every user at home and replica.
    fn settled(v: &ClusterView) -> Holdings {
        let mut h = Holdings { complete: true, ..Default::default() };
        for u in users() {
            for w in v.writers(&u, true) {
                h.by_worker.entry(w.to_string()).or_default().insert(u.clone());
            }
        }
        h
    }

    #[test]
    fn a_settled_cluster_needs_nothing() {
        let v = view(&[("a", "active"), ("b", "active"), ("c", "active")]);
        assert_eq!(plan(&v, &settled(&v), true), vec![]);
    }

    #[test]
    fn a_joining_worker_receives_its_share_then_is_activated() {
        let before = view(&[("a", "active"), ("b", "active"), ("c", "active")]);
        let holdings = settled(&before);
        let v = view(&[("a", "active"), ("b", "active"), ("c", "active"), ("d", "joining")]);
        let actions = plan(&v, &holdings, true);
        let moves: Vec<&Action> = actions.iter().filter(|a| matches!(a, Action::Move { .. })).collect();
        let target = v.target_ring();
        let expected = users().iter().filter(|u| target.home(u) == Some("d")).count();
        assert!(expected > 5, "d should take a share, got {expected}");
        assert_eq!(moves.len(), expected);
        for a in &moves {
            let Action::Move { user, from, to } = a else { unreachable!() };
            assert_eq!(to, "d");
            assert_eq!(Some(from.as_str()), before.home(user), "{user} moves from its home");
        }
        assert!(!actions.contains(&Action::Activate { worker: "d".into() }), "not before its users arrive");
        assert!(!actions.iter().any(|a| matches!(a, Action::Drop { .. })), "nothing dropped mid-join");
        // With no user left to move to it, d is activated.
        let empty = Holdings { complete: true, ..Default::default() };
        assert_eq!(plan(&v, &empty, true), vec![Action::Activate { worker: "d".into() }]);
    }

    #[test]
    fn after_a_flip_the_record_holds_until_activation_then_clears() {
        let mut v = view(&[("a", "active"), ("b", "active"), ("d", "joining")]);
        let user = users().into_iter().find(|u| v.target_ring().home(u) == Some("d")).expect("a user for d");
        let old_home = v.home(&user).expect("home").to_string();
        let rec = kv(Keys::default().placement(&user), r#"{"home":"d"}"#.into(), 2);
        v.apply(2, &[Event::Put(rec)]);
        assert_eq!(v.home(&user), Some("d"));
        let mut h = Holdings { complete: true, ..Default::default() };
        h.by_worker.entry("d".into()).or_default().insert(user.clone());
        h.by_worker.entry(old_home.clone()).or_default().insert(user.clone());
        let actions = plan(&v, &h, true);
        assert!(!actions.iter().any(|a| matches!(a, Action::Move { .. } | Action::ClearRecord { .. })), "{actions:?}");
        assert!(actions.contains(&Action::Activate { worker: "d".into() }), "{actions:?}");
        // Activated: the ring agrees with the record, which is cleared.
        v.apply(3, &[Event::Put(member("d", "active"))]);
        assert!(plan(&v, &h, true).contains(&Action::ClearRecord { user: user.clone() }));
    }

    #[test]
    fn when_a_worker_dies_its_users_stay_with_their_replica_and_get_a_new_one() {
        let before = view(&[("a", "active"), ("b", "active"), ("c", "active")]);
        let mut holdings = settled(&before);
        holdings.by_worker.remove("b");
        let v = view(&[("a", "active"), ("c", "active")]);
        let actions = plan(&v, &holdings, true);
        assert!(!actions.iter().any(|a| matches!(a, Action::Move { .. })), "the replica is already home: {actions:?}");
        for u in users().iter().filter(|u| before.writers(u, true).contains(&"b")) {
            let home = v.home(u).expect("home");
            let replica = v.replica(u).expect("replica");
            assert!(holdings.holders(u).contains(&home), "{u}: its new home held its replica");
            if !holdings.holders(u).contains(&replica) {
                assert!(actions.contains(&Action::Replicate {
                    user: u.clone(),
                    from: home.into(),
                    to: replica.into()
                }));
            }
        }
    }

    #[test]
    fn a_replica_out_of_step_with_its_home_is_replaced_when_so_twice_running() {
        // b died; its users' new replicas took writes before their copies
        // (or hold stale copies from before a crash): they hold the user,
        // but not the home's units.
        let before = view(&[("a", "active"), ("b", "active"), ("c", "active")]);
        let v = view(&[("a", "active"), ("c", "active")]);
        let user = users().into_iter().find(|u| before.home(u) == Some("b")).expect("a user of b");
        let (home, replica) = (v.home(&user).unwrap().to_string(), v.replica(&user).unwrap().to_string());
        let mut h = Holdings { complete: true, ..Default::default() };
        for (w, n) in [(&home, 12), (&replica, 1)] {
            h.by_worker.entry(w.clone()).or_default().insert(user.clone());
            h.digests.entry(w.clone()).or_default().insert(user.clone(), n);
        }
        let copy = Action::Replicate { user: user.clone(), from: home.clone(), to: replica.clone() };
        assert!(!plan(&v, &h, true).contains(&copy), "not on one round's evidence");
        let stale = stale_replicas(&v, &h);
        let key = (user.clone(), replica.clone());
        assert_eq!(stale.get(&key), Some(&(12 ^ 1)), "{stale:?}");
        h.stale_before = stale;
        assert!(plan(&v, &h, true).contains(&copy), "out of step the same way twice running: replaced");
        // Another difference the next round (a write on its way to both
        // copies, say): not yet.
        let mut busy = h.clone();
        busy.digests.get_mut(&home).unwrap().insert(user.clone(), 12 ^ 0x40);
        assert!(!plan(&v, &busy, true).contains(&copy), "a difference seen once");
        // A replica in step with its home is left alone.
        h.digests.get_mut(&replica).unwrap().insert(user.clone(), 12);
        assert!(!plan(&v, &h, true).contains(&copy));
        assert!(!stale_replicas(&v, &h).contains_key(&key));
    }

    #[test]
    fn a_home_that_does_not_answer_is_left_alone() {
        let v = view(&[("a", "active"), ("b", "active"), ("c", "active")]);
        let mut holdings = settled(&v);
        holdings.by_worker.remove("b");
        holdings.complete = false;
        for a in plan(&v, &holdings, true) {
            let user = match &a {
                Action::Move { user, .. } | Action::Replicate { user, .. } | Action::Drop { user, .. } => user,
                other => panic!("unexpected {other:?}"),
            };
            assert_ne!(v.home(user), Some("b"), "{a:?} touches a user of the silent worker");
            assert!(!matches!(&a, Action::Move { to, .. } | Action::Replicate { to, .. } if to == "b"), "{a:?}");
        }
    }

    #[test]
    fn draining_moves_pinned_users_and_drops_copies_only_when_all_answered() {
        let v0 = view(&[("a", "active"), ("b", "active"), ("c", "active")]);
        let holdings = settled(&v0);
        let mut v = view(&[("a", "active"), ("b", "draining"), ("c", "active")]);
        // Drain pins b's users to b first, so they move with their KV.
        let pinned: Vec<String> = users().into_iter().filter(|u| v0.home(u) == Some("b")).collect();
        let events: Vec<Event> =
            pinned.iter().map(|u| Event::Put(kv(Keys::default().placement(u), r#"{"home":"b"}"#.into(), 2))).collect();
        v.apply(2, &events);
        let actions = plan(&v, &holdings, true);
        for u in &pinned {
            let to = v.target_ring().home(u).expect("home").to_string();
            assert!(actions.contains(&Action::Move { user: u.clone(), from: "b".into(), to }), "{u}: {actions:?}");
        }
        let mut partial = holdings.clone();
        partial.complete = false;
        assert!(!plan(&v, &partial, true).iter().any(|a| matches!(a, Action::Drop { .. })));
    }

    #[test]
    fn records_left_mid_move_are_reset_and_stale_ones_cleared() {
        let mut v = view(&[("a", "active"), ("b", "active")]);
        let k = Keys::default();
        v.apply(
            2,
            &[
                Event::Put(kv(k.placement("moving"), r#"{"home":"a","moving_to":"b"}"#.into(), 2)),
                Event::Put(kv(k.placement("dead-home"), r#"{"home":"zz"}"#.into(), 2)),
                Event::Put(kv(k.placement("forgotten"), r#"{"home":"a"}"#.into(), 2)),
            ],
        );
        let actions = plan(&v, &Holdings { complete: true, ..Default::default() }, true);
        assert!(actions.contains(&Action::ResetRecord { user: "moving".into() }));
        assert!(actions.contains(&Action::ClearRecord { user: "dead-home".into() }));
        assert!(actions.contains(&Action::ClearRecord { user: "forgotten".into() }));
    }

    #[test]
    fn without_replication_only_the_home_keeps_a_copy() {
        let v = view(&[("a", "active"), ("b", "active")]);
        let h = settled(&v);
        let actions = plan(&v, &h, false);
        assert!(!actions.is_empty());
        for a in actions {
            let Action::Drop { user, worker } = a else { panic!("only drops expected: {a:?}") };
            assert_ne!(v.home(&user), Some(worker.as_str()));
        }
    }
}
