//! The one error type of the evaluation crate. Each message names the file
//! (and, in data files, the line or sample and the field) it is about.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file that is not in the LoCoMo layout.
    #[error("{path}: not a LoCoMo file: {reason}")]
    Locomo { path: PathBuf, reason: String },

    /// A facts file (JSON lines) with a bad line.
    #[error("invalid facts file: {path}:{line}: {reason}")]
    Facts { path: PathBuf, line: usize, reason: String },

    /// A chart could not be drawn (no font, or the PNG not written).
    #[error("chart {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
}

pub type Result<T> = std::result::Result<T, EvalError>;

pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> EvalError + '_ {
    move |source| EvalError::Io { path: path.to_path_buf(), source }
}
