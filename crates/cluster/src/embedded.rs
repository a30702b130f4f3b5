//! [`Placement`] in process, for one node: no external service.
//!
//! The same semantics as etcd for what the cluster uses — revisions,
//! compare-and-swap transactions, leases whose expiry deletes their keys,
//! watches from a revision — so registration, leader election and the
//! routing view run the code they run against etcd. Keys without a lease
//! (placement records) are persisted to a file, written whole and renamed
//! into place on every change, so a restart keeps them; leased keys belong
//! to a process that is gone after a restart and are not kept.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

use crate::error::{ClusterError, Result};
use crate::store::{
    BoxFuture, Event, KeyValue, LeaseId, Op, Placement, Snapshot, Txn, TxnResult, WatchBatch, WatchStream,
};

/// How often expired leases are reaped when nothing else touches the store.
const REAP_EVERY: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    value: Vec<u8>,
    mod_revision: i64,
    #[serde(skip)]
    lease: LeaseId,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    revision: i64,
    kvs: BTreeMap<String, Entry>,
    #[serde(skip)]
    leases: HashMap<LeaseId, (Duration, Instant)>,
    #[serde(skip)]
    next_lease: LeaseId,
}

pub struct Embedded {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<WatchBatch>,
    path: Option<PathBuf>,
}

impl Embedded {
    /// A store kept in memory only (tests, throwaway single-node runs).
    pub fn in_memory() -> Arc<Embedded> {
        Self::build(State::default(), None)
    }

    /// A store persisted at `path`, reloaded if the file exists. Must be
    /// called inside a tokio runtime (a task reaps expired leases).
    pub fn open(path: &Path) -> Result<Arc<Embedded>> {
        let io = |source| ClusterError::Io { path: path.to_path_buf(), source };
        let state = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice::<State>(&bytes).map_err(|e| ClusterError::Decode {
                key: path.display().to_string(),
                reason: format!("not an embedded placement file: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(e) => return Err(io(e)),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| ClusterError::Io { path: dir.to_path_buf(), source })?;
        }
        Ok(Self::build(state, Some(path.to_path_buf())))
    }

    fn build(state: State, path: Option<PathBuf>) -> Arc<Embedded> {
        let (events, _) = broadcast::channel(1024);
        let store = Arc::new(Embedded { state: Arc::new(Mutex::new(state)), events, path });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&store);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(REAP_EVERY).await;
                    let Some(store) = weak.upgrade() else { return };
                    // A failed write of the file is reported by the next
                    // call that changes something; reaping only drops
                    // leased keys, which are not persisted.
                    let _ = store.lock().and_then(|mut s| store.reap(&mut s));
                }
            });
        }
        store
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| ClusterError::Unavailable("embedded placement store poisoned".into()))
    }

    /// Deletes the keys of expired leases, as one revision.
    fn reap(&self, s: &mut State) -> Result<()> {
        let now = Instant::now();
        let expired: Vec<LeaseId> =
            s.leases.iter().filter(|(_, (_, until))| *until <= now).map(|(&id, _)| id).collect();
        if expired.is_empty() {
            return Ok(());
        }
        for id in &expired {
            s.leases.remove(id);
        }
        let keys: Vec<String> =
            s.kvs.iter().filter(|(_, e)| expired.contains(&e.lease)).map(|(k, _)| k.clone()).collect();
        self.apply(s, keys.into_iter().map(|key| Op::Delete { key }).collect())
    }

    /// Applies `ops` as one new revision, persists, and tells watchers.
    fn apply(&self, s: &mut State, ops: Vec<Op>) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let rev = s.revision + 1;
        let mut events = Vec::with_capacity(ops.len());
        let mut durable_change = false;
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    durable_change |= lease == 0 || s.kvs.get(&key).is_some_and(|e| e.lease == 0);
                    s.kvs.insert(key.clone(), Entry { value: value.clone(), mod_revision: rev, lease });
                    events.push(Event::Put(KeyValue { key, value, mod_revision: rev, lease }));
                }
                Op::Delete { key } => {
                    if let Some(old) = s.kvs.remove(&key) {
                        durable_change |= old.lease == 0;
                        events.push(Event::Delete { key, mod_revision: rev });
                    }
                }
            }
        }
        if events.is_empty() {
            return Ok(());
        }
        s.revision = rev;
        if durable_change {
            self.persist(s)?;
        }
        // No watcher is not an error.
        let _ = self.events.send(WatchBatch { revision: rev, events });
        Ok(())
    }

    fn persist(&self, s: &State) -> Result<()> {
        let Some(path) = &self.path else { return Ok(()) };
        let io = |source| ClusterError::Io { path: path.clone(), source };
        let durable = State {
            revision: s.revision,
            kvs: s.kvs.iter().filter(|(_, e)| e.lease == 0).map(|(k, e)| (k.clone(), e.clone())).collect(),
            ..Default::default()
        };
        let bytes = serde_json::to_vec(&durable).map_err(|e| ClusterError::Invalid(e.to_string()))?;
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            f.write_all(&bytes).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        }
        Ok(())
    }
}

impl Placement for Embedded {
    fn range(&self, prefix: &str) -> BoxFuture<'_, Result<Snapshot>> {
        let prefix = prefix.to_string();
        Box::pin(async move {
            let mut s = self.lock()?;
            self.reap(&mut s)?;
            let kvs = s
                .kvs
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .map(|(k, e)| KeyValue {
                    key: k.clone(),
                    value: e.value.clone(),
                    mod_revision: e.mod_revision,
                    lease: e.lease,
                })
                .collect();
            Ok(Snapshot { revision: s.revision, kvs })
        })
    }

    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResult>> {
        Box::pin(async move {
            let mut s = self.lock()?;
            self.reap(&mut s)?;
            let holds = txn.compare.iter().all(|c| s.kvs.get(&c.key).map_or(0, |e| e.mod_revision) == c.mod_revision);
            if !holds {
                return Ok(TxnResult { succeeded: false, revision: s.revision });
            }
            for op in &txn.ops {
                if let Op::Put { lease, key, .. } = op
                    && *lease != 0
                    && !s.leases.contains_key(lease)
                {
                    return Err(ClusterError::Invalid(format!(
                        "put of {key:?} names lease {lease}, which does not exist"
                    )));
                }
            }
            self.apply(&mut s, txn.ops)?;
            Ok(TxnResult { succeeded: true, revision: s.revision })
        })
    }

    fn grant(&self, ttl: Duration) -> BoxFuture<'_, Result<LeaseId>> {
        Box::pin(async move {
            let mut s = self.lock()?;
            s.next_lease += 1;
            let id = s.next_lease;
            let ttl = ttl.max(Duration::from_secs(1));
            s.leases.insert(id, (ttl, Instant::now() + ttl));
            Ok(id)
        })
    }

    fn keep_alive(&self, lease: LeaseId) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            let mut s = self.lock()?;
            self.reap(&mut s)?;
            Ok(match s.leases.get_mut(&lease) {
                Some((ttl, until)) => {
                    *until = Instant::now() + *ttl;
                    true
                }
                None => false,
            })
        })
    }

    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut s = self.lock()?;
            if s.leases.remove(&lease).is_some() {
                let keys: Vec<String> =
                    s.kvs.iter().filter(|(_, e)| e.lease == lease).map(|(k, _)| k.clone()).collect();
                self.apply(&mut s, keys.into_iter().map(|key| Op::Delete { key }).collect())?;
            }
            Ok(())
        })
    }

    fn watch(&self, prefix: &str, from_revision: i64) -> BoxFuture<'_, Result<WatchStream>> {
        let prefix = prefix.to_string();
        Box::pin(async move {
            // Subscribing under the lock means no revision falls between
            // the check and the subscription. No history is kept: a watch
            // can only start right after the current revision.
            let mut sub = {
                let s = self.lock()?;
                if from_revision <= s.revision {
                    return Err(ClusterError::Compacted { requested: from_revision, compacted: s.revision + 1 });
                }
                self.events.subscribe()
            };
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(async move {
                loop {
                    let batch = match sub.recv().await {
                        Ok(b) if b.revision < from_revision => continue,
                        Ok(b) => {
                            let events: Vec<Event> = b
                                .events
                                .into_iter()
                                .filter(|e| match e {
                                    Event::Put(kv) => kv.key.starts_with(&prefix),
                                    Event::Delete { key, .. } => key.starts_with(&prefix),
                                })
                                .collect();
                            if events.is_empty() {
                                continue;
                            }
                            Ok(WatchBatch { revision: b.revision, events })
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            Err(ClusterError::Compacted { requested: from_revision, compacted: 0 })
                        }
                        Err(broadcast::error::RecvError::Closed) => {
                            Err(ClusterError::Unavailable("embedded placement store closed".into()))
                        }
                    };
                    let end = batch.is_err();
                    if tx.send(batch).await.is_err() || end {
                        return;
                    }
                }
            });
            Ok(rx)
        })
    }

    fn describe(&self) -> String {
        match &self.path {
            Some(p) => format!("embedded (file {})", p.display()),
            None => "embedded (in memory)".into(),
        }
    }
}
