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

/// `POST /v1/completions`: a raw prompt (no chat template), with memory
/// through the same `memory` extension as chat.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptInput,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    pub ignore_eos: Option<bool>,
    pub memory: Option<MemoryOptions>,
}

/// OpenAI's default `max_tokens` of a completion.
pub const COMPLETION_MAX_TOKENS: u32 = 16;

/// A completion's `prompt` or an embeddings `input`: a string, a list of
/// them, or anything else OpenAI allows there (token ids), which we refuse.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    One(String),
    Many(Vec<String>),
    /// Token ids (or lists of them): refused with a message that says so.
    Tokens(serde::de::IgnoredAny),
}

impl CompletionRequest {
    /// The prompt, and a chat request carrying the other parameters and no
    /// messages, so that both endpoints validate alike.
    pub fn split(self) -> Result<(String, ChatRequest)> {
        let prompt = self.prompt.text()?;
        let chat = ChatRequest {
            model: self.model,
            messages: Vec::new(),
            stream: self.stream,
            stream_options: self.stream_options,
            user: self.user,
            max_tokens: Some(self.max_tokens.unwrap_or(COMPLETION_MAX_TOKENS)),
            max_completion_tokens: None,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop,
            n: self.n,
            ignore_eos: self.ignore_eos,
            memory: self.memory,
        };
        Ok((prompt, chat))
    }
}

impl PromptInput {
    /// The one text prompt a request may carry.
    pub fn text(self) -> Result<String> {
        let bad = |m: &str| ApiError::Param { param: "prompt", message: m.to_string() };
        match self {
            PromptInput::One(p) => Ok(p),
            PromptInput::Many(mut v) if v.len() == 1 => Ok(v.remove(0)),
            PromptInput::Many(_) => Err(bad("one prompt per request is supported (send a string)")),
            PromptInput::Tokens(_) => Err(bad("must be a string (token ids are not supported)")),
        }
    }
}

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
pub struct EmbeddingsRequest {
    pub model: String,
    pub input: PromptInput,
    pub encoding_format: Option<String>,
    pub dimensions: Option<u32>,
    pub user: Option<String>,
}

impl EmbeddingsRequest {
    /// The texts to embed.
    pub fn texts(&mut self) -> Result<Vec<String>> {
        let bad = |m: &str| ApiError::Param { param: "input", message: m.to_string() };
        match std::mem::replace(&mut self.input, PromptInput::Many(Vec::new())) {
            PromptInput::One(t) => Ok(vec![t]),
            PromptInput::Many(v) => Ok(v),
            PromptInput::Tokens(_) => Err(bad("must be a string or a list of strings (token ids are not supported)")),
        }
    }
}

/// Standard base64 with padding: `encoding_format: "base64"` (what the
/// official client asks for by default) carries each embedding as its
/// little-endian f32 bytes.
pub fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            match i <= chunk.len() {
                true => out.push(ABC[((n >> (18 - 6 * i)) & 63) as usize] as char),
                false => out.push('='),
            }
        }
    }
    out
}

/// OpenAI chat parameters we do not implement. Unknown fields outside this
/// list are ignored (clients send vendor extensions).
const UNSUPPORTED: &[&str] = &[
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "best_of",
    "echo",
    "suffix",
];

/// Refuses the first of [`UNSUPPORTED`] that a (parsed, so valid JSON)
/// body sets to anything but its neutral value (null, false, 0, an empty
/// list or object, `"auto"` or `"none"` tool choice, `{"type": "text"}`
/// response format): a client that asks for what we do not do is told so,
/// naming the parameter, rather than answered as if it had not asked.
pub fn check_unsupported(body: &[u8]) -> Result<()> {
    use serde_json::Value;
    let Ok(other) = serde_json::from_slice::<serde_json::Map<String, Value>>(body) else { return Ok(()) };
    for &name in UNSUPPORTED {
        let Some(v) = other.get(name) else { continue };
        let neutral = match v {
            Value::Null | Value::Bool(false) => true,
            Value::Number(n) => n.as_f64() == Some(0.0) || (name == "best_of" && n.as_f64() == Some(1.0)),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty() || (name == "response_format" && o.get("type") == Some(&"text".into())),
            Value::String(s) => matches!((name, s.as_str()), ("tool_choice" | "function_call", "none" | "auto")),
            Value::Bool(true) => false,
        };
        if !neutral {
            return Err(ApiError::Unsupported(name.to_string()));
        }
    }
    Ok(())
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
    /// The participant's name (a speaker, when messages become memories).
    pub name: Option<String>,
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
    /// Retrieve only the units of this agent / run (Mem0's scoping).
    pub agent_id: Option<String>,
    pub run_id: Option<String>,
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
    /// A chat (OpenAI messages), stored as turns (Mem0's `add(messages)`).
    #[serde(default)]
    pub messages: Vec<Message>,
    /// Metadata for every unit of the request that has none of its own.
    #[serde(default)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Mem0's scoping: the agent and/or run every unit of the request
    /// belongs to (a unit's own `agent_id`/`run_id` wins).
    pub agent_id: Option<String>,
    pub run_id: Option<String>,
    /// Answer 202 with a job id at once and ingest in the background
    /// (`GET`/`DELETE /v1/memories/jobs/{id}`), under the job deadline.
    #[serde(default, rename = "async")]
    pub run_async: bool,
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
    /// `kv` and `blend` on the native engine: where the facts' KV came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sources: Option<FactSources>,
}

/// Where the KV of a request's facts came from, in facts: cached on the
/// GPU (`device`) or in pinned host memory (`host`), read from disk while
/// the request waited (`disk`), or on disk only and so prefilled as text
/// with the question (`prefilled`).
#[derive(Debug, Serialize, Clone, Copy, PartialEq, Eq)]
pub struct FactSources {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    pub prefilled: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: &str) -> Option<String> {
        match check_unsupported(body.as_bytes()) {
            Ok(()) => None,
            Err(ApiError::Unsupported(p)) => Some(p),
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    #[test]
    fn parameters_we_do_not_implement_are_refused_by_name_unless_neutral() {
        assert_eq!(refused(r#"{"logprobs": true}"#).as_deref(), Some("logprobs"));
        assert_eq!(refused(r#"{"tools": [{"type": "function"}]}"#).as_deref(), Some("tools"));
        assert_eq!(refused(r#"{"presence_penalty": 0.5}"#).as_deref(), Some("presence_penalty"));
        assert_eq!(refused(r#"{"response_format": {"type": "json_object"}}"#).as_deref(), Some("response_format"));
        assert_eq!(refused(r#"{"tool_choice": "required"}"#).as_deref(), Some("tool_choice"));
        // What a client sends when it does not ask for the feature.
        assert_eq!(refused(r#"{"logprobs": false, "tools": [], "presence_penalty": 0, "tool_choice": "none"}"#), None);
        assert_eq!(refused(r#"{"response_format": {"type": "text"}, "logit_bias": {}, "top_logprobs": null}"#), None);
        // Unknown fields are vendor extensions: ignored.
        assert_eq!(refused(r#"{"my_extension": true}"#), None);
    }

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"M"), "TQ==");
        assert_eq!(base64(b"Ma"), "TWE=");
        assert_eq!(base64(b"Man"), "TWFu");
        assert_eq!(base64(&[0xfb, 0xff, 0xbf]), "+/+/");
        assert_eq!(base64(&1.0f32.to_le_bytes()), "AACAPw==");
    }
}
