//! The [`Placement`] trait: the small, consistent key-value store that
//! membership and placement live in.
//!
//! It is the part of etcd's model the cluster needs and nothing more:
//! prefix reads at a revision, transactions guarded by each key's
//! modification revision (compare-and-swap), leases whose expiry deletes
//! their keys, and watches that resume from a revision. Everything above it
//! (registration, leader election, the routing view) is written once
//! against this trait, so the embedded store for one node runs the same
//! code paths as etcd does in a cluster.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::error::Result;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A lease id; 0 means "no lease".
pub type LeaseId = i64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision of the key's last change: the token a compare-and-swap
    /// names to say "unchanged since I read it".
    pub mod_revision: i64,
    pub lease: LeaseId,
}

/// Every key under a prefix, as of one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub revision: i64,
    pub kvs: Vec<KeyValue>,
}

/// A transaction's guard: `key`'s modification revision equals
/// `mod_revision`, where 0 means the key does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    pub key: String,
    pub mod_revision: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put { key: String, value: Vec<u8>, lease: LeaseId },
    Delete { key: String },
}

/// All `ops` happen at one revision if every compare holds; otherwise
/// nothing happens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Txn {
    pub compare: Vec<Compare>,
    pub ops: Vec<Op>,
}

impl Txn {
    pub fn when(mut self, key: impl Into<String>, mod_revision: i64) -> Txn {
        self.compare.push(Compare { key: key.into(), mod_revision });
        self
    }

    pub fn put(mut self, key: impl Into<String>, value: Vec<u8>, lease: LeaseId) -> Txn {
        self.ops.push(Op::Put { key: key.into(), value, lease });
        self
    }

    pub fn delete(mut self, key: impl Into<String>) -> Txn {
        self.ops.push(Op::Delete { key: key.into() });
        self
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnResult {
    pub succeeded: bool,
    /// The store's revision after the transaction (or when it was refused).
    pub revision: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Put(KeyValue),
    Delete { key: String, mod_revision: i64 },
}

/// The changes of one or more revisions, in order; `revision` is the
/// latest revision they bring the watcher to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchBatch {
    pub revision: i64,
    pub events: Vec<Event>,
}

/// Batches in revision order; an `Err` ends the stream (the store went away
/// or compacted the revisions asked for) and the watcher reloads.
pub type WatchStream = mpsc::Receiver<Result<WatchBatch>>;

/// Where membership and placement live: etcd in a cluster, or the
/// in-process [`crate::embedded::Embedded`] store on one node.
pub trait Placement: Send + Sync + 'static {
    /// Every key that starts with `prefix`.
    fn range(&self, prefix: &str) -> BoxFuture<'_, Result<Snapshot>>;
    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResult>>;
    /// A lease that expires `ttl` after its last keep-alive (etcd rounds to
    /// whole seconds, at least one).
    fn grant(&self, ttl: Duration) -> BoxFuture<'_, Result<LeaseId>>;
    /// Renews `lease`; `Ok(false)` when it has already expired (its keys
    /// are gone and must be written again under a new lease).
    fn keep_alive(&self, lease: LeaseId) -> BoxFuture<'_, Result<bool>>;
    /// Ends `lease` now, deleting its keys.
    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<()>>;
    /// Changes under `prefix` from `from_revision` on (inclusive).
    fn watch(&self, prefix: &str, from_revision: i64) -> BoxFuture<'_, Result<WatchStream>>;
    /// For messages: "etcd at http://…" or "embedded (file …)".
    fn describe(&self) -> String;
}
