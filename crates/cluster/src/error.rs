use std::path::PathBuf;

/// Everything the cluster layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The placement store (etcd) could not be reached or answered with an
    /// error; callers keep their cached view and retry.
    #[error("placement store unavailable: {0}")]
    Unavailable(String),
    /// A watch asked for revisions the store no longer keeps; reload.
    #[error("placement store compacted past revision {requested} (oldest kept: {compacted})")]
    Compacted { requested: i64, compacted: i64 },
    /// A stored value that is not what this build writes.
    #[error("placement key {key:?}: {reason}")]
    Decode { key: String, reason: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid cluster setting: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ClusterError>;

impl From<tonic::Status> for ClusterError {
    fn from(s: tonic::Status) -> Self {
        ClusterError::Unavailable(format!("{}: {}", s.code(), s.message()))
    }
}
