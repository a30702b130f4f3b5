//! The real-model gate of the stored KV formats: does KV written in a
//! segment format and read back answer as the KV the engine computed?
//!
//! A lossy format can look harmless on random weights and on one model
//! (SmolLM2's fp8 KL was 8e-4) and wreck another (Qwen2.5's offset key
//! channels took fp8 answers to a KL of 6.9 in the first fp8 layout): only
//! a real model shows it. For each prompt, its first tokens are encoded as
//! facts — each with every token before it as context, so that the
//! reference is exactly the prompt's own KV (E2) and what the gate measures
//! is the storage alone — and the rest is asked. The reference injects the
//! KV as computed; each format injects the same KV written as a segment
//! record in that format and read back the way a read from disk places it
//! (fp8 through the backend's fp8 upload where it keeps fp8 as stored, so
//! the device's dequantization is what is checked). Compared: the
//! first-token distribution (KL from the reference's) and greedy decoding,
//! teacher-forced on the reference's tokens.

use inferscale_engine::sampling::{argmax, log_softmax, top2_margin};
use inferscale_engine::{Backend, Engine, KvChunk};

use crate::error::{MemoryError, Result};
use crate::kvseg::{KvFormat, KvHeader, StoredKv};

/// Tokens of memory per fact: the prompts' memories are split into facts
/// of at most this many tokens, as a memory's turns are.
const FACT_TOKENS: usize = 12;

/// A prompt answered from memory: about its first three quarters are
/// stored, the rest (1 to 8 tokens) asked, then `steps` tokens decoded.
pub struct Case {
    pub name: String,
    pub tokens: Vec<u32>,
    pub steps: usize,
}

/// One way of storing KV on one prompt.
#[derive(Debug, Clone)]
pub struct Fidelity {
    pub case: String,
    /// The store compared: a [`KvFormat`]'s name for [`check_formats`].
    pub store: String,
    /// KL(reference ‖ store) of the first answer token's distribution.
    pub kl: f64,
    pub steps: usize,
    /// Greedy tokens equal to the reference's before the first that is not.
    pub agreed: usize,
    /// The reference's top-2 logit margin where they first differ.
    pub margin_at_divergence: Option<f32>,
}

/// The mean first-token KL over the gate's prompts a format may reach: f32
/// stores what either backend computes exactly (0); bf16 and fp8 within
/// 0.01, the bound the fp8-fidelity work set (a garbled memory gives KL of
/// several nats).
pub fn kl_tolerance(format: KvFormat) -> f64 {
    match format {
        KvFormat::F32 => 0.0,
        KvFormat::Bf16 | KvFormat::Fp8 => 0.01,
    }
}

/// A reference top-2 margin (logits) above which a greedy divergence is
/// damage, not a near tie that any rounding may flip.
pub const CONFIDENT_MARGIN: f32 = 1.0;

/// A way of storing KV: a fact's KV as computed in, what a read places out.
pub type Store<'a, B> = &'a dyn Fn(&B, &KvChunk<B>) -> Result<KvChunk<B>>;

/// Every format of [`KvFormat::ALL`] on every case, under `header` (the
/// model's segment header: shape, head width).
pub fn check_formats<B: Backend>(engine: &mut Engine<B>, header: &KvHeader, cases: &[Case]) -> Result<Vec<Fidelity>> {
    let headers: Vec<KvHeader> = KvFormat::ALL.iter().map(|&f| header.with_format(f)).collect();
    let stores: Vec<_> = headers.iter().map(|h| move |be: &B, c: &KvChunk<B>| read_back(be, c, h)).collect();
    let named: Vec<(String, Store<'_, B>)> =
        KvFormat::ALL.iter().zip(&stores).map(|(f, s)| (f.to_string(), s as Store<'_, B>)).collect();
    compare(engine, cases, &named)
}

/// The paged cache of `cached` (an fp8 cache: docs/design.md §2.2)
/// against `reference`'s, on every case, as rows of the store `name`: the
/// same memory (computed once, by `reference`) injected into each, the
/// question prefilled and the answer decoded in each — so what differs is
/// what the cache keeps of injected, prefilled and decoded keys and values.
/// The same tolerance as a stored fp8 segment's applies.
pub fn check_cache<B: Backend>(
    reference: &mut Engine<B>,
    cached: &mut Engine<B>,
    cases: &[Case],
    name: &str,
) -> Result<Vec<Fidelity>> {
    let mut out = Vec::new();
    for case in cases {
        let (computed, question) = memory_of(reference, case)?;
        let want = answer(reference, &computed, question, case.steps, None)?;
        let got = answer(cached, &computed, question, case.steps, Some(&want.tokens))?;
        out.push(row(case, name, &want, &got));
    }
    Ok(out)
}

/// A case's memory encoded as facts (each with every token before it as
/// context), and its question.
fn memory_of<'c, B: Backend>(engine: &mut Engine<B>, case: &'c Case) -> Result<(Vec<KvChunk<B>>, &'c [u32])> {
    let n = case.tokens.len();
    if n < 2 {
        return Err(MemoryError::Invalid {
            what: "fidelity case",
            reason: format!("{}: {n} tokens, at least 2 needed", case.name),
        });
    }
    let asked = (n / 4).clamp(1, 8);
    let (memory, question) = case.tokens.split_at(n - asked);
    let mut computed = Vec::new();
    for start in (0..memory.len()).step_by(FACT_TOKENS) {
        let fact = &memory[start..(start + FACT_TOKENS).min(memory.len())];
        computed.push(engine.encode(&memory[..start], fact, start as u32)?);
    }
    Ok((computed, question))
}

/// The row comparing `got` with the reference answer `want`.
fn row(case: &Case, store: &str, want: &Answer, got: &Answer) -> Fidelity {
    let (p, q) = (log_softmax(&want.first), log_softmax(&got.first));
    let kl = p.iter().zip(&q).map(|(&lp, &lq)| lp.exp() * (lp - lq)).sum::<f64>().max(0.0);
    let agreed = want.tokens.iter().zip(&got.tokens).take_while(|(a, b)| a == b).count();
    Fidelity {
        case: case.name.clone(),
        store: store.to_string(),
        kl,
        steps: case.steps,
        agreed,
        margin_at_divergence: want.margins.get(agreed).copied().filter(|_| agreed < case.steps),
    }
}

/// Each of `stores` against the KV as computed, on every case. Prompts
/// need at least two tokens.
pub fn compare<B: Backend>(
    engine: &mut Engine<B>,
    cases: &[Case],
    stores: &[(String, Store<'_, B>)],
) -> Result<Vec<Fidelity>> {
    let mut out = Vec::new();
    for case in cases {
        let (computed, question) = memory_of(engine, case)?;
        let reference = answer(engine, &computed, question, case.steps, None)?;
        for (name, store) in stores {
            let stored = computed.iter().map(|c| store(engine.backend(), c)).collect::<Result<Vec<_>>>()?;
            let got = answer(engine, &stored, question, case.steps, Some(&reference.tokens))?;
            out.push(row(case, name, &reference, &got));
        }
    }
    Ok(out)
}

/// The mean first-token KL of `store`'s rows.
pub fn mean_kl(rows: &[Fidelity], store: &str) -> f64 {
    let mine: Vec<f64> = rows.iter().filter(|r| r.store == store).map(|r| r.kl).collect();
    mine.iter().sum::<f64>() / mine.len().max(1) as f64
}

/// Whether `format`'s rows pass: mean KL within [`kl_tolerance`] and no
/// greedy divergence where the reference was confident.
pub fn passed(rows: &[Fidelity], format: KvFormat) -> bool {
    store_passed(rows, format.name(), kl_tolerance(format))
}

/// [`passed`] for any store's rows, against `tolerance`.
pub fn store_passed(rows: &[Fidelity], store: &str, tolerance: f64) -> bool {
    let confident = |r: &&Fidelity| r.margin_at_divergence.is_some_and(|m| m >= CONFIDENT_MARGIN);
    mean_kl(rows, store) <= tolerance && !rows.iter().filter(|r| r.store == store).any(|r| confident(&r))
}

/// `chunk` written as a segment record under `header` and read back as a
/// read from disk places it.
pub fn read_back<B: Backend>(be: &B, chunk: &KvChunk<B>, header: &KvHeader) -> Result<KvChunk<B>> {
    let (k, v) = chunk.to_host(be)?;
    let record = StoredKv { fact_id: "gate".into(), tokens: chunk.tokens.clone(), k, v }.encode(header)?;
    let path = std::path::Path::new("fidelity gate");
    if let (KvFormat::Fp8, Some(up)) = (header.dtype, be.host_tier_upload_fp8()) {
        let (_, tokens, kv) = StoredKv::fp8_parts(&record, header, path)?;
        let mut k = up(&kv)?;
        let v = k.split_off(kv.layers);
        return Ok(KvChunk { tokens, k, v });
    }
    let s = StoredKv::decode(&record, header, path)?;
    Ok(KvChunk::from_host(be, s.tokens, &s.k, &s.v)?)
}

struct Answer {
    /// Logits of the first answer token.
    first: Vec<f32>,
    tokens: Vec<u32>,
    /// Top-2 logit margin at each step.
    margins: Vec<f32>,
}

/// `memory` injected at the start of a sequence, `question` prefilled after
/// it, then `steps` greedy tokens — each step fed `force`'s token when
/// given (teacher forcing), else its own.
fn answer<B: Backend>(
    engine: &mut Engine<B>,
    memory: &[KvChunk<B>],
    question: &[u32],
    steps: usize,
    force: Option<&[u32]>,
) -> Result<Answer> {
    let mut seq = engine.empty_sequence();
    engine.inject(&mut seq, &memory.iter().collect::<Vec<_>>())?;
    seq.extend(question);
    let mut logits = engine.prefill(&mut seq)?;
    let first = logits.clone();
    let (mut tokens, mut margins) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for step in 0..steps {
        let t = argmax(&logits);
        tokens.push(t);
        margins.push(top2_margin(&logits));
        if step + 1 < steps {
            seq.push(force.and_then(|f| f.get(step).copied()).unwrap_or(t));
            logits = engine.prefill(&mut seq)?;
        }
    }
    Ok(Answer { first, tokens, margins })
}
