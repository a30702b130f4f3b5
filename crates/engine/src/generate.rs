//! Generation loops over the engine: sampling, stop conditions, timings.
//!
//! Several requests run as one batch: every step computes the pending tokens
//! of all live sequences together (prefill chunks and single decode tokens
//! alike), so requests of different lengths share each forward pass.

use std::time::{Duration, Instant};

use inferscale_model::Tokenizer;

use crate::backend::Backend;
use crate::engine::{Engine, NextToken, Sequence};
use crate::error::{EngineError, Result};
use crate::sampling::{History, Rng, SamplingParams, sample};

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was sampled.
    Eos,
    /// A stop string appeared in the text.
    Stop,
    /// `max_tokens` or the model's context was reached.
    Length,
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (the EOS token, if sampled, is not included).
    pub tokens: Vec<u32>,
    /// Decoded text, cut before any stop string; empty without a tokenizer.
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// From the start of the call to the first sampled token.
    pub time_to_first_token: Duration,
    /// From the first sampled token to the last.
    pub decode_time: Duration,
}

struct Live {
    seq: Sequence,
    params: SamplingParams,
    rng: Rng,
    generated: Vec<u32>,
    first_token_at: Option<Instant>,
    done: Option<(FinishReason, String)>,
}

/// Generates for every request, batching them; results in request order.
/// `eos` ends a sequence unless `ignore_eos`; stop strings need `tokenizer`.
pub fn generate_batch<B: Backend>(
    engine: &mut Engine<B>,
    tokenizer: Option<&Tokenizer>,
    eos: &[u32],
    requests: Vec<GenerateRequest>,
) -> Result<Vec<Generation>> {
    let start = Instant::now();
    let seqs =
        requests.into_iter().map(|r| Ok((engine.new_sequence(r.prompt)?, r.params))).collect::<Result<Vec<_>>>()?;
    generate_sequences(engine, tokenizer, eos, seqs, start)
}

/// Generates from prepared sequences (e.g. a forked header with injected
/// memory and a pending question). Each must have pending tokens; time to
/// first token counts from `start`.
pub fn generate_sequences<B: Backend>(
    engine: &mut Engine<B>,
    tokenizer: Option<&Tokenizer>,
    eos: &[u32],
    seqs: Vec<(Sequence, SamplingParams)>,
    start: Instant,
) -> Result<Vec<Generation>> {
    let limit = engine.model().config().max_position_embeddings;
    let mut live = Vec::with_capacity(seqs.len());
    for (seq, params) in seqs {
        params.validate()?;
        if !params.stop.is_empty() && tokenizer.is_none() {
            return Err(EngineError::InvalidSampling { name: "stop", reason: "stop strings need a tokenizer".into() });
        }
        if seq.pending() == 0 {
            return Err(EngineError::Shape("generation needs a sequence with pending tokens".into()));
        }
        let full = seq.next_position() as usize >= limit;
        let done = (params.max_tokens == 0 || full).then(|| (FinishReason::Length, String::new()));
        live.push(Live { seq, rng: Rng::new(params.seed), params, generated: Vec::new(), first_token_at: None, done });
    }

    loop {
        let mut active: Vec<&mut Live> = live.iter_mut().filter(|l| l.done.is_none()).collect();
        if active.is_empty() {
            break;
        }
        // As the serving scheduler steps: pending tokens in order up to the
        // batch budget, and greedy sequences' next tokens reduced on the
        // device (only their ids cross to the host).
        let mut budget = engine.max_batch_tokens();
        let mut take = Vec::with_capacity(active.len());
        for l in &active {
            let t = l.seq.pending().min(budget);
            budget -= t;
            take.push(t);
        }
        let greedy: Vec<bool> = active.iter().map(|l| !l.params.needs_logits()).collect();
        let mut seqs: Vec<&mut Sequence> = active.iter_mut().map(|l| &mut l.seq).collect();
        let next = engine.step_scheduled(&mut seqs, &take, &greedy)?;
        for (l, next) in active.into_iter().zip(next) {
            let tok = match next {
                None => continue,
                Some(NextToken::Greedy(id)) => id,
                Some(NextToken::Logits(logits)) => {
                    let prompt = &l.seq.tokens()[..l.seq.len() - l.generated.len()];
                    sample(&logits, &l.params, &mut l.rng, History { prompt, output: &l.generated })
                }
            };
            l.first_token_at.get_or_insert_with(Instant::now);
            if !l.params.ignore_eos && eos.contains(&tok) {
                l.done = Some((FinishReason::Eos, String::new()));
                continue;
            }
            l.generated.push(tok);
            l.seq.push(tok);
            if let Some(text) = stop_hit(tokenizer, &l.generated, &l.params.stop)? {
                l.done = Some((FinishReason::Stop, text));
            } else if l.generated.len() >= l.params.max_tokens || l.seq.next_position() as usize >= limit {
                l.done = Some((FinishReason::Length, String::new()));
            }
        }
    }

    live.into_iter()
        .map(|l| {
            let (finish, stop_text) = l.done.unwrap_or((FinishReason::Length, String::new()));
            let text = match (finish, tokenizer) {
                (FinishReason::Stop, _) => stop_text,
                (_, Some(t)) => t.decode(&l.generated, true)?,
                (_, None) => String::new(),
            };
            let first = l.first_token_at.unwrap_or(start);
            Ok(Generation {
                prompt_tokens: l.seq.len() - l.generated.len(),
                tokens: l.generated,
                text,
                finish,
                time_to_first_token: first - start,
                decode_time: Instant::now() - first,
            })
        })
        .collect()
}

/// If the decoded text contains a stop string, the text before it.
fn stop_hit(tokenizer: Option<&Tokenizer>, generated: &[u32], stop: &[String]) -> Result<Option<String>> {
    let (Some(t), false) = (tokenizer, stop.is_empty()) else {
        return Ok(None);
    };
    let text = t.decode(generated, true)?;
    Ok(stop.iter().filter_map(|s| text.find(s.as_str())).min().map(|at| text[..at].to_string()))
}

/// Generates for one request.
pub fn generate<B: Backend>(
    engine: &mut Engine<B>,
    tokenizer: Option<&Tokenizer>,
    eos: &[u32],
    request: GenerateRequest,
) -> Result<Generation> {
    generate_batch(engine, tokenizer, eos, vec![request])?
        .pop()
        .ok_or_else(|| EngineError::Shape("generate_batch returned no result".into()))
}
