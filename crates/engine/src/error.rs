//! The one error type of the engine crate.

use inferscale_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),

    #[error("prompt is empty")]
    EmptyPrompt,

    /// The request needs more positions than the model supports.
    #[error("{tokens} tokens exceed the model's context of {limit} tokens")]
    ContextTooLong { tokens: usize, limit: usize },

    /// The KV block pool cannot hold the request.
    #[error("KV cache full: need {needed} more blocks, {free} free of {total}")]
    OutOfBlocks { needed: usize, free: usize, total: usize },

    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },

    #[error("invalid sampling parameter `{name}`: {reason}")]
    InvalidSampling { name: &'static str, reason: String },

    /// A shape or argument mismatch inside the engine: a bug, reported rather than panicking.
    #[error("internal shape error: {0}")]
    Shape(String),

    #[error("backend `{backend}`: {reason}")]
    Backend { backend: &'static str, reason: String },
}

pub type Result<T> = std::result::Result<T, EngineError>;
