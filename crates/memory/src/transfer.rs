//! Moving a user's shard between workers.
//!
//! The source exports records — each fact as its fact-log record, with its
//! KV as its segment record when it has one — a batch at a time between
//! serving steps. The destination writes them to a staging directory off
//! the engine thread (`staging/<user>-<n>/`, the same two logs a user
//! directory holds), checking each record as it lands; then
//! [`Memory::commit_import`] swaps the staged directory in for the user's
//! own in two renames and reloads it. Units the destination received for
//! the user while the copy ran (writes are sent to a migration's
//! destination too) are kept, after the shard's own, with their KV
//! re-encoded in the new context. Units it held from before the copy that
//! the shard lacks are dropped: the source's copy is the user's memory,
//! and a stale copy (a worker back from a crash, a replica that missed a
//! forget) must not bring back what the user no longer has.
//!
//! Crash safety: the old copy is renamed to `trash/<user>` before the
//! staged one takes its name. [`recover`], run when the memory opens, puts
//! a trashed copy back if the crash came between the two renames, and
//! clears staging leftovers, so a user is never lost to a failed import.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use inferscale_engine::Backend;

use crate::error::{MemoryError, Result, io};
use crate::fact::{Fact, Record};
use crate::kvseg::{KvHeader, StoredKv};
use crate::log::{RecordLog, sync_dir};
use crate::shard::{Memory, user_dir_name};
use crate::user::UserShard;

/// One fact in transfer form: its fact-log record and, when the source had
/// its KV, its segment record (else empty: the destination encodes it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShardRecord {
    pub fact: Vec<u8>,
    pub kv: Vec<u8>,
}

impl ShardRecord {
    /// Bytes this record carries.
    pub fn len(&self) -> usize {
        self.fact.len() + self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fact.is_empty()
    }

    /// CRC-32 of the fact record then the KV record: what travels beside
    /// them so the destination can tell a damaged record from a good one.
    pub fn checksum(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        h.update(&self.fact);
        h.update(&self.kv);
        h.finalize()
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ImportReport {
    /// Facts the user has after the import.
    pub facts: usize,
    /// Of the shard's facts, those that came with their KV.
    pub with_kv: usize,
    /// Units the destination received during the copy that the shard
    /// lacked, kept.
    pub kept: usize,
    /// Units the destination held from before the copy that the shard
    /// lacked, dropped.
    pub dropped: usize,
    pub bytes: u64,
}

impl<B: Backend> Memory<B> {
    /// The memory's directory (staging for imports lives under it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What this shard's KV is made with, as a transfer names it.
    pub fn kv_header(&self) -> &KvHeader {
        &self.header
    }

    /// `user`'s fact ids in order (empty for an unknown user).
    pub fn fact_ids(&self, user: &str) -> Vec<String> {
        self.users.get(user).map_or_else(Vec::new, |s| s.facts.iter().map(|f| f.unit.id.clone()).collect())
    }

    /// The start of an export of `user`: the header of the user's KV
    /// segment (the records travel in its format) and the user's fact ids,
    /// in order.
    pub fn export_begin(&self, user: &str) -> Result<(KvHeader, Vec<String>)> {
        self.check_intact(user)?;
        match self.users.get(user) {
            Some(shard) => Ok((shard.seg.clone(), self.fact_ids(user))),
            None => Err(MemoryError::UnknownUser(user.to_string())),
        }
    }

    /// Transfer records of `user`'s facts named in `ids`, in that order,
    /// with their KV records as stored when `with_kv` (a record that fails
    /// its check travels without: the destination encodes it), stopping
    /// once `max_bytes` are gathered (at least one record). Ids no longer
    /// stored (forgotten meanwhile) are skipped. Returns the records and
    /// how many of `ids` were consumed.
    pub fn export(
        &self,
        user: &str,
        ids: &[String],
        with_kv: bool,
        max_bytes: usize,
    ) -> Result<(Vec<ShardRecord>, usize)> {
        let Some(shard) = self.users.get(user) else { return Ok((Vec::new(), ids.len())) };
        let by_id: std::collections::HashMap<&str, usize> =
            shard.facts.iter().enumerate().map(|(i, f)| (f.unit.id.as_str(), i)).collect();
        let mut out = Vec::new();
        let mut bytes = 0;
        let mut used = 0;
        for id in ids {
            if !out.is_empty() && bytes >= max_bytes {
                break;
            }
            used += 1;
            let Some(&i) = by_id.get(id.as_str()) else { continue };
            let fact = &shard.facts[i];
            let kv = match with_kv {
                true => shard.kv_record(i).ok().flatten().unwrap_or_default(),
                false => Vec::new(),
            };
            let r = ShardRecord { fact: Record::encode_put(fact), kv };
            bytes += r.len();
            out.push(r);
        }
        Ok((out, used))
    }

    /// Replaces `user`'s copy here with `staged`, keeping (after the
    /// shard's units) the units this memory received for `user` since the
    /// staging began that the shard lacks; older units the shard lacks are
    /// dropped. On failure the previous copy is back in place.
    pub fn commit_import(&mut self, user: &str, mut staged: StagedShard) -> Result<ImportReport> {
        let mut report =
            ImportReport { facts: staged.ids.len(), with_kv: staged.with_kv, kept: 0, dropped: 0, bytes: staged.bytes };
        if let Some(local) = self.users.get(user) {
            let lacking = || local.facts.iter().zip(&local.added).filter(|(f, _)| !staged.ids.contains(&f.unit.id));
            report.dropped = lacking().filter(|(_, added)| **added <= staged.since).count();
            let extra: Vec<Vec<u8>> =
                lacking().filter(|(_, added)| **added > staged.since).map(|(f, _)| Record::encode_put(f)).collect();
            if !extra.is_empty() {
                let (mut log, _) = RecordLog::open(&staged.dir.join("facts.log"))?;
                log.append(&extra.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
                report.kept = extra.len();
                report.facts += extra.len();
            }
        }
        let users_dir = self.dir.join("users");
        let live = users_dir.join(user_dir_name(user));
        let trash_dir = self.dir.join("trash");
        let trash = trash_dir.join(user_dir_name(user));
        std::fs::create_dir_all(&trash_dir).map_err(io(&trash_dir))?;
        if trash.exists() {
            std::fs::remove_dir_all(&trash).map_err(io(&trash))?;
        }
        // Close the old copy's files before its directory moves.
        drop(self.take_user(user));
        if live.exists() {
            std::fs::rename(&live, &trash).map_err(io(&live))?;
        }
        std::fs::rename(&staged.dir, &live).map_err(io(&staged.dir))?;
        staged.committed = true;
        sync_dir(&users_dir)?;
        let mut warnings = Vec::new();
        match UserShard::open(&live, &self.header, &mut warnings) {
            Ok(shard) => {
                warnings.iter().for_each(|w| tracing::warn!(user, "{w}"));
                if self.damaged.remove(user).is_some() {
                    tracing::warn!(user, "a damaged memory was replaced by a copy from another worker");
                }
                self.users.insert(user.to_string(), shard);
                self.pending.insert(user.to_string());
                if trash.exists() {
                    std::fs::remove_dir_all(&trash).map_err(io(&trash))?;
                }
                Ok(report)
            }
            Err(e) => {
                // Put the previous copy back and reload it.
                std::fs::remove_dir_all(&live).map_err(io(&live))?;
                if trash.exists() {
                    std::fs::rename(&trash, &live).map_err(io(&trash))?;
                    sync_dir(&users_dir)?;
                    let shard = UserShard::open(&live, &self.header, &mut warnings)?;
                    self.users.insert(user.to_string(), shard);
                }
                Err(e)
            }
        }
    }
}

/// A shard being received: records land in a staging directory as they
/// arrive, each checked (it decodes, its KV is for its fact and made the
/// way this memory makes KV) before it is written.
pub struct Staging {
    dir: PathBuf,
    header: KvHeader,
    /// The source's KV is in a refused layout: records are staged without it.
    drop_kv: bool,
    facts: RecordLog,
    kv: RecordLog,
    ids: HashSet<String>,
    since: u64,
    with_kv: usize,
    bytes: u64,
    done: bool,
}

/// A staged shard, ready for [`Memory::commit_import`]; removed from disk
/// if dropped uncommitted.
pub struct StagedShard {
    dir: PathBuf,
    ids: HashSet<String>,
    since: u64,
    with_kv: usize,
    bytes: u64,
    committed: bool,
}

static STAGING_SEQ: AtomicU64 = AtomicU64::new(0);

impl Staging {
    /// Starts staging a shard of `user` in `memory_dir`, whose KV is made
    /// as `ours`. `theirs` is the source's segment header: KV made any
    /// other way (another model, prompt, window or shape) is refused before
    /// a byte is staged; KV in another storage format is staged as it is
    /// (a memory reads every format). `since` is the
    /// [`crate::write_seq`] when the copy began (before the source took
    /// its snapshot, as near as the caller can tell): units added after it
    /// survive the commit.
    pub fn create(memory_dir: &Path, user: &str, ours: &KvHeader, theirs: &KvHeader, since: u64) -> Result<Staging> {
        let n = STAGING_SEQ.fetch_add(1, Ordering::Relaxed);
        let dir = memory_dir.join("staging").join(format!("{}-{}-{n}", user_dir_name(user), std::process::id()));
        if !theirs.same_kv(ours) {
            let (found, expected) = (theirs.describe(), ours.describe());
            return Err(MemoryError::KvMismatch { path: dir, found, expected, hint: "" });
        }
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        let (facts, _) = RecordLog::open(&dir.join("facts.log"))?;
        let (mut kv, _) = RecordLog::open(&dir.join("kv.log"))?;
        // KV in a layout this build refuses (`KvHeader::stale`) is not
        // staged: the facts come without it and are encoded here.
        let stale = theirs.stale();
        if let Some(why) = &stale {
            tracing::warn!(user, "staging a shard without its KV ({why}): its facts are re-encoded here");
        }
        let header = if stale.is_some() { ours.clone() } else { theirs.clone() };
        kv.append(&[&header.encode()])?;
        Ok(Staging {
            drop_kv: stale.is_some(),
            dir,
            header,
            facts,
            kv,
            ids: HashSet::new(),
            since,
            with_kv: 0,
            bytes: 0,
            done: false,
        })
    }

    /// Checks and appends `records` (durably).
    pub fn append(&mut self, records: &[ShardRecord]) -> Result<()> {
        let path = self.dir.clone();
        let mut kv = Vec::new();
        for r in records {
            let fact: Fact = match Record::decode(&r.fact, &path)? {
                Record::Put(f) => *f,
                Record::Forget(_) => {
                    return Err(MemoryError::Invalid { what: "shard record", reason: "a tombstone in a shard".into() });
                }
            };
            if !self.ids.insert(fact.unit.id.clone()) {
                return Err(MemoryError::Invalid {
                    what: "shard record",
                    reason: format!("fact {:?} sent twice", fact.unit.id),
                });
            }
            if !r.kv.is_empty() && !self.drop_kv {
                let (fact_id, tokens) = StoredKv::check(&r.kv, &self.header, &path)?;
                if fact_id != fact.unit.id || tokens != fact.tokens {
                    return Err(MemoryError::Invalid {
                        what: "shard record",
                        reason: format!("the KV sent with fact {:?} is not that fact's", fact.unit.id),
                    });
                }
                kv.push(r.kv.as_slice());
                self.with_kv += 1;
            }
            self.bytes += r.len() as u64;
        }
        self.facts.append(&records.iter().map(|r| r.fact.as_slice()).collect::<Vec<_>>())?;
        self.kv.append(&kv)?;
        Ok(())
    }

    /// Facts staged so far.
    pub fn facts(&self) -> usize {
        self.ids.len()
    }

    pub fn finish(mut self) -> Result<StagedShard> {
        sync_dir(&self.dir)?;
        self.done = true;
        Ok(StagedShard {
            dir: self.dir.clone(),
            ids: std::mem::take(&mut self.ids),
            since: self.since,
            with_kv: self.with_kv,
            bytes: self.bytes,
            committed: false,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Drop for StagedShard {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
