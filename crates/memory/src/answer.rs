//! Building the prompt of one request in any mode (docs/design.md §3): the cached
//! header, then the retrieved facts — injected as KV (`kv`, `blend`) or as
//! text (`prompt`), least relevant first — then the question.

use inferscale_engine::{Backend, Engine, KvChunk, Sequence};

use inferscale_types::{Mode, Recall};

use crate::error::{MemoryError, Result};
use crate::shard::Memory;

/// A request ready to prefill: the sequence (question pending) and what went in.
pub struct Prepared {
    pub seq: Sequence,
    /// Ids of the facts placed in the prompt, in prompt order.
    pub fact_ids: Vec<String>,
    /// Memory tokens in the prompt (injected or pasted).
    pub memory_tokens: usize,
    /// Of those, tokens of facts pasted as text in an injecting mode
    /// (their KV was cold: see `paste` in [`prepare`]).
    pub pasted_tokens: usize,
    /// Tokens of the header the sequence starts with.
    pub header_tokens: usize,
    /// Whether the header's KV was already computed (cached) rather than
    /// prefilled for this request.
    pub header_cached: bool,
}

/// One request's facts as the layout places them.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    pub user: &'a str,
    /// Indices into the user's facts, best first.
    pub order: &'a [usize],
    /// Of those, the ones pasted as text although the mode injects (kv mode;
    /// see [`prepare`]).
    pub paste: &'a [usize],
    pub recall: Recall,
}

impl<'a> Facts<'a> {
    /// `order`, all placed as `recall` says.
    pub fn new(user: &'a str, order: &'a [usize], recall: Recall) -> Facts<'a> {
        Facts { user, order, paste: &[], recall }
    }
}

/// Forks `header` (a computed sequence of the composer's header) and lays
/// out `facts` and `question`; in [`Mode::Blend`], plans the recompute of
/// the injected tokens that the recall's blend asks for (`Engine::blend`)
/// for the question's prefill.
///
/// In [`Mode::Kv`], the facts in `facts.paste` (those whose KV was on disk
/// only when the request arrived) are pasted as text after the injected
/// ones, each group least relevant first, and prefilled with the question:
/// the request costs what prompt mode costs for them, never a wait for the
/// disk.
pub fn prepare<B: Backend>(
    engine: &mut Engine<B>,
    memory: &Memory<B>,
    header: &Sequence,
    facts: Facts<'_>,
    question: &[u32],
) -> Result<Prepared> {
    let Facts { user, order: facts, paste, recall } = facts;
    if question.is_empty() {
        return Err(MemoryError::Invalid { what: "question", reason: "empty question".into() });
    }
    let mode = recall.mode;
    if !paste.is_empty() && mode != Mode::Kv {
        return Err(MemoryError::Invalid {
            what: "layout",
            reason: format!("facts are pasted beside injected ones in kv mode only, not {}", mode.as_str()),
        });
    }
    // A user with no memory (or none retrieved) is answered without any.
    let all = if facts.is_empty() { &[][..] } else { memory.facts(user)? };
    let order: Vec<usize> = match mode {
        Mode::None => Vec::new(),
        _ => facts.iter().rev().copied().collect(),
    };
    let (inject, pasted): (Vec<usize>, Vec<usize>) = order.iter().partition(|i| !paste.contains(i));
    let mut seq = engine.fork(header)?;
    let mut memory_tokens = 0;
    let mut pasted_tokens = 0;
    match mode {
        Mode::Kv | Mode::Blend => {
            let chunks = inject
                .iter()
                .map(|&i| {
                    memory.kv(user, i)?.ok_or_else(|| MemoryError::Invalid {
                        what: "memory",
                        reason: format!("fact {:?} of {user:?} has no KV yet", all[i].unit.id),
                    })
                })
                .collect::<Result<Vec<&KvChunk<B>>>>()?;
            memory_tokens = chunks.iter().map(|c| c.len()).sum();
            let c = engine.model().config();
            let bytes = memory_tokens * 2 * c.num_layers * c.kv_dim() * engine.backend().kv_bytes_per_value();
            let span = tracing::info_span!(
                "inject",
                facts = chunks.len() as i64,
                tokens = memory_tokens as i64,
                bytes = bytes as i64
            )
            .entered();
            // The span covers queuing it: the device work overlaps the
            // prefill that follows (waiting for it here, only because a trace
            // is recorded, would make traced requests slower than others).
            engine.inject(&mut seq, &chunks)?;
            drop(span);
            for &i in &pasted {
                seq.extend(&all[i].tokens);
                pasted_tokens += all[i].tokens.len();
            }
            memory_tokens += pasted_tokens;
        }
        Mode::Prompt => {
            for &i in &order {
                seq.extend(&all[i].tokens);
                memory_tokens += all[i].tokens.len();
            }
        }
        Mode::None => {}
    }
    seq.extend(question);
    if mode == Mode::Blend {
        // Ratio 0 plans nothing: the request is served exactly as kv mode.
        engine.blend(&mut seq, memory_tokens, recall.blend)?;
    }
    Ok(Prepared {
        seq,
        fact_ids: inject.iter().chain(&pasted).map(|&i| all[i].unit.id.clone()).collect(),
        memory_tokens,
        pasted_tokens,
        header_tokens: header.len(),
        header_cached: true,
    })
}
