//! A generate request as the worker's engine sees it, and what it streams
//! back: tokens with their log-probabilities, then the finish with usage
//! and timings.

use std::time::{Duration, Instant};

use inferscale_engine::FinishReason;
use inferscale_engine::sampling::SamplingParams;
use inferscale_memory::{Chat, Mode, Recall, Scope};
use inferscale_types::{FactSources, Generation, Sampling};
use tokio::sync::mpsc;
use tracing::Span;

use crate::error::WorkerError;

/// A chat request as a worker's engine sees it.
#[derive(Debug, Clone)]
pub struct GenerateJob {
    /// What the caller asked for ([`Protocol`] admits it by
    /// [`inferscale_types::admit`], the rules the router applied too).
    pub request: Generation,
    /// The layout's view of its input: system prompt, earlier turns and
    /// the question.
    pub chat: Chat,
    /// The sampler's view of its sampling parameters.
    pub params: SamplingParams,
    pub deadline: Option<Duration>,
    pub arrived: Instant,
    /// The request's trace span; its phases are children of it.
    pub span: Span,
}

impl GenerateJob {
    pub fn new(request: Generation, deadline: Option<Duration>, arrived: Instant, span: Span) -> GenerateJob {
        let chat = Chat::of(&request.input, request.memory.instruction.clone());
        let params = sampling_params(&request.sampling);
        GenerateJob { request, chat, params, deadline, arrived, span }
    }

    /// The user whose memory is used (empty for none).
    pub fn user(&self) -> &str {
        &self.request.user
    }

    pub fn mode(&self) -> Mode {
        self.request.memory.mode
    }

    /// Facts to retrieve.
    pub fn k(&self) -> usize {
        self.request.memory.k as usize
    }

    pub fn scope(&self) -> &Scope {
        &self.request.memory.scope
    }

    pub fn recall(&self) -> Recall {
        self.request.memory.recall()
    }
}

/// The sampler's parameters for a request's.
pub fn sampling_params(s: &Sampling) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logprobs: s.logprobs.map(|n| n as usize),
        seed: s.seed,
        max_tokens: s.max_tokens as usize,
        stop: s.stop.clone(),
        ignore_eos: s.ignore_eos,
    }
}

/// Where a request's time went, in milliseconds: each phase's duration,
/// and the first token and the end measured from arrival at the worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    pub queue_ms: f64,
    pub retrieve_ms: f64,
    /// Composing the request and queuing its injection on the host; the
    /// device's part overlaps the prefill and is counted in `prefill_ms`.
    pub inject_ms: f64,
    pub prefill_ms: f64,
    pub first_token_ms: f64,
    pub total_ms: f64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub injected_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub facts: usize,
    /// Of the injected tokens, those recomputed through every layer (blend).
    pub recomputed_tokens: usize,
    /// kv and blend: where the facts' KV came from (`None` where the
    /// engine does not say, and in prompt and none mode).
    pub sources: Option<FactSources>,
}

#[derive(Debug, Clone)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
    pub fact_ids: Vec<String>,
}

/// One token's log-probability, the token as its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub token: Vec<u8>,
    pub logprob: f32,
}

/// What a request that asked for log-probabilities gets with each token:
/// the chosen token's, and the most likely alternatives' (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

/// What a generate request's stream carries.
#[derive(Debug)]
pub enum Event {
    /// A token, the text it completes (possibly none yet: a character's
    /// first byte, a stop string's possible start), and its
    /// log-probabilities when asked for.
    Token {
        id: u32,
        text: String,
        logprobs: Option<Box<Logprobs>>,
    },
    Finished(Box<Finished>),
    Failed(WorkerError),
}

/// Where a generate request's events go; closed when its caller left.
pub type Events = mpsc::UnboundedSender<Event>;

/// A finish reason as OpenAI's API names it (end of sequence is `stop`).
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}
