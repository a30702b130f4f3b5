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

impl Manifest {
    /// The manifest of `dir`, if it has one. A file that does not parse is
    /// an error naming it (never guessed around).
    pub fn read(dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| MemoryError::Invalid { what: "memory manifest", reason: format!("{}: {e}", path.display()) })
    }

    /// Writes the manifest into `dir` whole (temporary file, sync, rename).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let mut text = serde_json::to_string_pretty(self)
            .map_err(|e| MemoryError::Invalid { what: "memory manifest", reason: e.to_string() })?;
        text.push('\n');
        crate::log::replace(&dir.join(MANIFEST), text.as_bytes())?;
        crate::log::sync_dir(dir)
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
