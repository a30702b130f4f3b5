//! The OpenAI schema we serve (chat and text completions, embeddings, the
//! response and usage shapes), our `memory` extension, and the
//! memory-ingestion bodies. What a request may ask is checked in
//! `validate.rs`.
//!
//! Unknown fields are ignored, as OpenAI-compatible servers do, so clients
//! that send more than we use keep working; known fields of the wrong type
//! are refused with the field's path in the message.

use inferscale_types::{FactSources, MemoryUnit, Mode};
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, Result};

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
    /// Return each token's log-probability (`top_logprobs` alternatives).
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub n: Option<u32>,
    pub memory: Option<MemoryOptions>,
}

/// The sampling parameters chat and text completions share: OpenAI's and
/// vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`).
/// Parsed from the same body as the request (a flattened struct would lose
/// a bad field's name).
#[derive(Debug, Deserialize, Default)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's: -1 (or 0) keeps every token.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// A string or a list of strings (checked in `validate.rs`).
    pub stop: Option<serde_json::Value>,
    /// Keep generating past end-of-sequence tokens (as vLLM's extension;
    /// benchmarks and tests that need exactly `max_tokens`).
    pub ignore_eos: Option<bool>,
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
    /// The legacy completions form: how many alternatives to report with
    /// each token's log-probability.
    pub logprobs: Option<u32>,
    pub n: Option<u32>,
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

impl PromptInput {
    /// The one text prompt a request may carry.
    pub fn text(self) -> Result<String> {
        let bad = |m: &str| ApiError::param("prompt", m);
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
        let bad = |m: &str| ApiError::param("input", m);
        match std::mem::replace(&mut self.input, PromptInput::Many(Vec::new())) {
            PromptInput::One(t) => Ok(vec![t]),
            PromptInput::Many(v) => Ok(v),
            PromptInput::Tokens(_) => Err(bad("must be a string or a list of strings (token ids are not supported)")),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    /// A string or a list of text parts; null on an assistant message that
    /// made tool calls (what SDKs send back). Checked in `validate.rs`.
    #[serde(default)]
    pub content: serde_json::Value,
    /// The participant's name (a speaker, when messages become memories).
    pub name: Option<String>,
}

impl Message {
    /// A user message of `text`.
    pub fn user(text: String) -> Message {
        Message { role: "user".into(), content: serde_json::Value::String(text), name: None }
    }
}

/// The `memory` extension of a chat request.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MemoryOptions {
    pub mode: Option<Mode>,
    pub k: Option<u64>,
    pub window: Option<u32>,
    /// `mode = "blend"`: the share of injected tokens recomputed (0..=1),
    /// how they are chosen (`deviation`, `question`, `fact_starts`), and
    /// the share of them spent on the best facts' last tokens.
    pub blend_ratio: Option<f32>,
    pub blend_select: Option<String>,
    pub blend_focus: Option<f32>,
    /// The words before the question in a memory mode (the server's
    /// configured instruction when absent; `""` for none).
    pub instruction: Option<String>,
    /// Retrieve only the units of this agent / run (Mem0's scoping).
    pub agent_id: Option<String>,
    pub run_id: Option<String>,
}

/// `POST /v1/memories`.
#[derive(Debug, Deserialize)]
pub struct IngestBody {
    #[serde(alias = "user_id")]
    pub user: String,
    /// Mem0's `infer`: facts extracted by an LLM are not made here, so only
    /// `false` (store as given) is taken; `true` is refused, not ignored.
    pub infer: Option<bool>,
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
    /// `{"content": [...]}` when asked for (`logprobs: true`), else null.
    pub logprobs: serde_json::Value,
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
