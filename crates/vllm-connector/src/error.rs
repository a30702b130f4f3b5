//! The connector core's one error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConnectorError {
    /// A cache tensor whose shape, strides or size fit no known layout.
    #[error("kv cache layout: {0}")]
    Layout(String),
    /// A plan (or a request's params) that cannot be loaded.
    #[error("memory plan: {0}")]
    Plan(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    #[error(transparent)]
    Engine(#[from] inferscale_engine::EngineError),
    #[error(transparent)]
    Memory(#[from] inferscale_memory::MemoryError),
    #[error(transparent)]
    Model(#[from] inferscale_model::ModelError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, ConnectorError>;
