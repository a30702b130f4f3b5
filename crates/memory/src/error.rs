//! The one error type of the memory crate.

use std::path::PathBuf;

use inferscale_engine::EngineError;
use inferscale_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Stored data failed its checksum or framing; `offset` is where.
    #[error("{path}: corrupt at byte {offset}: {reason}")]
    Corrupt { path: PathBuf, offset: u64, reason: String },

    /// A log holds damaged bytes that are not a torn tail (intact records
    /// may follow them): refused, left as it is, for `inferscale memory
    /// repair` or a replica to mend. `offset` is where the damage starts.
    #[error("{path}: damaged at byte {offset}: {reason}")]
    Damaged { path: PathBuf, offset: u64, reason: String },

    /// An earlier ingest of the user is still being rolled back (its
    /// rollback failed and is retried): the user's writes wait for it.
    #[error("an earlier ingest of user {0:?} is still being undone on this worker; retry shortly")]
    Unsettled(String),

    /// Another process (or another `Memory` in this one) has the directory open.
    #[error("{path}: memory directory in use by another process (its LOCK file is held)")]
    Locked { path: PathBuf },

    #[error("unknown user `{0}`")]
    UnknownUser(String),

    /// The user's stored memory is damaged (see [`MemoryError::Damaged`]):
    /// nothing of it is read or written until it is repaired (`inferscale
    /// memory repair`, or a copy from a replica). Said without paths: the
    /// text may reach a client.
    #[error("the memory of user {0:?} is damaged on this worker and unavailable until it is repaired")]
    UserDamaged(String),

    #[error("user {user:?} has no fact {id:?}")]
    UnknownFact { user: String, id: String },

    /// Bad caller input (empty text, k = 0, …): nothing was stored.
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },

    /// KV made by another model, window, dtype or prompt layout: refused,
    /// never injected. `hint` says what to do when only the layout differs.
    #[error("KV segment {path}: made for {found}, this shard needs {expected}{hint}")]
    KvMismatch { path: PathBuf, found: String, expected: String, hint: &'static str },

    #[error(transparent)]
    Engine(#[from] EngineError),

    #[error(transparent)]
    Model(#[from] ModelError),
}

pub type Result<T> = std::result::Result<T, MemoryError>;

impl MemoryError {
    /// The process or the system has no file descriptor left (EMFILE,
    /// ENFILE): nothing is wrong with the files, so the user whose files
    /// could not be opened is not damaged — the open is retried on its
    /// next use. (A server raises its own limit at start.)
    pub fn out_of_files(&self) -> bool {
        // EMFILE and ENFILE on Linux and the BSDs alike.
        const EMFILE: i32 = 24;
        const ENFILE: i32 = 23;
        matches!(self, MemoryError::Io { source, .. } if matches!(source.raw_os_error(), Some(EMFILE | ENFILE)))
    }
}

pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> MemoryError + '_ {
    move |source| MemoryError::Io { path: path.to_path_buf(), source }
}
