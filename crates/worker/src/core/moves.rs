//! The engine thread's side of moving shards between workers.
//!
//! The rebalancer moves a user by streaming its shard from the source
//! (export, a batch of records per call, between serving steps) to the
//! destination (staged off this thread, then committed here in one swap).
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

use inferscale_engine::Backend;
use inferscale_memory::{ImportReport, KvHeader, ShardRecord, StagedShard};
use tokio::sync::oneshot;

use super::Core;
use crate::error::{Result, WorkerError};
use crate::scheduler::Scheduler;

/// How long a freeze holds without a release.
const FREEZE_TTL: Duration = Duration::from_secs(60);
/// How long a dropped user's requests are refused as moved.
const MOVED_TTL: Duration = Duration::from_secs(120);

pub enum ShardCommand {
    ListUsers {
        reply: oneshot::Sender<Vec<String>>,
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
/// that keeps writes from slipping past a move. Shared by every kind of
/// worker that serves [`ShardCommand`]s.
#[derive(Default)]
pub struct Moves {
    frozen: HashMap<String, Instant>,
    freezing: Vec<(String, oneshot::Sender<Vec<String>>)>,
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
    pub fn check_write(&mut self, user: &str) -> Result<()> {
        if live(&mut self.frozen, user) || live(&mut self.moved, user) {
            return Err(WorkerError::Moving(user.to_string()));
        }
        Ok(())
    }

    /// Whether `user`'s memory may be read here now.
    pub fn check_read(&mut self, user: &str) -> Result<()> {
        if live(&mut self.moved, user) {
            return Err(WorkerError::Moving(user.to_string()));
        }
        Ok(())
    }

    /// Refuses `user`'s writes from now until released (or [`FREEZE_TTL`]).
    pub fn freeze(&mut self, user: &str) {
        self.frozen.insert(user.to_string(), Instant::now() + FREEZE_TTL);
    }

    /// Ends a freeze; with `drop`, refuses `user`'s requests as moved for
    /// [`MOVED_TTL`] (the caller removes the memory).
    pub fn release(&mut self, user: &str, drop: bool) {
        self.frozen.remove(user);
        if drop {
            self.moved.insert(user.to_string(), Instant::now() + MOVED_TTL);
        }
    }

    /// `user`'s shard was imported here: its home is here again.
    pub fn imported(&mut self, user: &str) {
        self.moved.remove(user);
    }
}

impl<B: Backend> Core<'_, '_, B> {
    pub(super) fn handle_shard(&mut self, c: ShardCommand, sched: &mut Scheduler) {
        match c {
            ShardCommand::ListUsers { reply } => {
                let _ = reply.send(self.memory.users().map(str::to_string).collect());
            }
            ShardCommand::ExportBegin { user, reply } => {
                let r = match self.memory.has_user(&user) {
                    true => Ok((self.memory.kv_header().clone(), self.memory.fact_ids(&user))),
                    false => Err(WorkerError::UnknownUser(user)),
                };
                let _ = reply.send(r);
            }
            ShardCommand::Export { user, ids, with_kv, max_bytes, reply } => {
                let r = self.memory.export(self.engine.backend(), &user, &ids, with_kv, max_bytes);
                let _ = reply.send(r.map_err(WorkerError::from));
            }
            ShardCommand::Freeze { user, reply } => {
                self.moves.freeze(&user);
                self.moves.freezing.push((user, reply));
                self.settle_freezes();
            }
            ShardCommand::ImportTarget { reply } => {
                let _ = reply.send((self.memory.dir().to_path_buf(), self.memory.kv_header().clone()));
            }
            ShardCommand::CommitImport { user, staged, reply } => {
                // Requests that retrieved from the old copy must not lay out
                // from the new one.
                self.drop_unstarted(&user, sched, WorkerError::Moving);
                let r = self.memory.commit_import(self.engine.backend(), &user, staged);
                if r.is_ok() {
                    self.moves.imported(&user);
                }
                let _ = reply.send(r.map_err(WorkerError::from));
            }
            ShardCommand::Release { user, drop, reply } => {
                self.moves.release(&user, drop);
                let mut r = Ok(());
                if drop {
                    self.drop_unstarted(&user, sched, WorkerError::Moving);
                    if self.memory.has_user(&user) {
                        r = self.memory.forget_user(&user).map_err(WorkerError::from);
                    }
                }
                let _ = reply.send(r);
            }
        }
    }

    /// Answers freezes whose user has no ingest left in the queue.
    pub(super) fn settle_freezes(&mut self) {
        let pending = std::mem::take(&mut self.moves.freezing);
        for (user, reply) in pending {
            if self.ingests.iter().any(|j| j.user == user) {
                self.moves.freezing.push((user, reply));
            } else {
                let _ = reply.send(self.memory.fact_ids(&user));
            }
        }
    }
}
