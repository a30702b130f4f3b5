//! The OpenAI chat-completions schema (the subset we serve), our `memory`
//! extension, the memory-ingestion bodies, and their validation.
//!
//! Unknown fields are ignored, as OpenAI-compatible servers do, so clients
//! that send more than we use keep working; known fields of the wrong type
//! are refused with the field's path in the message.

use inferscale_types::{MemoryUnit, Mode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, Result};

/// Parses a JSON body, naming the offending field on error.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::BadRequest("request body is not valid UTF-8".into()));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::BadRequest(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::BadRequest(format!("invalid JSON body: field `{path}`: {inner}"))
        }
    })
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    /// Keep generating past end-of-sequence tokens (as vLLM's extension;
    /// benchmarks and tests that need exactly `max_tokens`).
    pub ignore_eos: Option<bool>,
    pub memory: Option<MemoryOptions>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// A message's content: a string, or text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl Content {
    pub fn text(&self) -> Result<String> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(ApiError::BadRequest(format!("content part of type {kind:?} is not supported"))),
                })
                .collect::<Result<Vec<_>>>()
                .map(|t| t.concat()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// The `memory` extension of a chat request.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MemoryOptions {
    pub mode: Option<Mode>,
    pub k: Option<u64>,
    pub window: Option<u32>,
    /// `mode = "blend"`: the share of injected tokens recomputed (0..=1).
    pub blend_ratio: Option<f32>,
}

/// `POST /v1/memories`.
#[derive(Debug, Deserialize)]
pub struct IngestBody {
    pub user: String,
    pub window: Option<u32>,
    #[serde(default)]
    pub turns: Vec<MemoryUnit>,
    /// Facts extracted from turns (`source_turn` names the turn).
    #[serde(default)]
    pub facts: Vec<MemoryUnit>,
}

/// Longest user id, in bytes.
pub const MAX_USER_BYTES: usize = 256;

/// A user id is 1–256 bytes of printable text.
pub fn check_user(user: &str) -> Result<()> {
    if user.is_empty() {
        return Err(ApiError::BadRequest("`user` is empty".into()));
    }
    if user.len() > MAX_USER_BYTES {
        return Err(ApiError::BadRequest(format!("`user` is longer than {MAX_USER_BYTES} bytes")));
    }
    if user.chars().any(char::is_control) {
        return Err(ApiError::BadRequest("`user` contains control characters".into()));
    }
    Ok(())
}

/// Chat response, non-streaming.
#[derive(Debug, Serialize)]
pub struct ChatResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    pub usage: Usage,
    /// Where the time went on the worker (milliseconds from arrival there).
    pub timings: serde_json::Value,
}

#[derive(Debug, Serialize)]
pub struct Choice {
    pub index: u32,
    pub message: AssistantMessage,
    pub finish_reason: String,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

/// OpenAI usage, plus what the memory contributed.
#[derive(Debug, Serialize, Clone)]
pub struct Usage {
    /// Every token the model attended to before answering: header, memory, question.
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptDetails,
    pub memory: MemoryUsage,
}

#[derive(Debug, Serialize, Clone)]
pub struct PromptDetails {
    /// Tokens whose KV came from cache: the cached header and injected memory.
    pub cached_tokens: u32,
}

#[derive(Debug, Serialize, Clone)]
pub struct MemoryUsage {
    pub mode: Mode,
    /// Facts placed in the prompt (0 when the user has no memory).
    pub facts: u32,
    /// Memory tokens injected as KV rather than prefilled.
    pub injected_tokens: u32,
    /// `blend`: of the injected tokens, those recomputed through every layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recomputed_tokens: Option<u32>,
    pub fact_ids: Vec<String>,
}
