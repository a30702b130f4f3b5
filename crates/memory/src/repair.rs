//! Mending a damaged user's files, offline (`inferscale memory repair`,
//! with no server holding the memory): every record that can be recovered
//! is kept — intact ones, and damaged ones [`salvage`] can correct — and
//! what cannot is reported, by byte range and, for units, by id where the
//! user's KV segment still names them. Nothing is thrown away unsaid: the
//! damaged fact log is kept beside the mended one
//! (`facts.log.damaged-<seconds since the epoch>`).
//!
//! Per file: the fact log is the user's memory (a unit whose record is lost
//! is lost, unless a replica has it); the KV segment is derived data (what
//! it loses is re-encoded from the facts); the pending record of an
//! unfinished ingest says what a rollback removes (recovered like the rest;
//! if it cannot be, the ingest's units stay — never guessed at).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{MemoryError, Result, io};
use crate::fact::Record;
use crate::kvseg::StoredKv;
use crate::log::{HEADER, RecordLog, sync_dir};
use crate::salvage::{Salvaged, Tail, classify, salvage};
use crate::shard::user_from_dir_name;

/// What repair did to one file.
#[derive(Debug, Clone)]
pub struct FileRepair {
    pub file: PathBuf,
    /// Records kept (corrected ones included).
    pub kept: usize,
    /// Byte offsets of the records recovered by correcting them.
    pub corrected: Vec<u64>,
    /// Byte ranges dropped as unrecoverable.
    pub lost: Vec<(u64, u64)>,
    /// Bytes of a torn tail dropped.
    pub torn: u64,
    /// Where the damaged file was kept.
    pub backup: Option<PathBuf>,
}

/// What repair did to one user.
#[derive(Debug, Clone)]
pub struct UserRepair {
    pub user: String,
    pub files: Vec<FileRepair>,
    /// Units whose fact record was lost that the KV segment still names.
    pub lost_units: Vec<String>,
}

impl UserRepair {
    /// Whether any record was lost (corrected ones are not).
    pub fn lost_anything(&self) -> bool {
        !self.lost_units.is_empty() || self.files.iter().any(|f| !f.lost.is_empty())
    }
}

/// Repairs every user of the memory at `dir` whose files are damaged (or
/// only `user`); users with nothing to mend are left alone and not
/// reported. The memory must not be open (its LOCK is checked).
pub fn repair(dir: &Path, user: Option<&str>) -> Result<Vec<UserRepair>> {
    crate::manifest::check_unlocked(dir)?;
    let users_dir = dir.join("users");
    let mut out = Vec::new();
    let entries = std::fs::read_dir(&users_dir).map_err(io(&users_dir))?;
    let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    dirs.sort();
    for d in dirs {
        let Some(name) = d.file_name().and_then(|n| n.to_str()).and_then(user_from_dir_name) else { continue };
        if user.is_some_and(|u| u != name) {
            continue;
        }
        let r = repair_user(&d, name)?;
        if !r.files.is_empty() {
            out.push(r);
        }
    }
    if let Some(u) = user
        && out.is_empty()
        && !users_dir.join(crate::shard::user_dir_name(u)).exists()
    {
        return Err(MemoryError::UnknownUser(u.to_string()));
    }
    Ok(out)
}

fn repair_user(dir: &Path, user: String) -> Result<UserRepair> {
    let mut files = Vec::new();
    let facts_path = dir.join("facts.log");
    let decodes = |r: &[u8]| Record::decode(r, &facts_path).is_ok();
    let facts = mend(&facts_path, decodes, true)?;
    // The KV segment: its records are checked when indexed (a record that
    // does not fit its header is re-encoded), so any intact frame goes.
    let kv_path = dir.join("kv.log");
    let kv = mend(&kv_path, |_| true, false)?;
    let pending_path = dir.join(crate::manifest::PENDING);
    let pending = mend(&pending_path, |r| serde_json::from_slice::<serde_json::Value>(r).is_ok(), false)?;
    // An unfinished ingest's record that could not be recovered says
    // nothing a rollback could use: it goes, and its units (if any were
    // stored) stay — reported, never guessed at.
    if pending.as_ref().is_some_and(|(_, kept)| kept.is_empty()) {
        std::fs::remove_file(&pending_path).map_err(io(&pending_path))?;
        sync_dir(dir)?;
    }
    let mut lost_units = Vec::new();
    if let Some((f, kept)) = &facts {
        // Units the segment names that no kept fact record has.
        let have: BTreeSet<String> = kept
            .iter()
            .filter_map(|r| match Record::decode(r, &facts_path) {
                Ok(Record::Put(fact)) => Some(fact.unit.id),
                _ => None,
            })
            .collect();
        if !f.lost.is_empty()
            && let Ok(records) = crate::log::read_all(&kv_path)
        {
            let named =
                records.iter().skip(1).filter_map(|r| StoredKv::head_len(r).and_then(|n| id_of(&r[..n.min(r.len())])));
            let lost: BTreeSet<String> = named.filter(|id| !have.contains(id)).collect();
            lost_units = lost.into_iter().collect();
        }
    }
    files.extend([facts, kv, pending].into_iter().flatten().map(|(f, _)| f));
    Ok(UserRepair { user, files, lost_units })
}

/// The fact id at the start of a KV record's head.
fn id_of(head: &[u8]) -> Option<String> {
    let n = u32::from_le_bytes(head.get(..4)?.try_into().ok()?) as usize;
    String::from_utf8(head.get(4..4 + n)?.to_vec()).ok()
}

/// Rewrites the log at `path` with what [`salvage`] recovers, if it is
/// damaged (a torn tail alone is left to the next open); returns what was
/// done and the records kept. `backup` keeps the damaged file beside it.
fn mend(path: &Path, plausible: impl Fn(&[u8]) -> bool, backup: bool) -> Result<Option<(FileRepair, Vec<Vec<u8>>)>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(path)(e)),
    };
    // The file's name says it is one of our logs: a damaged header is
    // mended (the version byte included: there has been one version).
    let header_damaged = bytes.len() < HEADER.len() || bytes[..HEADER.len()] != HEADER[..];
    if !header_damaged && !damaged(&bytes) {
        return Ok(None);
    }
    let bytes = match header_damaged {
        true => [&HEADER[..], bytes.get(HEADER.len()..).unwrap_or_default()].concat(),
        false => bytes,
    };
    let Salvaged { records, mut corrected, lost, torn } = salvage(&bytes, plausible);
    if header_damaged {
        corrected.insert(0, 0);
    }
    let backup = match backup {
        false => None,
        true => {
            let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let mut name = path.as_os_str().to_owned();
            name.push(format!(".damaged-{secs}"));
            let to = PathBuf::from(name);
            std::fs::copy(path, &to).map_err(io(&to))?;
            std::fs::File::open(&to).and_then(|f| f.sync_all()).map_err(io(&to))?;
            Some(to)
        }
    };
    RecordLog::write_new(path, &records.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))?;
    let report = FileRepair { file: path.to_path_buf(), kept: records.len(), corrected, lost, torn, backup };
    Ok(Some((report, records)))
}

/// Whether a log's bytes hold damage (not only a torn tail).
fn damaged(bytes: &[u8]) -> bool {
    let mut at = HEADER.len();
    while let Some(head) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        match bytes.get(at + 8..at + 8 + len) {
            Some(p) if crate::frame::checksum([head[0], head[1], head[2], head[3]], p) == crc => at += 8 + len,
            _ => break,
        }
    }
    matches!(classify(bytes, at, "a frame failed its checks"), Tail::Damaged(_))
}
