//! All-or-nothing ingest. A worker stores one ingest request in batches,
//! between which it serves, and a crash or an error between two batches
//! would leave part of the request behind; even one batch is several
//! records, of which a torn append keeps the whole ones. So before its
//! first batch, the ids a request adds are written to its user's
//! `ingest.pending` (complete or absent: written aside, synced, renamed),
//! and once every batch is stored, removing the file commits it. A memory
//! that opens with the file present rolls the ingest back: those facts,
//! and any KV derived from them, are removed (one rewrite of each log,
//! KV log first, as a forget does) before anything reads the user. An
//! ingest is thus either wholly stored after a crash, or not at all; a
//! retry of the same request stores it (ids already stored are skipped).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use inferscale_engine::Backend;
use inferscale_types::MemoryUnit;

use crate::error::{Result, io};
use crate::log::sync_dir;
use crate::shard::Memory;

/// The file of an ingest under way, in its user's directory.
const PENDING: &str = "ingest.pending";

impl<B: Backend> Memory<B> {
    /// Starts an all-or-nothing ingest of `units` for `user`: records the
    /// ids it adds (those not stored yet) durably, so that a crash before
    /// [`Memory::commit_ingest`] removes them at the next open. Then
    /// [`Memory::ingest`] stores the units, in as many calls as the caller
    /// likes; [`Memory::abort_ingest`] removes what they stored.
    pub fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()> {
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
        if !dir.exists() {
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
            sync_dir(&self.dir.join("users"))?;
        }
        let aside = dir.join(format!("{PENDING}.new"));
        let json = serde_json::to_vec(&ids).map_err(|e| io(&aside)(std::io::Error::other(e)))?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&aside).map_err(io(&aside))?;
            f.write_all(&json).map_err(io(&aside))?;
            f.sync_all().map_err(io(&aside))?;
        }
        let path = dir.join(PENDING);
        std::fs::rename(&aside, &path).map_err(io(&path))?;
        sync_dir(&dir)
    }

    /// Commits the ingest [`Memory::begin_ingest`] started for `user`:
    /// what it stored stays after a crash.
    pub fn commit_ingest(&mut self, user: &str) -> Result<()> {
        let dir = self.user_dir(user);
        remove_pending(&dir)
    }

    /// Removes what the ingest [`Memory::begin_ingest`] started for `user`
    /// stored so far (and any KV derived from it), then ends it. Returns
    /// how many units it removed.
    pub fn abort_ingest(&mut self, user: &str) -> Result<usize> {
        let dir = self.user_dir(user);
        let Some(ids) = read_pending(&dir)? else { return Ok(0) };
        let removed = self.remove_units(user, &ids)?;
        remove_pending(&dir)?;
        Ok(removed)
    }

    /// At open: rolls back every user's unfinished ingest; a user left
    /// with nothing (the ingest created it) is removed.
    pub(crate) fn recover_ingests(&mut self, warnings: &mut Vec<String>) -> Result<()> {
        let users: Vec<(String, PathBuf)> = self
            .users
            .iter()
            .filter(|(_, s)| s.dir.join(PENDING).exists())
            .map(|(u, s)| (u.clone(), s.dir.clone()))
            .collect();
        for (user, dir) in users {
            let removed = self.abort_ingest(&user)?;
            warnings.push(format!(
                "{}: rolled back an unfinished ingest of user {user:?} ({removed} units it had stored)",
                dir.display()
            ));
            if self.users.get(&user).is_some_and(|s| s.facts.is_empty()) {
                self.forget_user(&user)?;
            }
        }
        Ok(())
    }

    /// Removes `ids` of `user` (those stored) with the KV derived from
    /// them; facts whose window held them are re-encoded when needed.
    fn remove_units(&mut self, user: &str, ids: &[String]) -> Result<usize> {
        let window = self.spec.window;
        let Some(shard) = self.users.get_mut(user) else { return Ok(0) };
        let (removed, cascades) = shard.remove_facts(ids, window, &mut self.cache)?;
        if cascades {
            self.pending.insert(user.to_string());
        }
        Ok(removed)
    }
}

/// The ids of `dir`'s ingest under way, if one is. The file is renamed
/// into place only once complete and synced; one that does not parse
/// anyway (a damaged disk) names nothing to remove, and goes.
fn read_pending(dir: &Path) -> Result<Option<Vec<String>>> {
    let path = dir.join(PENDING);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).unwrap_or_default())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&path)(e)),
    }
}

fn remove_pending(dir: &Path) -> Result<()> {
    let path = dir.join(PENDING);
    match std::fs::remove_file(&path) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(&path)(e)),
    }
}
