//! The engine: a model, its backend, and the paged KV cache, computing
//! sequences a chunk at a time.
//!
//! Like vLLM's model runner there is no prefill or decode phase here: each
//! [`Sequence`] has `computed` tokens and catches up to its `tokens`; a step
//! takes up to `max_batch_tokens` pending tokens across all sequences it is
//! given (chunked prefill mixed with decode) and returns logits for the
//! sequences it brought fully up to date. KV injection (`inject.rs`) adds
//! tokens whose KV is written directly instead of computed.

use std::ops::Range;

use inferscale_model::ModelFiles;
use inferscale_types::Blend;

use crate::backend::{Backend, DecodeGraphs, DecodeStep, KvCacheDtype, KvSpec, SeqSpan};
use crate::blend::{BlendPlan, BlendRows, blend_rows, keep_count};
use crate::error::{EngineError, Result};
use crate::fp8_cache::{self, calibration_tokens};
use crate::kv_cache::{BLOCK_SIZE, BlockKey, BlockPool, BlockTable, block_keys};
use crate::llama::{ForwardBatch, ForwardOutput, LayerKv, Llama};

/// Sizing of an engine.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// KV blocks of [`BLOCK_SIZE`] tokens in the pool.
    pub kv_blocks: usize,
    /// Most tokens computed in one forward pass (prefill chunk size).
    pub max_batch_tokens: usize,
}

impl EngineConfig {
    /// Pool sized to `kv_cache_bytes` for the given model, at
    /// `bytes_per_value` per cached element (the backend's
    /// [`Backend::kv_bytes_per_value`]).
    pub fn with_kv_bytes(
        files: &ModelFiles,
        kv_cache_bytes: usize,
        max_batch_tokens: usize,
        bytes_per_value: usize,
    ) -> Self {
        Self::for_cache(files, kv_cache_bytes, max_batch_tokens, KvCacheDtype::Native, bytes_per_value)
    }

    /// [`EngineConfig::with_kv_bytes`] for a cache of `dtype` (`native`
    /// bytes per element where it is the backend's own).
    pub fn for_cache(
        files: &ModelFiles,
        kv_cache_bytes: usize,
        max_batch_tokens: usize,
        dtype: KvCacheDtype,
        native: usize,
    ) -> Self {
        let c = &files.config;
        let per_token = dtype.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, native);
        EngineConfig { kv_blocks: (kv_cache_bytes / (per_token * BLOCK_SIZE)).max(1), max_batch_tokens }
    }
}

/// One sequence's tokens, their RoPE positions, and its cache.
///
/// Positions normally count up from 0, but need not: an encoding may place a
/// fact at any offset, and injected chunks take the positions they are given.
/// The cache is indexed by token index, so positions only steer RoPE.
#[derive(Debug)]
pub struct Sequence {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    /// Leading tokens whose K and V are in the cache.
    computed: usize,
    table: BlockTable,
    /// Injected tokens the next steps recompute first (kv+blend).
    pub(crate) blend: Option<BlendPlan>,
    /// Injected tokens recomputed through every layer so far (kv+blend).
    recomputed: usize,
    /// Where each injected fact begins (token indices, ascending): what
    /// kv+blend's fact-start selection ranks by.
    fact_starts: Vec<usize>,
    /// The prefix cache's keys of its prompt's full blocks, when the
    /// sequence takes part (`Engine::reuse_prefix`).
    prefix: Option<PrefixChain>,
}

/// A sequence's part in the prefix cache: its prompt's block keys and how
/// many of its blocks are cached or were found there.
#[derive(Debug)]
struct PrefixChain {
    keys: Vec<BlockKey>,
    registered: usize,
}

impl Sequence {
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn computed(&self) -> usize {
        self.computed
    }

    /// Rows the steps computing this sequence still have to run: injected
    /// tokens to recompute (kv+blend), then the tokens not yet computed.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed + self.blend.as_ref().map_or(0, BlendPlan::remaining)
    }

    /// Injected tokens recomputed through every layer (kv+blend); every
    /// injected token of the blend also ran through the first layers.
    pub fn recomputed(&self) -> usize {
        self.recomputed
    }

    /// Where each injected fact begins (token indices, ascending).
    pub fn fact_starts(&self) -> &[usize] {
        &self.fact_starts
    }

    pub fn block_table(&self) -> &BlockTable {
        &self.table
    }

    /// The position a token appended now would take.
    pub fn next_position(&self) -> u32 {
        self.positions.last().map_or(0, |p| p + 1)
    }

    /// Appends a token at the next position (it becomes pending).
    pub fn push(&mut self, token: u32) {
        let p = self.next_position();
        self.tokens.push(token);
        self.positions.push(p);
    }

    /// Appends tokens at the next positions.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Appends tokens starting at `position`.
    pub fn extend_at(&mut self, tokens: &[u32], position: u32) {
        self.tokens.extend_from_slice(tokens);
        self.positions.extend(position..position + tokens.len() as u32);
    }

    /// Notes where injected facts begin (indices past those noted before).
    pub(crate) fn record_fact_starts(&mut self, starts: impl IntoIterator<Item = usize>) {
        self.fact_starts.extend(starts);
    }

    /// Drops tokens from index `len` on (never below what is computed).
    pub(crate) fn truncate(&mut self, len: usize) {
        let len = len.max(self.computed);
        self.tokens.truncate(len);
        self.positions.truncate(len);
    }

    /// Marks `n` pending tokens computed (their KV was written by injection).
    pub(crate) fn mark_computed(&mut self, n: usize) {
        self.computed = (self.computed + n).min(self.tokens.len());
    }

    pub(crate) fn table_mut(&mut self) -> &mut BlockTable {
        &mut self.table
    }
}

pub struct Engine<B: Backend> {
    pub(crate) backend: B,
    pub(crate) model: Llama<B>,
    pub(crate) kv: B::KvStore,
    pool: BlockPool,
    max_batch_tokens: usize,
    /// Decode steps replayed as captured graphs ([`Engine::enable_decode_graphs`]).
    graphs: Option<Graphs>,
}

/// The engine's side of captured decode steps: the block its padding rows
/// write to and read (never part of a sequence), and the backend's graphs.
struct Graphs {
    scratch: u32,
    cache: DecodeGraphs,
}

/// Per-layer pre-RoPE K and V captured from forward passes, in row order.
pub(crate) type Captured<B> = Vec<Vec<LayerKv<B>>>;

/// Per sequence: logits if it finished, and its captured layers if any.
type StepOutput<B> = (Vec<Option<Vec<f32>>>, Vec<Option<Vec<LayerKv<B>>>>);

/// What a step yields for a sequence whose pending tokens it finished.
#[derive(Debug, Clone, PartialEq)]
pub enum NextToken {
    /// The argmax of the last logits, reduced on the device.
    Greedy(u32),
    /// The last logits, for sampling on the host.
    Logits(Vec<f32>),
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, files: &ModelFiles, cfg: EngineConfig) -> Result<Self> {
        Self::with_cache(backend, files, cfg, KvCacheDtype::Native)
    }

    /// An engine whose paged cache holds `dtype`. An fp8 cache is
    /// calibrated here, before anything is written to it: its key offsets
    /// are the channel means of the keys of [`fp8_cache::CALIBRATION_TEXT`]
    /// (token ids spread over the vocabulary where the files have no
    /// tokenizer), computed in a small cache of the backend's own precision.
    pub fn with_cache(backend: B, files: &ModelFiles, cfg: EngineConfig, dtype: KvCacheDtype) -> Result<Self> {
        if dtype == KvCacheDtype::Native {
            return Self::build(backend, files, cfg, cfg.kv_blocks);
        }
        let tokens = calibration_tokens(files)?;
        let mut engine = Self::build(backend, files, cfg, tokens.len().div_ceil(BLOCK_SIZE))?;
        let offsets = engine.key_offsets(tokens)?;
        engine.install_fp8_cache(cfg.kv_blocks, &offsets)?;
        Ok(engine)
    }

    /// An engine with an fp8 cache whose key offsets (per layer,
    /// `[kv_heads·head_dim]`) are given rather than calibrated: offsets
    /// measured elsewhere, or zeros — keys rounded as they are, the control
    /// docs/design.md §2.2 measured against.
    pub fn with_fp8_offsets(backend: B, files: &ModelFiles, cfg: EngineConfig, offsets: &[Vec<f32>]) -> Result<Self> {
        let mut engine = Self::build(backend, files, cfg, 1)?;
        engine.install_fp8_cache(cfg.kv_blocks, offsets)?;
        Ok(engine)
    }

    /// The model loaded, with a cache of the backend's own precision of
    /// `blocks` blocks — the engine's, or a placeholder for an fp8 cache
    /// (large enough for the calibration prefill) until
    /// [`Engine::install_fp8_cache`].
    fn build(backend: B, files: &ModelFiles, cfg: EngineConfig, blocks: usize) -> Result<Self> {
        if cfg.max_batch_tokens == 0 {
            return Err(EngineError::Shape("max_batch_tokens must be positive".into()));
        }
        let model = Llama::load(&backend, files)?;
        let spec = Self::spec_for(model.config(), blocks, KvCacheDtype::Native);
        let kv = backend.new_kv_store(spec)?;
        Ok(Engine {
            backend,
            model,
            kv,
            pool: BlockPool::new(blocks),
            max_batch_tokens: cfg.max_batch_tokens,
            graphs: None,
        })
    }

    fn spec_for(c: &inferscale_model::ModelConfig, num_blocks: usize, dtype: KvCacheDtype) -> KvSpec {
        KvSpec {
            num_layers: c.num_layers,
            num_blocks,
            block_size: BLOCK_SIZE,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype,
        }
    }

    /// Replaces the cache (and its pool) with an fp8 cache of `blocks`
    /// blocks calibrated with `offsets`, before anything is written to it.
    fn install_fp8_cache(&mut self, blocks: usize, offsets: &[Vec<f32>]) -> Result<()> {
        let spec = Self::spec_for(self.model.config(), blocks, KvCacheDtype::Fp8);
        let mut kv = self.backend.new_kv_store(spec)?;
        self.backend.calibrate_kv(&mut kv, offsets, self.model.rope())?;
        self.kv = kv;
        self.pool = BlockPool::new(blocks);
        Ok(())
    }

    /// Each layer's key offsets (fp8 cache): the channel means of the
    /// pre-RoPE keys a prefill of `tokens` computes.
    fn key_offsets(&mut self, tokens: Vec<u32>) -> Result<Vec<Vec<f32>>> {
        let n = tokens.len();
        let mut seq = self.new_sequence(tokens)?;
        let (_, parts) = self.prefill_capturing(&mut seq, 0..n, false)?;
        let c = self.model.config();
        (0..c.num_layers)
            .map(|layer| {
                let mut keys = Vec::with_capacity(n * c.kv_dim());
                for part in &parts {
                    keys.extend(self.backend.to_host(&part[layer].0)?.data);
                }
                fp8_cache::key_offsets(&keys, c.kv_dim()).ok_or_else(|| {
                    EngineError::Shape(format!("fp8 KV cache: layer {layer}'s calibration keys give no offsets"))
                })
            })
            .collect()
    }

    /// Runs decode steps — every sequence of the step computing one token,
    /// none capturing KV or recomputing injected rows — as graphs the
    /// backend captured, where it can ([`PagedKv::decode_graph_rows`]): a
    /// step of a small model is hundreds of kernels whose launches, not
    /// their bytes, set its time. A batch is padded up to the graph's size
    /// with rows that write and read one block set aside here. Returns
    /// whether graphs are on (false where the backend has none).
    ///
    /// [`PagedKv::decode_graph_rows`]: crate::backend::PagedKv::decode_graph_rows
    pub fn enable_decode_graphs(&mut self) -> Result<bool> {
        if self.graphs.is_some() {
            return Ok(true);
        }
        if self.backend.decode_graph_rows(1).is_none() {
            return Ok(false);
        }
        let scratch = self.pool.allocate(1).and_then(|b| b.first().copied()).ok_or(EngineError::OutOfBlocks {
            needed: 1,
            free: self.pool.free_blocks(),
            total: self.pool.total_blocks(),
        })?;
        self.graphs = Some(Graphs { scratch, cache: DecodeGraphs::default() });
        Ok(true)
    }

    /// Whether decode steps replay captured graphs.
    pub fn decode_graphs(&self) -> bool {
        self.graphs.is_some()
    }

    /// Graphs captured and steps replayed so far (`None`: graphs are off).
    pub fn decode_graph_counts(&self) -> Option<(u64, u64)> {
        self.graphs.as_ref().map(|g| (g.cache.captured, g.cache.replayed))
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Most tokens one forward pass computes.
    pub fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Checks `tokens` against the vocabulary and makes a sequence at positions 0...
    pub fn new_sequence(&self, tokens: Vec<u32>) -> Result<Sequence> {
        self.new_sequence_at(tokens, 0)
    }

    /// A sequence of no tokens yet, to be extended (a completion's prompt
    /// on a model whose tokenizer starts texts with nothing).
    pub fn empty_sequence(&self) -> Sequence {
        Sequence {
            tokens: Vec::new(),
            positions: Vec::new(),
            computed: 0,
            table: BlockTable::new(&self.pool),
            blend: None,
            recomputed: 0,
            fact_starts: Vec::new(),
            prefix: None,
        }
    }

    /// A sequence whose first token sits at `position`.
    pub fn new_sequence_at(&self, tokens: Vec<u32>, position: u32) -> Result<Sequence> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_tokens(&tokens)?;
        let mut seq = Sequence {
            tokens: Vec::with_capacity(tokens.len()),
            positions: Vec::with_capacity(tokens.len()),
            computed: 0,
            table: BlockTable::new(&self.pool),
            blend: None,
            recomputed: 0,
            fact_starts: Vec::new(),
            prefix: None,
        };
        seq.extend_at(&tokens, position);
        self.check_context(&seq)?;
        Ok(seq)
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config().vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(EngineError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// Every position must be one the model was trained for.
    pub(crate) fn check_context(&self, seq: &Sequence) -> Result<()> {
        let limit = self.model.config().max_position_embeddings;
        let needed = seq.positions.last().map_or(0, |&p| p as usize + 1).max(seq.len());
        if needed > limit {
            return Err(EngineError::ContextTooLong { tokens: needed, limit });
        }
        Ok(())
    }

    /// A new sequence with the same tokens and cache contents as `seq`: full
    /// blocks are shared (refcounted), the partial last block is copied so
    /// that both can grow independently. Used to reuse a cached prompt header.
    pub fn fork(&mut self, seq: &Sequence) -> Result<Sequence> {
        let mut table = seq.table.share_prefix(seq.computed);
        let shared = table.blocks().len();
        if seq.computed > shared * BLOCK_SIZE {
            table.reserve(seq.computed)?;
            let src = seq.table.blocks()[shared];
            let dst = table.blocks()[shared];
            self.backend.copy_blocks(&mut self.kv, &[(src, dst)])?;
        }
        Ok(Sequence {
            tokens: seq.tokens.clone(),
            positions: seq.positions.clone(),
            computed: seq.computed,
            table,
            blend: None,
            recomputed: 0,
            fact_starts: Vec::new(),
            prefix: None,
        })
    }

    /// Automatic prefix caching, for a sequence whose every token is
    /// computed by the forward pass at its own index as position (a prompt
    /// with its facts pasted, or none): takes the cached blocks of the
    /// longest prefix of its tokens that `salt` has cached past what it
    /// already holds computed, and from now on caches its prompt's full
    /// blocks as it computes them. Returns the tokens it need not compute.
    /// The last token is always left to compute: its logits give the next
    /// token. A sequence with injected tokens (positions not its indices,
    /// a blend to run) takes no part and gets 0.
    pub fn reuse_prefix(&mut self, seq: &mut Sequence, salt: &[u8]) -> usize {
        let contiguous = seq.positions.iter().enumerate().all(|(i, &p)| p as usize == i);
        if !contiguous || seq.blend.is_some() || seq.is_empty() {
            return 0;
        }
        let keys = block_keys(salt, &seq.tokens);
        let from = seq.computed / BLOCK_SIZE;
        let most = ((seq.len() - 1) / BLOCK_SIZE).min(keys.len());
        let end = seq.table.reuse(&keys[..most], from);
        let before = seq.computed;
        if end > from {
            seq.computed = end * BLOCK_SIZE;
        }
        seq.prefix = Some(PrefixChain { keys, registered: end });
        seq.computed - before
    }

    /// Computes up to `max_batch_tokens` pending tokens of `seqs`, in order.
    /// Returns, per sequence, the logits after its last token if this step
    /// computed all its pending tokens, else `None`.
    pub fn step(&mut self, seqs: &mut [&mut Sequence]) -> Result<Vec<Option<Vec<f32>>>> {
        Ok(self.step_capturing(seqs, &[], true)?.0)
    }

    /// [`Engine::step`], also returning for each sequence `i` the pre-RoPE K
    /// and V of its tokens whose indices fall in `capture[i]` (sequences past
    /// the end of `capture` capture nothing); without `want_logits` the
    /// output head is skipped.
    pub(crate) fn step_capturing(
        &mut self,
        seqs: &mut [&mut Sequence],
        capture: &[Range<usize>],
        want_logits: bool,
    ) -> Result<StepOutput<B>> {
        let mut budget = self.max_batch_tokens;
        let mut take = vec![0usize; seqs.len()];
        for (i, s) in seqs.iter().enumerate() {
            take[i] = s.pending().min(budget);
            budget -= take[i];
        }
        self.forward_taking(seqs, &take, capture, want_logits)
    }

    /// Computes exactly `take[i]` pending tokens of each `seqs[i]` in one
    /// forward pass — the caller (a scheduler) has decided the split — and
    /// returns, per sequence that finished its pending tokens, its next
    /// token's source: the argmax if `greedy[i]` (reduced on the device, so
    /// only one id per sequence crosses to the host), else the logits.
    pub fn step_scheduled(
        &mut self,
        seqs: &mut [&mut Sequence],
        take: &[usize],
        greedy: &[bool],
    ) -> Result<Vec<Option<NextToken>>> {
        if take.len() != seqs.len() || greedy.len() != seqs.len() {
            return Err(EngineError::Shape(format!(
                "{} token counts and {} greedy flags for {} sequences",
                take.len(),
                greedy.len(),
                seqs.len()
            )));
        }
        let total: usize = take.iter().sum();
        if total > self.max_batch_tokens {
            return Err(EngineError::Shape(format!("step of {total} tokens exceeds {}", self.max_batch_tokens)));
        }
        if let Some((s, n)) = seqs.iter().zip(take).find(|(s, n)| **n > s.pending()) {
            return Err(EngineError::Shape(format!("{n} tokens asked of a sequence with {} pending", s.pending())));
        }
        let (logits, finishing) = self.forward_raw(seqs, take, &[], true)?.0;
        let mut out = vec![None; seqs.len()];
        let Some(logits) = logits else { return Ok(out) };
        let (g_rows, s_rows): (Vec<usize>, Vec<usize>) = (0..finishing.len()).partition(|&r| greedy[finishing[r]]);
        let be = &self.backend;
        let pick = |rows: &[usize]| -> Result<Option<B::Tensor>> {
            Ok(match rows.len() {
                0 => None,
                n if n == finishing.len() => None,
                _ => Some(be.select_rows(&logits, rows)?),
            })
        };
        if !g_rows.is_empty() {
            let sel = pick(&g_rows)?;
            let ids = be.argmax_rows(sel.as_ref().unwrap_or(&logits))?;
            for (&r, id) in g_rows.iter().zip(ids) {
                out[finishing[r]] = Some(NextToken::Greedy(id));
            }
        }
        if !s_rows.is_empty() {
            let sel = pick(&s_rows)?;
            let host = be.to_host(sel.as_ref().unwrap_or(&logits))?;
            let vocab = self.model.config().vocab_size;
            for (j, &r) in s_rows.iter().enumerate() {
                out[finishing[r]] = Some(NextToken::Logits(host.data[j * vocab..(j + 1) * vocab].to_vec()));
            }
        }
        Ok(out)
    }

    fn forward_taking(
        &mut self,
        seqs: &mut [&mut Sequence],
        take: &[usize],
        capture: &[Range<usize>],
        want_logits: bool,
    ) -> Result<StepOutput<B>> {
        let ((logits, finishing), captured) = self.forward_raw(seqs, take, capture, want_logits)?;
        let mut out = vec![None; seqs.len()];
        if let Some(logits) = logits {
            let logits = self.backend.to_host(&logits)?;
            let vocab = self.model.config().vocab_size;
            for (row, &i) in finishing.iter().enumerate() {
                out[i] = Some(logits.data[row * vocab..(row + 1) * vocab].to_vec());
            }
        }
        Ok((out, captured))
    }

    /// The forward pass of a step: the device logits of the sequences that
    /// finished their pending tokens (`finishing[row]` = sequence index) and
    /// the captured pre-RoPE KV.
    #[allow(clippy::type_complexity)]
    fn forward_raw(
        &mut self,
        seqs: &mut [&mut Sequence],
        take: &[usize],
        capture: &[Range<usize>],
        want_logits: bool,
    ) -> Result<((Option<B::Tensor>, Vec<usize>), Vec<Option<Vec<LayerKv<B>>>>)> {
        // Per sequence: the injected tokens it recomputes in this pass
        // (kv+blend, always first) and the tokens it computes.
        let split: Vec<(usize, usize)> = seqs
            .iter()
            .zip(take)
            .map(|(s, &n)| {
                let b = s.blend.as_ref().map_or(0, BlendPlan::remaining).min(n);
                (b, n - b)
            })
            .collect();
        for (s, &(_, t)) in seqs.iter_mut().zip(&split) {
            if t > 0 {
                self.check_context(s)?;
                s.table.reserve(s.computed + t)?;
            }
        }
        // Each sequence's rows as cache indices: recomputed injected tokens,
        // then new ones.
        let row_indices = |s: &Sequence, (b, t): (usize, usize)| {
            let from = s.blend.as_ref().map_or(0, |p| p.next);
            (from..from + b).chain(s.computed..s.computed + t)
        };
        // Recomputed rows are not the cache's last entries: their spans say
        // where each row's keys end.
        let ends: Vec<Option<Vec<u32>>> = seqs
            .iter()
            .zip(&split)
            .map(|(s, &(b, t))| (b > 0).then(|| row_indices(s, (b, t)).map(|i| i as u32 + 1).collect()))
            .collect();
        let mut batch = ForwardBatch::default();
        let mut blend = BlendRows::default();
        let mut finishing = Vec::new();
        // Per sequence, its rows' positions within the captured rows.
        let mut captured_rows: Vec<Vec<usize>> = vec![Vec::new(); seqs.len()];
        for (i, s) in seqs.iter().enumerate() {
            let (b, t) = split[i];
            if b + t == 0 {
                continue;
            }
            let q_start = batch.tokens.len();
            for p in row_indices(s, (b, t)) {
                batch.tokens.push(s.tokens[p]);
                batch.positions.push(s.positions[p]);
                batch.slots.push(s.table.slot(p));
            }
            if let Some(plan) = s.blend.as_ref().filter(|_| b > 0) {
                // The sequence's new rows follow its recomputed ones: its
                // question, when this pass holds it.
                blend.groups.push(plan.group(q_start..q_start + b, q_start + b..q_start + b + t));
            }
            if let Some(range) = capture.get(i) {
                let lo = range.start.clamp(s.computed, s.computed + t);
                let hi = range.end.clamp(s.computed, s.computed + t);
                for idx in lo..hi {
                    captured_rows[i].push(batch.capture.len());
                    batch.capture.push(q_start + b + idx - s.computed);
                }
            }
            // The cache entries up to the span's last row.
            let context_len = match t {
                0 => s.blend.as_ref().map_or(0, |p| p.next) + b,
                _ => s.computed + t,
            };
            batch.spans.push(SeqSpan {
                q_start,
                q_len: b + t,
                context_len,
                block_table: s.table.blocks(),
                row_ends: ends[i].as_deref(),
            });
            if want_logits && t > 0 && s.computed + t == s.tokens.len() {
                batch.logit_rows.push(q_start + b + t - 1);
                finishing.push(i);
            }
        }
        if !blend.groups.is_empty() {
            batch.blend = Some(blend);
        }
        let mut captured: Vec<Option<Vec<LayerKv<B>>>> = (0..seqs.len()).map(|_| None).collect();
        if batch.tokens.is_empty() {
            return Ok(((None, finishing), captured));
        }
        let fwd = match self.graph_rows(&batch, want_logits) {
            Some(rows) => self.forward_graphed(&batch, rows)?,
            None => {
                let (model, backend, kv) = (&self.model, &self.backend, &mut self.kv);
                backend.run(|| model.forward(backend, &batch, kv))?
            }
        };
        let logits = fwd.logits;
        if let Some(layers) = fwd.captured {
            let owners: Vec<usize> = (0..seqs.len()).filter(|&i| !captured_rows[i].is_empty()).collect();
            if let [only] = owners[..] {
                // One sequence owns every captured row, in order.
                captured[only] = Some(layers);
            } else {
                for i in owners {
                    let rows = &captured_rows[i];
                    let mine = layers
                        .iter()
                        .map(|(k, v)| Ok((self.backend.select_rows(k, rows)?, self.backend.select_rows(v, rows)?)))
                        .collect::<Result<_>>()?;
                    captured[i] = Some(mine);
                }
            }
        }
        // Rows of each blend group that went through every layer.
        let mut groups = batch.blend.iter().flat_map(|b| b.groups.iter());
        for (s, &(b, t)) in seqs.iter_mut().zip(&split) {
            if let Some(plan) = s.blend.as_mut().filter(|_| b > 0) {
                let rows = groups.next().map_or(0..0, |g| g.rows.clone());
                s.recomputed += fwd.kept.as_ref().map_or(b, |k| k.iter().filter(|r| rows.contains(r)).count());
                plan.next += b;
                if plan.remaining() == 0 {
                    s.blend = None;
                }
            }
            s.computed += t;
            // Prompt blocks now fully computed join the prefix cache.
            if let Some(p) = s.prefix.as_mut() {
                let full = (s.computed / BLOCK_SIZE).min(p.keys.len());
                if full > p.registered {
                    s.table.register(&p.keys, p.registered..full);
                    p.registered = full;
                }
            }
        }
        Ok(((logits, finishing), captured))
    }

    /// The graph batch size for `batch` if it is a decode step a captured
    /// graph can run: one new row per sequence, in order, each wanting its
    /// logits, nothing captured or recomputed.
    fn graph_rows(&self, batch: &ForwardBatch<'_>, want_logits: bool) -> Option<usize> {
        self.graphs.as_ref()?;
        let n = batch.tokens.len();
        let decode = want_logits
            && batch.capture.is_empty()
            && batch.blend.is_none()
            && batch.spans.len() == n
            && batch.spans.iter().enumerate().all(|(i, s)| s.q_start == i && s.q_len == 1 && s.row_ends.is_none())
            && batch.logit_rows.iter().copied().eq(0..n);
        if decode { self.backend.decode_graph_rows(n) } else { None }
    }

    /// `batch` (a decode step, [`Engine::graph_rows`]) padded to `rows` and
    /// run by the backend's graph of that size: padding rows take token 0
    /// at position 0 in the scratch block, each a sequence of one token.
    fn forward_graphed(&mut self, batch: &ForwardBatch<'_>, rows: usize) -> Result<ForwardOutput<B>> {
        let Some(g) = self.graphs.as_mut() else {
            return Err(EngineError::Shape("a graphed step without graphs".into()));
        };
        let n = batch.tokens.len();
        let table = [g.scratch];
        let slot = g.scratch * BLOCK_SIZE as u32;
        let pad = |v: &[u32], with: u32| {
            let mut v = v.to_vec();
            v.resize(rows, with);
            v
        };
        let mut spans: Vec<SeqSpan<'_>> = batch.spans.clone();
        spans.extend((n..rows).map(|i| SeqSpan {
            q_start: i,
            q_len: 1,
            context_len: 1,
            block_table: &table,
            row_ends: None,
        }));
        let padded = ForwardBatch {
            tokens: pad(&batch.tokens, 0),
            positions: pad(&batch.positions, 0),
            slots: pad(&batch.slots, slot),
            spans,
            logit_rows: (0..rows).collect(),
            capture: Vec::new(),
            blend: None,
        };
        let step = DecodeStep {
            rows: n,
            tokens: &padded.tokens,
            positions: &padded.positions,
            slots: &padded.slots,
            spans: &padded.spans,
        };
        let model = &self.model;
        let logits = self.backend.run_decode_graph(&mut g.cache, &mut self.kv, &step, &mut |be, kv| {
            model
                .forward(be, &padded, kv)?
                .logits
                .ok_or_else(|| EngineError::Shape("a decode step without logits".into()))
        })?;
        Ok(ForwardOutput { logits: Some(logits), captured: None, kept: None })
    }

    /// Computes all pending tokens of one sequence; returns the last logits.
    pub fn prefill(&mut self, seq: &mut Sequence) -> Result<Vec<f32>> {
        self.prefill_capturing(seq, 0..0, true)?
            .0
            .ok_or_else(|| EngineError::Shape("prefill produced no logits".into()))
    }

    /// Computes all pending tokens of `seq`, returning the last logits (if
    /// wanted) and the per-layer pre-RoPE K and V of the tokens with indices
    /// in `range`, one entry per forward chunk that held some of them.
    pub(crate) fn prefill_capturing(
        &mut self,
        seq: &mut Sequence,
        range: Range<usize>,
        want_logits: bool,
    ) -> Result<(Option<Vec<f32>>, Captured<B>)> {
        if seq.pending() == 0 {
            return Err(EngineError::Shape("prefill of a sequence with nothing pending".into()));
        }
        let mut parts: Captured<B> = Vec::new();
        let mut last = None;
        while seq.pending() > 0 {
            let (mut logits, mut captured) =
                self.step_capturing(&mut [&mut *seq], std::slice::from_ref(&range), want_logits)?;
            parts.extend(captured.pop().flatten());
            last = logits.pop().flatten();
        }
        Ok((last, parts))
    }

    /// Computes all pending tokens of several sequences together (each
    /// forward pass packs as many as `max_batch_tokens` allows) and returns,
    /// per sequence, the pre-RoPE KV of its tokens in `ranges[i]`, one entry
    /// per forward chunk. No logits are computed.
    pub(crate) fn prefill_batch_capturing(
        &mut self,
        seqs: &mut [Sequence],
        ranges: &[Range<usize>],
    ) -> Result<Vec<Captured<B>>> {
        let mut parts: Vec<Captured<B>> = (0..seqs.len()).map(|_| Vec::new()).collect();
        while seqs.iter().any(|s| s.pending() > 0) {
            let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
            let (_, captured) = self.step_capturing(&mut refs, ranges, false)?;
            for (p, c) in parts.iter_mut().zip(captured) {
                p.extend(c);
            }
        }
        Ok(parts)
    }
}

impl<B: Backend> Engine<B> {
    /// kv+blend: the steps that compute `seq`'s pending tokens first
    /// recompute its last `injected` computed tokens (just injected), keeping
    /// `blend.ratio` of them past [`SELECT_LAYER`] as `blend.select` ranks
    /// them; see the module docs. Ratio 0 plans nothing (the sequence stays
    /// kv mode's); ratio 1 recomputes them all (prompt mode's prefill).
    /// `blend.focus` (0..=1) of the kept tokens are the injected memory's
    /// last — the best-ranked facts, nearest the question — whatever their
    /// rank (1 keeps the last tokens only). `seq` must have its question
    /// pending.
    pub fn blend(&self, seq: &mut Sequence, injected: usize, blend: Blend) -> Result<()> {
        let Blend { ratio, focus, select } = blend;
        if !(0.0..=1.0).contains(&ratio) {
            return Err(EngineError::Shape(format!("blend ratio {ratio} outside 0..=1")));
        }
        if !(0.0..=1.0).contains(&focus) {
            return Err(EngineError::Shape(format!("blend focus {focus} outside 0..=1")));
        }
        let end = seq.computed();
        if injected > end || seq.pending() == 0 || seq.blend.is_some() {
            return Err(EngineError::Shape(format!(
                "blend of {injected} tokens in a sequence of {end} computed, {} pending{}",
                seq.pending(),
                if seq.blend.is_some() { ", already blending" } else { "" }
            )));
        }
        if blend_rows(injected, ratio) > 0 {
            let tail = (focus as f64 * keep_count(ratio, injected) as f64).round() as usize;
            let start = end - injected;
            let fact_starts = std::iter::once(start)
                .chain(seq.fact_starts().iter().copied().filter(|&s| s > start && s < end))
                .collect();
            seq.blend = Some(BlendPlan { next: start, end, ratio, tail, select, fact_starts });
        }
        Ok(())
    }
}
