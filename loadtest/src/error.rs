//! The one error type of the load-test library.
//!
//! Failed *requests* are not errors here: the runner counts them by status
//! in the report, because a load test must keep going past a 429 or a 503.
//! These are the failures that stop a run (bad arguments, an unreachable
//! server before the first request, unreadable inputs, unwritable outputs).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target URL cannot be used (not `http://host:port[/v1]`).
    #[error("invalid URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    /// The request could not be sent or its answer not read.
    #[error("{what}: {reason}")]
    Http { what: String, reason: String },
    /// The server answered a setup call (models, ingest) with an error.
    #[error("{what}: HTTP {status}: {body}")]
    Status { what: String, status: u16, body: String },
    /// A LoCoMo file that cannot be read, or a chart that cannot be drawn.
    /// Its message already names the file and the cause, so it is not
    /// chained as a source (which would print the cause twice).
    #[error("{0}")]
    Eval(#[from] inferscale_eval::EvalError),
    /// Arguments that describe no run (no users, no modes, k = 0, …).
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
