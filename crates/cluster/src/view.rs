//! The cluster as routers see it, and where each user's requests go.
//!
//! State in the placement store, under a root prefix (`/inferscale` by
//! default):
//!
//! ```text
//! <root>/members/<worker>    Member (JSON), under the worker's lease: gone when it dies
//! <root>/placement/<user>    PlacementRecord (JSON): overrides the ring for that user
//! <root>/leader              the router that runs rebalancing, under its lease
//! ```
//!
//! Routing is pure over a [`ClusterView`]: a user's *home* serves its reads
//! and takes its writes; its *replica* (the next worker clockwise) takes
//! every write too, so it can take over when the home dies; during a
//! migration the destination takes writes as well. The ring is built over
//! *active* members only: a worker that just joined receives its share of
//! users by migration before it is made active, so no user is ever routed
//! to a worker that does not hold its memory yet.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};
use crate::ring::Ring;
use crate::store::{Event, KeyValue, Snapshot};

/// The store keys of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// Keys under `root` (e.g. `/inferscale`; a trailing `/` is ignored).
    pub fn new(root: &str) -> Keys {
        Keys { root: root.trim_end_matches('/').to_string() }
    }

    /// Every key of the cluster.
    pub fn prefix(&self) -> String {
        format!("{}/", self.root)
    }

    pub fn member(&self, name: &str) -> String {
        format!("{}/members/{name}", self.root)
    }

    pub fn placement(&self, user: &str) -> String {
        format!("{}/placement/{user}", self.root)
    }

    pub fn leader(&self) -> String {
        format!("{}/leader", self.root)
    }

    /// What `key` is, if it is one of this cluster's.
    fn classify<'k>(&self, key: &'k str) -> Option<Key<'k>> {
        let rest = key.strip_prefix(self.root.as_str())?.strip_prefix('/')?;
        if let Some(name) = rest.strip_prefix("members/") {
            Some(Key::Member(name))
        } else if let Some(user) = rest.strip_prefix("placement/") {
            Some(Key::Placement(user))
        } else {
            (rest == "leader").then_some(Key::Leader)
        }
    }
}

enum Key<'k> {
    Member(&'k str),
    Placement(&'k str),
    Leader,
}

impl Default for Keys {
    fn default() -> Keys {
        Keys::new("/inferscale")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Registered, receiving its share of users; not in the ring yet.
    Joining,
    /// In the ring.
    Active,
    /// Leaving: its users are being moved away; out of the ring.
    Draining,
}

/// A worker as registered in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub name: String,
    /// gRPC address (`host:port`).
    pub addr: String,
    pub state: MemberState,
    /// The GPU this worker serves from, when it has one: shard moves
    /// between two GPUs of one host go over NCCL (see [`Member::nccl_peer`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuId>,
}

/// Where a worker's GPU is, in terms two workers can compare.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuId {
    /// The machine (a Kubernetes node name, `/etc/machine-id`, or what the
    /// operator sets): equal for two workers exactly when they share a host.
    pub host: String,
    /// The device's UUID (not an ordinal: each worker may see its GPU as
    /// device 0 behind `CUDA_VISIBLE_DEVICES`).
    pub device: String,
}

impl Member {
    /// Whether a shard move between this worker and `other` can go over an
    /// NCCL link: both serve from GPUs, on one host, and not the same GPU
    /// (NCCL refuses two ranks on one device).
    pub fn nccl_peer(&self, other: &Member) -> bool {
        match (&self.gpu, &other.gpu) {
            (Some(a), Some(b)) => a.host == b.host && a.device != b.device,
            _ => false,
        }
    }
}

/// An explicit placement of one user, overriding the ring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRecord {
    /// Where the user's reads go (while alive).
    pub home: String,
    /// Set while the user's shard is being copied to that worker: it takes
    /// the user's writes as well, so the copy misses none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving_to: Option<String>,
}

/// A value with the store revision that last changed it (the token for a
/// compare-and-swap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    pub value: T,
    pub mod_revision: i64,
    pub lease: i64,
}

fn versioned<T>(kv: &KeyValue, value: T) -> Versioned<T> {
    Versioned { value, mod_revision: kv.mod_revision, lease: kv.lease }
}

#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    /// Store revision this view reflects.
    pub revision: i64,
    /// False while the store is unreachable: the view is the last one seen
    /// and nothing should be rebalanced from it.
    pub connected: bool,
    pub members: BTreeMap<String, Versioned<Member>>,
    pub records: BTreeMap<String, Versioned<PlacementRecord>>,
    pub leader: Option<Versioned<String>>,
    /// Over the active members; shared between the views a watch
    /// publishes, rebuilt only when membership changes.
    ring: Arc<Ring>,
    keys: Keys,
    vnodes: usize,
}

impl ClusterView {
    /// The view of `snapshot` (every key under `keys.prefix()`). Values this
    /// build cannot read are skipped and reported, not fatal: one bad key
    /// must not take routing down.
    pub fn from_snapshot(keys: &Keys, vnodes: usize, snapshot: &Snapshot) -> (ClusterView, Vec<ClusterError>) {
        let mut view = ClusterView {
            revision: snapshot.revision,
            connected: true,
            vnodes,
            keys: keys.clone(),
            ..Default::default()
        };
        let mut errors = Vec::new();
        for kv in &snapshot.kvs {
            if let Err(e) = view.put(kv) {
                errors.push(e);
            }
        }
        view.rebuild_ring();
        (view, errors)
    }

    /// A view of a fixed set of workers, all active (a router given its
    /// workers on the command line): `(name, gRPC address)` pairs.
    pub fn fixed(workers: &[(String, String)], vnodes: usize) -> ClusterView {
        let members = workers
            .iter()
            .map(|(name, addr)| {
                let m = Member { name: name.clone(), addr: addr.clone(), state: MemberState::Active, gpu: None };
                (name.clone(), Versioned { value: m, mod_revision: 0, lease: 0 })
            })
            .collect();
        let mut view = ClusterView { connected: true, members, vnodes, ..Default::default() };
        view.rebuild_ring();
        view
    }

    /// The ring the cluster is heading for: active and joining members
    /// (a draining one is on its way out). Users whose home differs between
    /// this ring and [`ClusterView::ring`] are the ones to move.
    pub fn target_ring(&self) -> Ring {
        let names = self
            .members
            .values()
            .filter(|m| matches!(m.value.state, MemberState::Active | MemberState::Joining))
            .map(|m| m.value.name.clone());
        Ring::new(names, self.vnodes.max(1))
    }

    /// Applies watched events (in order) and moves to `revision`.
    pub fn apply(&mut self, revision: i64, events: &[Event]) -> Vec<ClusterError> {
        let mut errors = Vec::new();
        let mut membership = false;
        for e in events {
            match e {
                Event::Put(kv) => match self.put(kv) {
                    Ok(changed) => membership |= changed,
                    Err(e) => errors.push(e),
                },
                Event::Delete { key, .. } => membership |= self.delete(key),
            }
        }
        self.revision = self.revision.max(revision);
        if membership {
            self.rebuild_ring();
        }
        errors
    }

    /// Applies one put; returns whether membership changed.
    fn put(&mut self, kv: &KeyValue) -> Result<bool> {
        let decode = |reason: String| ClusterError::Decode { key: kv.key.clone(), reason };
        match self.keys.classify(&kv.key) {
            Some(Key::Member(name)) => {
                let m: Member = serde_json::from_slice(&kv.value).map_err(|e| decode(e.to_string()))?;
                if m.name != name {
                    return Err(decode(format!("member record names {:?}", m.name)));
                }
                self.members.insert(name.to_string(), versioned(kv, m));
                return Ok(true);
            }
            Some(Key::Placement(user)) => {
                let r: PlacementRecord = serde_json::from_slice(&kv.value).map_err(|e| decode(e.to_string()))?;
                self.records.insert(user.to_string(), versioned(kv, r));
            }
            Some(Key::Leader) => {
                let name = String::from_utf8(kv.value.clone()).map_err(|e| decode(e.to_string()))?;
                self.leader = Some(versioned(kv, name));
            }
            None => {}
        }
        Ok(false)
    }

    /// Applies one delete; returns whether membership changed.
    fn delete(&mut self, key: &str) -> bool {
        match self.keys.classify(key) {
            Some(Key::Member(name)) => return self.members.remove(name).is_some(),
            Some(Key::Placement(user)) => {
                self.records.remove(user);
            }
            Some(Key::Leader) => self.leader = None,
            None => {}
        }
        false
    }

    fn rebuild_ring(&mut self) {
        let active =
            self.members.values().filter(|m| m.value.state == MemberState::Active).map(|m| m.value.name.clone());
        self.ring = Arc::new(Ring::new(active, self.vnodes.max(1)));
    }

    /// The ring over active members.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    pub fn member(&self, name: &str) -> Option<&Member> {
        self.members.get(name).map(|m| &m.value)
    }

    /// Whether `name` is registered (its lease lives).
    pub fn alive(&self, name: &str) -> bool {
        self.members.contains_key(name)
    }

    /// Where `user`'s reads go: its placement record's home while that
    /// worker is alive, else its ring home. `None` with no active worker.
    pub fn home(&self, user: &str) -> Option<&str> {
        match self.records.get(user) {
            Some(r) if self.alive(&r.value.home) => Some(r.value.home.as_str()),
            _ => self.ring.home(user),
        }
    }

    /// Where `user`'s reads go when only the workers `usable` says yes to
    /// can answer (the router's health probes see a crash long before the
    /// crashed worker's lease expires): its home if usable, else the first
    /// usable worker clockwise — its replica, which holds its facts.
    pub fn reader<F: Fn(&str) -> bool>(&self, user: &str, usable: F) -> Option<&str> {
        match self.home(user) {
            Some(h) if usable(h) => Some(h),
            _ => self.ring.successors(user).find(|w| usable(w)),
        }
    }

    /// The worker that holds a copy of `user`'s facts to take over when
    /// its home dies: the first ring successor other than the home.
    pub fn replica(&self, user: &str) -> Option<&str> {
        let home = self.home(user)?;
        self.ring.successors(user).find(|w| *w != home)
    }

    /// Every worker a write of `user` must reach before it is
    /// acknowledged: home, replica (when `replicate`), and a migration's
    /// destination.
    pub fn writers(&self, user: &str, replicate: bool) -> Vec<&str> {
        let mut out: Vec<&str> = self.home(user).into_iter().collect();
        let replica = if replicate { self.replica(user) } else { None };
        let moving = self.records.get(user).and_then(|r| r.value.moving_to.as_deref()).filter(|w| self.alive(w));
        for w in replica.into_iter().chain(moving) {
            if !out.contains(&w) {
                out.push(w);
            }
        }
        out
    }

    /// Whether `user` is being moved (its writes wait for deletes until the
    /// move settles, see the router).
    pub fn moving(&self, user: &str) -> bool {
        self.records.get(user).is_some_and(|r| r.value.moving_to.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_only_between_two_gpus_of_one_host() {
        let m = |host: &str, device: &str| Member {
            name: format!("{host}/{device}"),
            addr: String::new(),
            state: MemberState::Active,
            gpu: (!host.is_empty()).then(|| GpuId { host: host.into(), device: device.into() }),
        };
        assert!(m("node-a", "GPU-0").nccl_peer(&m("node-a", "GPU-1")));
        assert!(!m("node-a", "GPU-0").nccl_peer(&m("node-a", "GPU-0")), "one device");
        assert!(!m("node-a", "GPU-0").nccl_peer(&m("node-b", "GPU-1")), "two hosts");
        assert!(!m("", "").nccl_peer(&m("node-a", "GPU-1")), "a CPU worker");
        // What a worker registers round-trips, and an old record without
        // the field reads as a worker without a GPU.
        let gpu = m("node-a", "GPU-0");
        let back: Member = serde_json::from_slice(&serde_json::to_vec(&gpu).unwrap()).unwrap();
        assert_eq!(back, gpu);
        let old: Member = serde_json::from_str(r#"{"name":"w","addr":"a:1","state":"active"}"#).unwrap();
        assert_eq!(old.gpu, None);
    }

    fn kv(key: &str, value: &str, rev: i64) -> KeyValue {
        KeyValue { key: key.into(), value: value.as_bytes().to_vec(), mod_revision: rev, lease: 0 }
    }

    fn member(keys: &Keys, name: &str, state: &str, rev: i64) -> KeyValue {
        kv(&keys.member(name), &format!(r#"{{"name":"{name}","addr":"127.0.0.1:1","state":"{state}"}}"#), rev)
    }

    fn view(kvs: Vec<KeyValue>) -> ClusterView {
        let keys = Keys::default();
        let (v, errors) = ClusterView::from_snapshot(&keys, 64, &Snapshot { revision: 10, kvs });
        assert!(errors.is_empty(), "{errors:?}");
        v
    }

    #[test]
    fn ring_holds_active_members_only() {
        let k = Keys::default();
        let v = view(vec![member(&k, "a", "active", 1), member(&k, "b", "active", 2), member(&k, "c", "joining", 3)]);
        assert_eq!(v.ring().workers(), ["a", "b"]);
        for u in 0..200 {
            let user = format!("u{u}");
            let home = v.home(&user).expect("a home");
            assert_ne!(home, "c", "a joining worker gets no user before its migration");
            let replica = v.replica(&user).expect("a replica");
            assert_ne!(home, replica);
            assert_eq!(v.writers(&user, true), vec![home, replica]);
        }
    }

    #[test]
    fn a_record_overrides_the_ring_while_its_home_lives() {
        let k = Keys::default();
        let mut v =
            view(vec![member(&k, "a", "active", 1), member(&k, "b", "active", 2), member(&k, "c", "joining", 3)]);
        let user = (0..100).map(|i| format!("u{i}")).find(|u| v.home(u) == Some("a")).expect("some user of a");
        v.apply(11, &[Event::Put(kv(&k.placement(&user), r#"{"home":"a","moving_to":"c"}"#, 11))]);
        assert_eq!(v.home(&user), Some("a"));
        assert!(v.moving(&user));
        assert_eq!(v.writers(&user, true), vec!["a", "b", "c"], "home, replica, destination");
        // The flip: home is c (not in the ring yet, but alive).
        v.apply(12, &[Event::Put(kv(&k.placement(&user), r#"{"home":"c"}"#, 12))]);
        assert_eq!(v.home(&user), Some("c"));
        assert!(!v.moving(&user));
        // c dies: the user falls back to the ring, whose home holds a copy.
        v.apply(13, &[Event::Delete { key: k.member("c"), mod_revision: 13 }]);
        assert_eq!(v.home(&user), Some("a"));
        assert_eq!(v.revision, 13);
    }

    #[test]
    fn when_the_home_dies_the_replica_becomes_home() {
        let k = Keys::default();
        let mut v =
            view(vec![member(&k, "a", "active", 1), member(&k, "b", "active", 2), member(&k, "c", "active", 3)]);
        let users: Vec<String> = (0..300).map(|i| format!("user-{i}")).collect();
        let before: Vec<(String, String)> = users
            .iter()
            .map(|u| (v.home(u).unwrap_or("").to_string(), v.replica(u).unwrap_or("").to_string()))
            .collect();
        v.apply(11, &[Event::Delete { key: k.member("b"), mod_revision: 11 }]);
        for (u, (home, replica)) in users.iter().zip(before) {
            let now = v.home(u).expect("a home");
            if home == "b" {
                assert_eq!(now, replica, "{u}: its replica takes over");
            } else {
                assert_eq!(now, home, "{u}: users of live workers stay");
            }
        }
    }

    #[test]
    fn bad_values_are_reported_and_skipped() {
        let k = Keys::default();
        let (v, errors) = ClusterView::from_snapshot(
            &k,
            8,
            &Snapshot {
                revision: 3,
                kvs: vec![
                    member(&k, "a", "active", 1),
                    kv(&k.member("b"), "not json", 2),
                    kv(&k.placement("u"), "{}", 3),
                ],
            },
        );
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert_eq!(v.ring().workers(), ["a"]);
        assert!(v.records.is_empty());
    }
}
