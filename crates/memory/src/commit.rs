//! All-or-nothing ingest. A worker stores one ingest request in batches,
//! between which it serves, and a crash or an error between two batches
//! would leave part of the request behind; even one batch is several
//! records, of which a torn append keeps the whole ones.
//!
//! So before its first batch, what a request will add is recorded in its
//! user's `ingest.pending`: the ids it adds and the lengths of the user's
//! two logs at that moment (a one-record log, checksummed; written aside,
//! synced and renamed into place, never over another: a user with an
//! unfinished ingest begins no other). Once every batch is stored,
//! removing the file commits the request. An ingest only appends, so
//! rolling one back is cutting both logs back to those lengths: that needs
//! no free space — it works on a full disk — and it is what a memory that
//! opens with the file present does, before anything reads the user. If
//! one of the user's logs was rewritten between two batches (a forget or
//! an update), the lengths mean nothing any more: the rewrite first marks
//! the pending record, and the rollback then removes the ids instead (a
//! rewrite of both logs, KV log first, as a forget does).
//!
//! A rollback that fails (an I/O error; a rewrite on a full disk) leaves
//! the file, so nothing is forgotten: the request's units are hidden at
//! once, the user's writes are refused ([`MemoryError::Unsettled`]) and the
//! rollback is retried ([`Memory::settle`]) until it succeeds. An ingest
//! is thus either wholly stored, or not at all, whatever fails when; a
//! retry of the same request stores it (ids already stored are skipped).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use inferscale_engine::Backend;
use inferscale_types::MemoryUnit;
use serde::{Deserialize, Serialize};

use crate::error::{MemoryError, Result, io};
use crate::log::{RecordLog, sync_dir};
use crate::manifest::PENDING;
use crate::shard::Memory;

/// What an unfinished ingest added, and where its user's logs ended before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Pending {
    ids: Vec<String>,
    facts_len: u64,
    kv_len: u64,
    /// A log of the user was rewritten during the ingest: roll back by id.
    #[serde(default)]
    rewritten: bool,
}

impl<B: Backend> Memory<B> {
    /// Starts an all-or-nothing ingest of `units` for `user`: records the
    /// ids it adds (those not stored yet) and the logs' lengths durably, so
    /// that a failure or a crash before [`Memory::commit_ingest`] removes
    /// them. Then [`Memory::ingest`] stores the units, in as many calls as
    /// the caller likes; [`Memory::abort_ingest`] removes what they stored.
    pub fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()> {
        self.check_intact(user)?;
        self.check_settled(user)?;
        let stored = self.users.get(user).map(|s| &s.by_id);
        let ids: BTreeSet<&str> = units
            .iter()
            .map(|u| u.id.as_str())
            .filter(|id| stored.is_none_or(|by_id| !by_id.contains_key(*id)))
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let dir = self.user_dir(user);
        if dir.join(PENDING).exists() {
            // Never over another ingest's record: that one is settled first.
            return Err(MemoryError::Unsettled(user.to_string()));
        }
        let made = !dir.exists();
        if made {
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
            sync_dir(&self.dir.join("users"))?;
        }
        // A torn last KV record is cut off first: the lengths recorded are
        // where this ingest's appends start.
        if let Some(shard) = self.users.get_mut(user)
            && shard.settle_kv_tail()?
        {
            self.pending.insert(user.to_string());
        }
        let (facts_len, kv_len) = self.users.get(user).map_or((0, 0), |s| (s.log.len_bytes(), s.kv_log.len_bytes()));
        let pending =
            Pending { ids: ids.into_iter().map(str::to_string).collect(), facts_len, kv_len, rewritten: false };
        let written = write_pending(&dir, &pending);
        if written.is_err() && made {
            // Nothing was stored: no trace of the user either.
            let _ = std::fs::remove_dir_all(&dir);
        }
        written
    }

    /// Commits the ingest [`Memory::begin_ingest`] started for `user`:
    /// what it stored stays after a crash.
    pub fn commit_ingest(&mut self, user: &str) -> Result<()> {
        let dir = self.user_dir(user);
        remove_pending(&dir)
    }

    /// Removes what the ingest [`Memory::begin_ingest`] started for `user`
    /// stored so far (and any KV derived from it), then ends it. Returns
    /// how many units it removed. On an error the units are hidden all the
    /// same, and the rollback is retried by [`Memory::settle`].
    pub fn abort_ingest(&mut self, user: &str) -> Result<usize> {
        let dir = self.user_dir(user);
        let pending = match read_pending(&dir) {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(0),
            // What to roll back cannot be read (damaged, an I/O error): the
            // user is refused until repaired, never served with part of an
            // ingest.
            Err(e) => {
                self.mark_damaged(user, &e);
                return Err(e);
            }
        };
        match self.roll_back(user, &pending).and_then(|n| remove_pending(&dir).map(|()| n)) {
            Ok(n) => {
                self.unsettled.remove(user);
                Ok(n)
            }
            Err(e) => {
                self.hide_units(user, &pending.ids);
                self.unsettled.insert(user.to_string());
                Err(e)
            }
        }
    }

    /// Before a log of `user` is rewritten (a forget, an update): marks an
    /// ingest under way so that its rollback goes by id, since the
    /// rewrite moves what it appended.
    pub(crate) fn before_rewrite(&mut self, user: &str) -> Result<()> {
        let dir = self.user_dir(user);
        match read_pending(&dir)? {
            Some(p) if !p.rewritten => write_pending(&dir, &Pending { rewritten: true, ..p }),
            _ => Ok(()),
        }
    }

    /// Retries the rollbacks that failed (see the module doc); returns how
    /// many users are still unsettled. Cheap when there are none.
    pub fn settle(&mut self) -> usize {
        let users: Vec<String> = self.unsettled.iter().cloned().collect();
        for user in users {
            if let Err(e) = self.abort_ingest(&user) {
                tracing::warn!(user, error = %e, "rolling back an unfinished ingest failed again; retrying later");
            }
        }
        self.unsettled.len()
    }

    /// Users whose failed ingest is still being undone.
    pub fn unsettled_count(&self) -> usize {
        self.unsettled.len()
    }

    /// An error while an earlier ingest of `user` is still being rolled back.
    pub(crate) fn check_settled(&self, user: &str) -> Result<()> {
        match self.unsettled.contains(user) {
            true => Err(MemoryError::Unsettled(user.to_string())),
            false => Ok(()),
        }
    }

    /// At open: rolls back every user's unfinished ingest (those users are
    /// read at open, lazily or not); a user left
    /// with nothing (the ingest created it) is removed.
    pub(crate) fn recover_ingests(&mut self, warnings: &mut Vec<String>) -> Result<()> {
        let users: Vec<(String, PathBuf)> = self
            .users
            .opened()
            .filter(|(_, s)| s.dir.join(PENDING).exists())
            .map(|(u, s)| (u.clone(), s.dir.clone()))
            .collect();
        for (user, dir) in users {
            match self.abort_ingest(&user) {
                Ok(removed) => warnings.push(format!(
                    "{}: rolled back an unfinished ingest of user {user:?} ({removed} units it had stored)",
                    dir.display()
                )),
                Err(e) if self.damaged.contains_key(&user) => {
                    warnings.push(format!("user {user:?} is unavailable until repaired: {e}"));
                    continue;
                }
                Err(e) => {
                    warnings.push(format!(
                        "{}: rolling back an unfinished ingest of user {user:?} failed ({e}); its units are hidden \
                         and the rollback is retried",
                        dir.display()
                    ));
                    continue;
                }
            }
            if self.users.get(&user).is_some_and(|s| s.facts.is_empty()) {
                self.forget_user(&user)?;
            }
        }
        Ok(())
    }

    /// Undoes what `pending`'s ingest stored for `user`: by cutting both
    /// logs back, or — after a rewrite — by removing its ids.
    fn roll_back(&mut self, user: &str, pending: &Pending) -> Result<usize> {
        let window = self.spec.window;
        let Some(shard) = self.users.get_mut(user) else { return Ok(0) };
        if pending.rewritten {
            let (removed, cascades) = shard.remove_facts(&pending.ids, window, &mut self.cache)?;
            if cascades {
                self.pending.insert(user.to_string());
            }
            return Ok(removed);
        }
        let (removed, lost_kv) =
            shard.cut_back(&pending.ids, pending.facts_len, pending.kv_len, window, &mut self.cache)?;
        if lost_kv {
            self.pending.insert(user.to_string());
        }
        Ok(removed)
    }

    /// Refuses `user` from now on (until repaired), for what `e` found.
    pub(crate) fn mark_damaged(&mut self, user: &str, e: &MemoryError) {
        tracing::error!(user, error = %e, "a user's stored memory is damaged: refused until repaired");
        self.take_user(user);
        self.unsettled.remove(user);
        self.damaged.insert(user.to_string(), e.to_string());
    }

    /// Takes `ids` of `user` out of what is served, leaving the disk as it
    /// is (a rollback that failed and will be retried).
    fn hide_units(&mut self, user: &str, ids: &[String]) {
        let Some(shard) = self.users.get_mut(user) else { return };
        let mut idxs: Vec<usize> = ids.iter().filter_map(|id| shard.by_id.get(id).copied()).collect();
        idxs.sort_unstable();
        for &i in idxs.iter().rev() {
            shard.remove_fact(i, &mut self.cache);
        }
    }
}

/// `dir`'s unfinished ingest, if there is one. A record that fails its
/// checksum is damage, reported as such: guessing what to remove could
/// remove acknowledged units. A pending file of the first form (a JSON
/// list of ids) is rolled back by id.
fn read_pending(dir: &Path) -> Result<Option<Pending>> {
    let path = dir.join(PENDING);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path)(e)),
    };
    if bytes.first() == Some(&b'[') {
        let ids: Vec<String> = serde_json::from_slice(&bytes).map_err(|e| MemoryError::Damaged {
            path: path.clone(),
            offset: 0,
            reason: e.to_string(),
        })?;
        return Ok(Some(Pending { ids, facts_len: 0, kv_len: 0, rewritten: true }));
    }
    let records = crate::log::read_checked(&path)?;
    let [record] = records.as_slice() else {
        let reason = format!("{} records where one is written", records.len());
        return Err(MemoryError::Damaged { path, offset: 0, reason });
    };
    serde_json::from_slice(record).map(Some).map_err(|e| MemoryError::Damaged {
        path,
        offset: 0,
        reason: e.to_string(),
    })
}

/// Writes `pending` as `dir`'s pending record (aside, synced, renamed).
fn write_pending(dir: &Path, pending: &Pending) -> Result<()> {
    let path = dir.join(PENDING);
    let json = serde_json::to_vec(pending).map_err(|e| io(&path)(std::io::Error::other(e)))?;
    RecordLog::write_new(&path, &[&json])?;
    sync_dir(dir)
}

fn remove_pending(dir: &Path) -> Result<()> {
    let path = dir.join(PENDING);
    match std::fs::remove_file(&path) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(&path)(e)),
    }
}
