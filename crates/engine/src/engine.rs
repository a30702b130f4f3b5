//! The engine: a model, its backend, and the paged KV cache, computing
//! sequences a chunk at a time.
//!
//! Like vLLM's model runner there is no prefill or decode phase here: each
//! [`Sequence`] has `computed` tokens and catches up to its `tokens`; a step
//! takes up to `max_batch_tokens` pending tokens across all sequences it is
//! given (chunked prefill mixed with decode) and returns logits for the
//! sequences it brought fully up to date.

use inferscale_model::ModelFiles;

use crate::backend::{Backend, KvSpec, SeqSpan};
use crate::error::{EngineError, Result};
use crate::kv_cache::{BLOCK_SIZE, BlockPool, BlockTable};
use crate::llama::{ForwardBatch, Llama};

/// Sizing of an engine.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// KV blocks of [`BLOCK_SIZE`] tokens in the pool.
    pub kv_blocks: usize,
    /// Most tokens computed in one forward pass (prefill chunk size).
    pub max_batch_tokens: usize,
}

impl EngineConfig {
    /// Pool sized to `kv_cache_bytes` for the given model at f32.
    pub fn with_kv_bytes(
        files: &ModelFiles,
        kv_cache_bytes: usize,
        max_batch_tokens: usize,
    ) -> Self {
        let c = &files.config;
        let per_token = 2 * c.num_layers * c.kv_dim() * 4;
        EngineConfig {
            kv_blocks: (kv_cache_bytes / (per_token * BLOCK_SIZE)).max(1),
            max_batch_tokens,
        }
    }
}

/// One sequence's tokens and cache.
#[derive(Debug)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    /// Leading tokens whose K and V are in the cache.
    pub computed: usize,
    pub table: BlockTable,
}

impl Sequence {
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

pub struct Engine<B: Backend> {
    backend: B,
    model: Llama<B>,
    kv: B::KvStore,
    pool: BlockPool,
    max_batch_tokens: usize,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, files: &ModelFiles, cfg: EngineConfig) -> Result<Self> {
        if cfg.max_batch_tokens == 0 {
            return Err(EngineError::Shape(
                "max_batch_tokens must be positive".into(),
            ));
        }
        let model = Llama::load(&backend, files)?;
        let c = model.config();
        let kv = backend.new_kv_store(KvSpec {
            num_layers: c.num_layers,
            num_blocks: cfg.kv_blocks,
            block_size: BLOCK_SIZE,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        })?;
        Ok(Engine {
            backend,
            model,
            kv,
            pool: BlockPool::new(cfg.kv_blocks),
            max_batch_tokens: cfg.max_batch_tokens,
        })
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Checks `tokens` against the vocabulary and context and makes a sequence.
    pub fn new_sequence(&self, tokens: Vec<u32>) -> Result<Sequence> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let c = self.model.config();
        if tokens.len() > c.max_position_embeddings {
            return Err(EngineError::ContextTooLong {
                tokens: tokens.len(),
                limit: c.max_position_embeddings,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        Ok(Sequence {
            tokens,
            computed: 0,
            table: BlockTable::new(&self.pool),
        })
    }

    /// Computes up to `max_batch_tokens` pending tokens of `seqs`, in order.
    /// Returns, per sequence, the logits after its last token if this step
    /// computed all its pending tokens, else `None`.
    pub fn step(&mut self, seqs: &mut [&mut Sequence]) -> Result<Vec<Option<Vec<f32>>>> {
        let limit = self.model.config().max_position_embeddings;
        let mut budget = self.max_batch_tokens;
        let mut take = vec![0usize; seqs.len()];
        for (i, s) in seqs.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            if s.tokens.len() > limit {
                return Err(EngineError::ContextTooLong {
                    tokens: s.tokens.len(),
                    limit,
                });
            }
            let n = s.pending().min(budget);
            if n > 0 {
                s.table.reserve(s.computed + n)?;
                take[i] = n;
                budget -= n;
            }
        }
        let mut batch = ForwardBatch::default();
        let mut finishing = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let n = take[i];
            if n == 0 {
                continue;
            }
            let q_start = batch.tokens.len();
            for p in s.computed..s.computed + n {
                batch.tokens.push(s.tokens[p]);
                batch.positions.push(p as u32);
                batch.slots.push(s.table.slot(p));
            }
            batch.spans.push(SeqSpan {
                q_start,
                q_len: n,
                context_len: s.computed + n,
                block_table: s.table.blocks(),
            });
            if s.computed + n == s.tokens.len() {
                batch.logit_rows.push(q_start + n - 1);
                finishing.push(i);
            }
        }
        let mut out = vec![None; seqs.len()];
        if batch.tokens.is_empty() {
            return Ok(out);
        }
        let logits = self.model.forward(&self.backend, &batch, &mut self.kv)?;
        let logits = self.backend.to_host(&logits)?;
        let vocab = self.model.config().vocab_size;
        for (row, &i) in finishing.iter().enumerate() {
            out[i] = Some(logits.data[row * vocab..(row + 1) * vocab].to_vec());
        }
        for (s, n) in seqs.iter_mut().zip(take) {
            s.computed += n;
        }
        Ok(out)
    }

    /// Computes all pending tokens of one sequence; returns the last logits.
    pub fn prefill(&mut self, seq: &mut Sequence) -> Result<Vec<f32>> {
        loop {
            if let Some(logits) = self.step(&mut [&mut *seq])?.pop().flatten() {
                return Ok(logits);
            }
            if seq.pending() == 0 {
                return Err(EngineError::Shape(
                    "prefill of a sequence with nothing pending".into(),
                ));
            }
        }
    }
}
