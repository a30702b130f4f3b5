//! `memory.json`: what a memory directory was made with — the context
//! window its KV is encoded for and the model that encoded it — written
//! when a memory is first opened, so that later commands on the same
//! directory need not be told again and a contradicting flag is refused
//! before a model is loaded (seconds to minutes) rather than after.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{MemoryError, Result, io};

/// The file's name inside a memory directory.
pub const MANIFEST: &str = "memory.json";

/// What a memory directory was made with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Units encoded before each fact: every segment's KV is made for it.
    pub window: usize,
    /// The model as it was named when the memory was made: a packaged
    /// name, a file or directory (absolute), or `shape:<name>` for random
    /// weights of a named shape.
    pub model: String,
}

/// The file as written: the manifest and a checksum of it, so that a
/// flipped bit that leaves valid JSON (a window of 20 read as 24) is found
/// rather than believed.
#[derive(Serialize, Deserialize)]
struct Stored {
    #[serde(flatten)]
    manifest: Manifest,
    /// CRC-32 of the manifest's compact JSON (absent in files written
    /// before it was added; those are taken as they are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32: Option<u32>,
}

impl Manifest {
    /// The manifest of `dir`, if it has one. A file that does not parse,
    /// or whose checksum does not match, is an error naming it (never
    /// guessed around).
    pub fn read(dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        let damaged = |reason: String| MemoryError::Damaged {
            path: path.clone(),
            offset: 0,
            reason: format!(
                "{reason}; it records the window and model the memory was made with: restore it, or remove it \
                 and give --window and --model"
            ),
        };
        let stored: Stored = serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
        match stored.crc32 {
            Some(crc) if crc != stored.manifest.checksum() => Err(damaged("its checksum does not match".into())),
            _ => Ok(Some(stored.manifest)),
        }
    }

    /// Writes the manifest into `dir` whole (temporary file, sync, rename).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let stored = Stored { manifest: self.clone(), crc32: Some(self.checksum()) };
        let mut text = serde_json::to_string_pretty(&stored)
            .map_err(|e| MemoryError::Invalid { what: "memory manifest", reason: e.to_string() })?;
        text.push('\n');
        crate::log::replace(&dir.join(MANIFEST), text.as_bytes())?;
        crate::log::sync_dir(dir)
    }

    fn checksum(&self) -> u32 {
        crc32fast::hash(&serde_json::to_vec(self).unwrap_or_default())
    }
}

/// The context window a memory made before `memory.json` existed was
/// encoded for, read from the header of its first user's KV segment
/// (`None`: no user has KV yet).
pub fn recorded_window(dir: &Path) -> Result<Option<usize>> {
    let users = dir.join("users");
    let entries = match std::fs::read_dir(&users) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&users)(e)),
    };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path().join("kv.log"))).collect();
    paths.sort();
    for path in paths {
        if let Some(first) = crate::log::read_first(&path)?
            && let Ok(header) = crate::kvseg::KvHeader::decode(&first, &path)
        {
            return Ok(Some(header.window));
        }
    }
    Ok(None)
}

/// Fails with [`MemoryError::Locked`] when another process holds `dir`'s
/// LOCK (a server, an ingest): a cheap check to run before loading a model,
/// so that the refusal comes at once. Opening the memory takes the lock
/// for itself and is what actually excludes a second writer.
pub fn check_unlocked(dir: &Path) -> Result<()> {
    let path = dir.join("LOCK");
    let file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(&path)(e)),
    };
    match file.try_lock() {
        Ok(()) => Ok(()), // released when `file` drops
        Err(std::fs::TryLockError::WouldBlock) => Err(MemoryError::Locked { path: dir.to_path_buf() }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(&path)(e)),
    }
}

/// The file of an ingest under way, in its user's directory.
pub(crate) const PENDING: &str = "ingest.pending";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_round_trips_and_a_damaged_one_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Manifest::read(dir.path()).unwrap(), None);
        let m = Manifest { window: 0, model: "smollm2".into() };
        m.write(dir.path()).unwrap();
        assert_eq!(Manifest::read(dir.path()).unwrap(), Some(m));
        std::fs::write(dir.path().join(MANIFEST), "{\"window\": \"x\"").unwrap();
        let e = Manifest::read(dir.path()).unwrap_err().to_string();
        assert!(e.contains(MANIFEST), "{e}");
    }

    #[test]
    fn a_flipped_bit_that_leaves_valid_json_is_found() {
        let dir = tempfile::tempdir().unwrap();
        Manifest { window: 20, model: "smollm2".into() }.write(dir.path()).unwrap();
        let path = dir.path().join(MANIFEST);
        let text = std::fs::read_to_string(&path).unwrap();
        // '0' (0x30) → '4' (0x34): a window of 24, still JSON.
        std::fs::write(&path, text.replacen("20", "24", 1)).unwrap();
        let e = Manifest::read(dir.path()).unwrap_err();
        assert!(matches!(e, MemoryError::Damaged { .. }) && e.to_string().contains("checksum"), "{e}");
        // A manifest written before the checksum existed reads as it is.
        std::fs::write(&path, "{\"window\": 7, \"model\": \"smollm2\"}").unwrap();
        assert_eq!(Manifest::read(dir.path()).unwrap(), Some(Manifest { window: 7, model: "smollm2".into() }));
    }

    #[test]
    fn a_held_lock_is_reported_and_a_free_one_is_left_free() {
        let dir = tempfile::tempdir().unwrap();
        check_unlocked(dir.path()).unwrap(); // no LOCK file yet
        let held = std::fs::File::create(dir.path().join("LOCK")).unwrap();
        held.try_lock().unwrap();
        assert!(matches!(check_unlocked(dir.path()), Err(MemoryError::Locked { .. })));
        drop(held);
        check_unlocked(dir.path()).unwrap();
        // The check released what it took: a holder can still lock.
        let again = std::fs::File::open(dir.path().join("LOCK")).unwrap();
        again.try_lock().unwrap();
    }
}
