//! A worker's side of moving shards between workers: the commands and the
//! state that keeps writes from slipping past a move, the same for every
//! engine (the dispatcher in [`super`] carries the commands out).
//!
//! The rebalancer moves a user by streaming its shard from the source
//! (export, a batch of records per call, between serving steps) to the
//! destination (staged off the host's thread, then committed there in one
//! swap).
//! Two states keep writes from slipping past a move:
//!
//! - *frozen*: after the snapshot is sent the source refuses the user's
//!   writes (retryably) until released, so the units that arrived during
//!   the copy can follow it and none arrives after. A freeze answers only
//!   once the user's queued ingests are stored, so it sees them all.
//! - *moved*: once released with `drop`, the source refuses the user's
//!   requests for a while instead of answering them without memory, so a
//!   router that has not yet seen the new placement retries elsewhere.
//!
//! Both expire on their own, so a rebalancer that dies mid-move cannot
//! leave a user unwritable.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use inferscale_memory::{ImportReport, KvHeader, ShardRecord, StagedShard};
use tokio::sync::oneshot;

use crate::error::{Result, WorkerError};

/// How long a freeze holds without a release.
const FREEZE_TTL: Duration = Duration::from_secs(60);
/// How long a dropped user's requests are refused as moved.
const MOVED_TTL: Duration = Duration::from_secs(120);

pub(crate) enum ShardCommand {
    /// Every user held and the digests of their units ([`super::shard::Shard::users`]).
    ListUsers {
        reply: oneshot::Sender<(Vec<String>, Vec<u64>)>,
    },
    /// The KV header and the user's fact ids, in order.
    ExportBegin {
        user: String,
        reply: oneshot::Sender<Result<(KvHeader, Vec<String>)>>,
    },
    /// Records for a prefix of `ids` (about `max_bytes`), and how many ids it used.
    Export {
        user: String,
        ids: Vec<String>,
        with_kv: bool,
        max_bytes: usize,
        reply: oneshot::Sender<Result<(Vec<ShardRecord>, usize)>>,
    },
    /// Refuses the user's writes from now on; answers with its fact ids once
    /// its queued ingests are stored.
    Freeze {
        user: String,
        reply: oneshot::Sender<Vec<String>>,
    },
    /// Where to stage an import, and the KV header it must match.
    ImportTarget {
        reply: oneshot::Sender<(PathBuf, KvHeader)>,
    },
    CommitImport {
        user: String,
        staged: StagedShard,
        reply: oneshot::Sender<Result<ImportReport>>,
    },
    Release {
        user: String,
        drop: bool,
        reply: oneshot::Sender<Result<()>>,
    },
}

/// Which users are frozen or moved away, with their expiry: the state
/// that keeps writes from slipping past a move.
#[derive(Default)]
pub(crate) struct Moves {
    frozen: HashMap<String, Instant>,
    /// Freezes not answered yet: their user still has an ingest queued.
    pub(super) freezing: Vec<(String, oneshot::Sender<Vec<String>>)>,
    moved: HashMap<String, Instant>,
}

fn live(map: &mut HashMap<String, Instant>, user: &str) -> bool {
    match map.get(user) {
        Some(&until) if Instant::now() < until => true,
        Some(_) => {
            map.remove(user);
            false
        }
        None => false,
    }
}

impl Moves {
    /// Whether `user`'s memory may be written here now.
    pub(crate) fn check_write(&mut self, user: &str) -> Result<()> {
        if live(&mut self.frozen, user) || live(&mut self.moved, user) {
            return Err(WorkerError::Moving(user.to_string()));
        }
        Ok(())
    }

    /// Whether `user`'s memory may be read here now.
    pub(crate) fn check_read(&mut self, user: &str) -> Result<()> {
        if live(&mut self.moved, user) {
            return Err(WorkerError::Moving(user.to_string()));
        }
        Ok(())
    }

    /// Refuses `user`'s writes from now until released (or [`FREEZE_TTL`]).
    pub(crate) fn freeze(&mut self, user: &str) {
        self.frozen.insert(user.to_string(), Instant::now() + FREEZE_TTL);
    }

    /// Ends a freeze; with `drop`, refuses `user`'s requests as moved for
    /// [`MOVED_TTL`] (the caller removes the memory).
    pub(crate) fn release(&mut self, user: &str, drop: bool) {
        self.frozen.remove(user);
        if drop {
            self.moved.insert(user.to_string(), Instant::now() + MOVED_TTL);
        }
    }

    /// `user`'s shard was imported here: its home is here again.
    pub(crate) fn imported(&mut self, user: &str) {
        self.moved.remove(user);
    }
}
