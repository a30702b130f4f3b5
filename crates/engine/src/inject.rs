//! Exact KV injection: capturing pre-RoPE K and V, and writing them back
//! into a sequence's paged cache at new positions.
//!
//! A fact is encoded once ([`Engine::encode`]) and its keys are stored
//! *before* RoPE. Because attention scores depend on positions only through
//! R(p_k − p_q), a stored key rotated to position p is the key a forward pass
//! at p computes (E1), and a prefix whose KV was computed exactly can be
//! injected instead of prefilled (E2). The properties are proved by the
//! tests in `tests/equivalence.rs`; the rotation itself lives in `rope.rs`.

use std::ops::Range;

use inferscale_model::HostTensor;

use crate::backend::{Backend, InjectChunk, KvUpload};
use crate::engine::{Captured, Engine, Sequence};
use crate::error::{EngineError, Result};

/// One fact to encode: `context` at positions `0..`, then `fact` from `fact_position`.
#[derive(Debug, Clone, Copy)]
pub struct EncodeItem<'a> {
    pub context: &'a [u32],
    pub fact: &'a [u32],
    pub fact_position: u32,
}

/// Pre-RoPE K and V of a run of tokens in every layer: what the memory
/// shard stores for a fact.
pub struct KvChunk<B: Backend> {
    pub tokens: Vec<u32>,
    /// Per layer, `[tokens, kv_heads·head_dim]`, keys not rotated.
    pub k: Vec<B::Tensor>,
    pub v: Vec<B::Tensor>,
}

impl<B: Backend> std::fmt::Debug for KvChunk<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvChunk").field("tokens", &self.tokens.len()).field("layers", &self.k.len()).finish()
    }
}

impl<B: Backend> KvChunk<B> {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// A chunk from host tensors (per layer `[tokens, kv_dim]`), e.g. read
    /// back from a persisted segment.
    pub fn from_host(be: &B, tokens: Vec<u32>, k: &[HostTensor], v: &[HostTensor]) -> Result<Self> {
        check_layers(tokens.len(), k, v)?;
        let k = k.iter().map(|t| be.keep_kv(be.upload_rows(t)?)).collect::<Result<_>>()?;
        let v = v.iter().map(|t| be.keep_kv(be.upload_rows(t)?)).collect::<Result<_>>()?;
        Ok(KvChunk { tokens, k, v })
    }

    /// [`KvChunk::from_host`] into the backend's host tier (one allocation
    /// for every layer's K and V).
    pub fn from_host_tier(be: &B, tokens: Vec<u32>, k: &[HostTensor], v: &[HostTensor]) -> Result<Self> {
        check_layers(tokens.len(), k, v)?;
        let all: Vec<&HostTensor> = k.iter().chain(v).collect();
        let mut k = be.upload_rows_host_tier(&all)?;
        let v = k.split_off(all.len() / 2);
        Ok(KvChunk { tokens, k, v })
    }

    /// [`KvChunk::from_host_tier`] through a backend's
    /// [`Backend::host_tier_upload`], on whatever thread holds it.
    pub fn from_host_tier_with(
        upload: &KvUpload<B::Tensor>,
        tokens: Vec<u32>,
        k: &[HostTensor],
        v: &[HostTensor],
    ) -> Result<Self> {
        check_layers(tokens.len(), k, v)?;
        let all: Vec<&HostTensor> = k.iter().chain(v).collect();
        let mut k = upload(&all)?;
        if k.len() != all.len() {
            return Err(EngineError::Shape(format!("host-tier upload of {} tensors gave {}", all.len(), k.len())));
        }
        let v = k.split_off(all.len() / 2);
        Ok(KvChunk { tokens, k, v })
    }

    /// Copies every layer to the host (for persistence and tests).
    pub fn to_host(&self, be: &B) -> Result<(Vec<HostTensor>, Vec<HostTensor>)> {
        let k = self.k.iter().map(|t| be.to_host(t)).collect::<Result<_>>()?;
        let v = self.v.iter().map(|t| be.to_host(t)).collect::<Result<_>>()?;
        Ok((k, v))
    }
}

/// Every layer's K and V has one row per token, and there are as many K as V.
fn check_layers(n: usize, k: &[HostTensor], v: &[HostTensor]) -> Result<()> {
    if k.len() != v.len() || k.iter().chain(v).any(|t| t.shape.first() != Some(&n)) {
        return Err(EngineError::Shape(format!("KV chunk of {n} tokens: layer shapes disagree")));
    }
    Ok(())
}

impl<B: Backend> Engine<B> {
    /// Encodes `fact` after `context` in one forward pass — the context at
    /// positions `0..`, the fact from `fact_position` on — and returns the
    /// fact's pre-RoPE K and V. Nothing stays in the cache.
    pub fn encode(&mut self, context: &[u32], fact: &[u32], fact_position: u32) -> Result<KvChunk<B>> {
        self.encode_batch(&[EncodeItem { context, fact, fact_position }])?
            .pop()
            .ok_or_else(|| EngineError::Shape("encode produced no chunk".into()))
    }

    /// [`Engine::encode`] for several facts, packed into shared forward
    /// passes (up to `max_batch_tokens` each): many short encodings cost
    /// about as much as one long prefill. Results are in input order.
    pub fn encode_batch(&mut self, items: &[EncodeItem<'_>]) -> Result<Vec<KvChunk<B>>> {
        let mut seqs = Vec::with_capacity(items.len());
        let mut ranges = Vec::with_capacity(items.len());
        for it in items {
            if it.fact.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if (it.fact_position as usize) < it.context.len() {
                return Err(EngineError::Shape(format!(
                    "fact position {} overlaps a context of {} tokens",
                    it.fact_position,
                    it.context.len()
                )));
            }
            let seq = if it.context.is_empty() {
                self.new_sequence_at(it.fact.to_vec(), it.fact_position)?
            } else {
                let mut s = self.new_sequence(it.context.to_vec())?;
                self.check_tokens(it.fact)?;
                s.extend_at(it.fact, it.fact_position);
                self.check_context(&s)?;
                s
            };
            seqs.push(seq);
            ranges.push(it.context.len()..it.context.len() + it.fact.len());
        }
        let parts = self.prefill_batch_capturing(&mut seqs, &ranges)?;
        items.iter().zip(parts).map(|(it, p)| self.chunk_from_parts(it.fact.to_vec(), p)).collect()
    }

    /// Prefills `seq`'s pending tokens, keeping their KV in its cache, and
    /// returns the last logits plus the pre-RoPE KV of the tokens in `range`
    /// (indices into the sequence).
    pub fn prefill_and_capture(&mut self, seq: &mut Sequence, range: Range<usize>) -> Result<(Vec<f32>, KvChunk<B>)> {
        if range.start < seq.computed() || range.end > seq.len() || range.is_empty() {
            return Err(EngineError::Shape(format!(
                "capture range {range:?} outside the pending tokens {}..{}",
                seq.computed(),
                seq.len()
            )));
        }
        let tokens = seq.tokens()[range.clone()].to_vec();
        let (logits, parts) = self.prefill_capturing(seq, range, true)?;
        let logits = logits.ok_or_else(|| EngineError::Shape("prefill produced no logits".into()))?;
        Ok((logits, self.chunk_from_parts(tokens, parts)?))
    }

    fn chunk_from_parts(&self, tokens: Vec<u32>, parts: Captured<B>) -> Result<KvChunk<B>> {
        let layers = self.model.config().num_layers;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for l in 0..layers {
            let ks: Vec<&B::Tensor> = parts.iter().map(|p| &p[l].0).collect();
            let vs: Vec<&B::Tensor> = parts.iter().map(|p| &p[l].1).collect();
            k.push(self.backend.keep_kv(self.backend.concat_rows(&ks)?)?);
            v.push(self.backend.keep_kv(self.backend.concat_rows(&vs)?)?);
        }
        let rows = k.first().map_or(0, |t| self.backend.dims(t).0);
        if rows != tokens.len() {
            return Err(EngineError::Shape(format!("captured {rows} rows for {} tokens", tokens.len())));
        }
        Ok(KvChunk { tokens, k, v })
    }

    /// Appends each chunk's tokens to `seq` at the next positions and writes
    /// their K (rotated to those positions) and V into its cache, all chunks
    /// and layers in one backend call. `seq` must have nothing pending; the
    /// tokens are then computed, and what is pushed next is prefilled after them.
    pub fn inject(&mut self, seq: &mut Sequence, chunks: &[&KvChunk<B>]) -> Result<()> {
        if seq.pending() != 0 {
            return Err(EngineError::Shape(format!("inject into a sequence with {} pending tokens", seq.pending())));
        }
        let layers = self.model.config().num_layers;
        if let Some(c) = chunks.iter().find(|c| c.k.len() != layers || c.v.len() != layers) {
            return Err(EngineError::Shape(format!("chunk has {} layers, the model {layers}", c.k.len())));
        }
        let start = seq.len();
        for c in chunks {
            self.check_tokens(&c.tokens)?;
            seq.extend(&c.tokens);
        }
        let total = seq.len();
        if let Err(e) = self.check_context(seq).and_then(|()| seq.table_mut().reserve(total)) {
            seq.truncate(start);
            return Err(e);
        }
        let mut at = start;
        let spans: Vec<Range<usize>> = chunks
            .iter()
            .map(|c| {
                at += c.len();
                at - c.len()..at
            })
            .collect();
        let slots: Vec<Vec<u32>> =
            spans.iter().map(|r| r.clone().map(|i| seq.block_table().slot(i)).collect()).collect();
        let inject: Vec<InjectChunk<'_, B::Tensor>> = chunks
            .iter()
            .zip(&spans)
            .zip(&slots)
            .map(|((c, r), slots)| InjectChunk { k: &c.k, v: &c.v, positions: &seq.positions()[r.clone()], slots })
            .collect();
        let (backend, kv, rope) = (&self.backend, &mut self.kv, self.model.rope());
        backend.run(|| backend.inject_kv(kv, &inject, rope))?;
        seq.mark_computed(seq.len() - start);
        seq.record_fact_starts(spans.iter().filter(|r| !r.is_empty()).map(|r| r.start));
        Ok(())
    }

    /// The post-RoPE K and V in `seq`'s cache for `layer`, one row per
    /// computed token.
    pub fn cached_kv(&self, seq: &Sequence, layer: usize) -> Result<(HostTensor, HostTensor)> {
        let slots: Vec<u32> = (0..seq.computed()).map(|i| seq.block_table().slot(i)).collect();
        let (k, v) = self.backend.gather_kv(&self.kv, layer, &slots)?;
        Ok((self.backend.to_host(&k)?, self.backend.to_host(&v)?))
    }
}
