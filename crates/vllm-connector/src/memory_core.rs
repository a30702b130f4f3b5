//! The connector's core inside vLLM's worker process: the same memory shard
//! as a native worker (facts, pre-RoPE KV, retrieval), the prompt layout of
//! docs/design.md §3, the plans it issued, and the loads into vLLM's cache.
//!
//! Generic over our backend: on the CPU the stored KV is host memory,
//! written into host caches by [`crate::inject`]; on CUDA (feature `cuda`)
//! it stays in device memory and our fused kernel writes it into vLLM's
//! device cache on vLLM's stream. One core per worker process.

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use inferscale_engine::bert::Bert;
use inferscale_engine::{Backend, CpuBackend, Engine, EngineConfig, KvChunk};
use inferscale_memory::{
    Chat, IngestReport, Memory, MemoryUnit, Mode, Pinned, Prompts, Retriever, Scope, Session, ShardSpec,
};
use inferscale_model::{ModelFiles, RopeScaling, shapes};

use crate::error::{ConnectorError, Result};
use crate::inject::{CacheMut, Rows, write_layer};
use crate::layout::CacheView;
use crate::plan::{Chunk, ModelShape, PLAN_VERSION, Plan, prompt_salt, salt, shape_fingerprint, token_digest};

/// Plans remembered for loading; the oldest is dropped beyond this (its
/// request, if still unloaded, is then recomputed by vLLM).
pub const MAX_PLANS: usize = 65_536;

/// How to open a core.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// A GGUF file, an HF model directory or a packaged model name.
    pub model: String,
    /// Instead of `model`: random weights of a named shape (speed work,
    /// beside a vLLM loading dummy weights of the same shape).
    pub random_shape: Option<String>,
    /// The sentence embedder (`random` for speed work).
    pub embedder: String,
    /// The memory shard's directory (created if missing).
    pub memory_dir: PathBuf,
    /// Context window of fact encoding, in turns (0 = each fact alone).
    pub window: usize,
    /// Host KV cache of the encoding engine, in MiB.
    pub kv_cache_mb: usize,
    pub max_batch_tokens: usize,
    /// How facts are ranked for a question.
    pub retriever: Retriever,
    /// The system prompt of the header and the instruction before the
    /// question (a memory's KV is made with one system prompt).
    pub prompts: Prompts,
}

/// A composed request: the prompt vLLM is given and the plan in its params.
#[derive(Debug, Clone)]
pub struct Composed {
    pub prompt: Vec<u32>,
    pub plan: Plan,
    /// The `cache_salt` of the same prompt in prompt mode (no plan): never
    /// the plan's, so a prefill never reuses injected blocks.
    pub prompt_salt: String,
    /// Ids of the facts in the prompt, in prompt order.
    pub fact_ids: Vec<String>,
}

pub struct Core<B: Backend> {
    /// Engine, embedder, memory shard and composer: the same session a
    /// native worker answers with.
    session: Session<B>,
    header_kv: KvChunk<B>,
    shape: ModelShape,
    fingerprint: String,
    /// Bumped by every ingest and forget of a user: part of the salt, so
    /// vLLM's cached blocks of the old memory are never hit again.
    generation: HashMap<String, u64>,
    /// Plans issued and not finished, each with its facts' KV pinned in
    /// the memory's cache until then.
    plans: HashMap<String, (Plan, Option<Pinned<B>>)>,
    /// Plan ids in issue order, for the [`MAX_PLANS`] bound; ids of plans
    /// already finished stay until they reach the front.
    order: VecDeque<String>,
    /// Memory tokens written per plan, for plans whose issuer asked to
    /// know ([`Core::compose_tracked`]); taken by [`Core::take_loaded`].
    loaded: HashMap<String, usize>,
}

impl<B: Backend> Core<B> {
    pub fn open(cfg: &CoreConfig, backend: B) -> Result<Core<B>> {
        let files = match &cfg.random_shape {
            Some(name) => {
                let config = shapes::preset(name).ok_or_else(|| ConnectorError::Invalid {
                    what: "random_shape",
                    reason: format!("`{name}` is not a known shape"),
                })?;
                ModelFiles::random(name, config, 0).with_byte_tokenizer()?
            }
            None => inferscale_model::open(&cfg.model)?,
        };
        let engine_cfg = EngineConfig::with_kv_bytes(
            &files,
            cfg.kv_cache_mb << 20,
            cfg.max_batch_tokens,
            backend.kv_bytes_per_value(),
        );
        let engine = Engine::new(backend, &files, engine_cfg)?;
        let embedder = Bert::load(engine.backend(), inferscale_model::encoder::open(&cfg.embedder)?)?;
        let spec = ShardSpec::new(&files, cfg.window, &cfg.prompts)?;
        let (mut memory, warnings) = Memory::open(&cfg.memory_dir, spec, &engine)?;
        memory.set_retriever(cfg.retriever);
        for w in warnings {
            eprintln!("inferscale-vllm: warning: {w}");
        }
        let shape = model_shape(&files);
        let mut session = Session::new(Arc::new(files), engine, embedder, memory, &cfg.prompts)?;
        // The header at position 0 with nothing before it: its pre-RoPE KV is
        // exactly what a prefill of the prompt's first tokens computes (E2).
        let header = session.composer().header().to_vec();
        let header_kv = session.engine_mut().encode(&[], &header, 0)?;
        let fingerprint = shape_fingerprint(&shape);
        Ok(Core {
            session,
            header_kv,
            shape,
            fingerprint,
            generation: HashMap::new(),
            plans: HashMap::new(),
            order: VecDeque::new(),
            loaded: HashMap::new(),
        })
    }

    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The model files (the gRPC front detokenizes vLLM's output with
    /// their tokenizer, without the lock).
    pub fn files(&self) -> &Arc<ModelFiles> {
        self.session.files()
    }

    /// The memory shard (read-only: every write goes through the core, which
    /// keeps the salts' generations).
    pub fn memory(&self) -> &Memory<B> {
        self.session.memory()
    }

    pub fn backend(&self) -> &B {
        self.session.engine().backend()
    }

    /// The session the worker protocol carries memory commands out on
    /// (`inferscale_worker::Shard`); the front reports each change of a
    /// user's memory back through [`Core::memory_changed`].
    pub fn session_mut(&mut self) -> &mut Session<B> {
        &mut self.session
    }

    /// Stores `turns` for `user` (durably, before returning) and encodes their KV.
    pub fn ingest(&mut self, user: &str, turns: &[MemoryUnit]) -> Result<IngestReport> {
        let report = self.session.ingest(user, turns, false)?;
        if report.added > 0 {
            self.memory_changed(user);
        }
        Ok(report)
    }

    /// Forgets one fact of `user`, or all of them.
    pub fn forget(&mut self, user: &str, fact: Option<&str>) -> Result<()> {
        self.session.forget(user, fact)?;
        self.memory_changed(user);
        Ok(())
    }

    /// A new memory generation for `user` (its units stored, changed,
    /// removed or replaced): plans of the old one no longer match the salt,
    /// so vLLM's cached blocks of it are never hit again.
    pub fn memory_changed(&mut self, user: &str) {
        *self.generation.entry(user.to_string()).or_default() += 1;
    }

    /// Facts `user` has.
    pub fn facts(&self, user: &str) -> usize {
        self.memory().facts(user).map_or(0, |f| f.len())
    }

    /// Retrieves `user`'s `k` best facts for the chat's question, lays out
    /// header, facts (least relevant first) and the chat's tail (history,
    /// question), and issues the plan that injects header and facts. The
    /// prompt-mode baseline is the same prompt with no plan: identical token
    /// ids at identical positions.
    ///
    /// The header is always the configured system prompt's (a request's own
    /// system prompt follows the memory block, docs/design.md §3): vLLM
    /// loads KV for a prefix of the prompt only, and the header leads it.
    /// A completion's raw prompt has no such header, so it is refused.
    pub fn compose(&mut self, user: &str, chat: &Chat, scope: &Scope, k: usize) -> Result<Composed> {
        if chat.raw {
            return Err(ConnectorError::Invalid {
                what: "request",
                reason: "a completion with memory needs the native engine; this worker serves with vLLM".into(),
            });
        }
        let q_tokens = self.session.tail(chat, Mode::Kv)?;
        let best = if k > 0 { self.session.retrieve_in(user, &chat.question, k, scope)? } else { Vec::new() };
        let mut prompt = self.session.composer().header().to_vec();
        let mut chunks = vec![Chunk { fact: None, start: 0, len: prompt.len() }];
        let mut fact_ids = Vec::with_capacity(best.len());
        let mut pinned = None;
        if !best.is_empty() {
            pinned = Some(self.session.fetch(user, &best)?.0);
            let facts = self.session.memory().facts(user)?;
            for &i in best.iter().rev() {
                let f = &facts[i];
                chunks.push(Chunk { fact: Some(f.unit.id.clone()), start: prompt.len(), len: f.tokens.len() });
                prompt.extend_from_slice(&f.tokens);
                fact_ids.push(f.unit.id.clone());
            }
        }
        let end = prompt.len();
        prompt.extend_from_slice(&q_tokens);
        self.issue(user, prompt, end, chunks, pinned, fact_ids)
    }

    /// A request without memory: the chat as the model's template renders
    /// the client's messages (a completion: its prompt), nothing added, and
    /// a plan that loads nothing (it is never sent to vLLM).
    pub fn compose_plain(&mut self, user: &str, chat: &Chat) -> Result<Composed> {
        let prompt = self.session.tail(chat, Mode::None)?;
        self.issue(user, prompt, 0, Vec::new(), None, Vec::new())
    }

    /// Issues the plan for `prompt`, whose first `memory_end` tokens are
    /// the injected prefix tiled by `chunks` (their KV pinned by `pinned`
    /// until the plan finishes), salted with `user`'s memory generation.
    fn issue(
        &mut self,
        user: &str,
        prompt: Vec<u32>,
        memory_end: usize,
        chunks: Vec<Chunk>,
        pinned: Option<Pinned<B>>,
        fact_ids: Vec<String>,
    ) -> Result<Composed> {
        let generation = self.generation.get(user).copied().unwrap_or(0);
        let plan = Plan {
            v: PLAN_VERSION,
            id: random_id()?,
            user: user.to_string(),
            fingerprint: self.fingerprint.clone(),
            salt: salt(user, generation, &self.fingerprint, &chunks),
            digest: token_digest(&prompt[..memory_end]),
            chunks,
        };
        self.remember(plan.clone(), pinned);
        let prompt_salt = prompt_salt(user, generation, &self.fingerprint);
        Ok(Composed { prompt, plan, prompt_salt, fact_ids })
    }

    /// [`Core::compose`] (`k` facts; `None`: [`Core::compose_plain`]),
    /// counting the memory tokens its loads write (for the request's
    /// usage): [`Core::take_loaded`] reads and drops the count.
    pub fn compose_tracked(&mut self, user: &str, chat: &Chat, scope: &Scope, k: Option<usize>) -> Result<Composed> {
        let c = match k {
            Some(k) => self.compose(user, chat, scope, k)?,
            None => self.compose_plain(user, chat)?,
        };
        self.loaded.insert(c.plan.id.clone(), 0);
        Ok(c)
    }

    /// Memory tokens the loads of a tracked plan wrote (0 when vLLM found
    /// them all in its prefix cache or refused the plan), once.
    pub fn take_loaded(&mut self, plan_id: &str) -> usize {
        self.loaded.remove(plan_id).unwrap_or(0)
    }

    fn note_loaded(&mut self, plan: &Plan, from: usize) {
        if let Some(n) = self.loaded.get_mut(&plan.id) {
            *n += plan.end().saturating_sub(from);
        }
    }

    fn remember(&mut self, plan: Plan, pinned: Option<Pinned<B>>) {
        // Finished plans' ids are dropped here, not in `finish` (which would
        // scan the queue at every request's end).
        while self.order.front().is_some_and(|id| !self.plans.contains_key(id)) {
            self.order.pop_front();
        }
        if self.order.len() >= MAX_PLANS
            && let Some(old) = self.order.pop_front()
        {
            self.plans.remove(&old);
        }
        self.order.push_back(plan.id.clone());
        self.plans.insert(plan.id.clone(), (plan, pinned));
    }

    /// Forgets an issued plan (its request finished).
    pub fn finish(&mut self, plan_id: &str) {
        self.plans.remove(plan_id);
    }

    /// The stored KV of each of `plan`'s chunks, once `plan` is found to be
    /// one this core issued, unchanged, for a cache of `layers` layers.
    fn plan_kv(&self, plan: &Plan, layers: usize) -> Result<Vec<&KvChunk<B>>> {
        match self.plans.get(&plan.id) {
            Some((issued, _)) if issued == plan => {}
            Some(_) => return Err(ConnectorError::Plan(format!("plan {} differs from the one issued", plan.id))),
            None => return Err(ConnectorError::Plan(format!("plan {} was not issued by this worker", plan.id))),
        }
        let n = self.shape.num_layers;
        if layers != n {
            return Err(ConnectorError::Layout(format!("{layers} cache layers registered, the model has {n}")));
        }
        plan.chunks.iter().map(|c| self.chunk_kv(&plan.user, c)).collect()
    }

    fn chunk_kv(&self, user: &str, c: &Chunk) -> Result<&KvChunk<B>> {
        let kv = match &c.fact {
            None => &self.header_kv,
            Some(id) => {
                let i = self
                    .memory()
                    .fact_index(user, id)?
                    .ok_or_else(|| ConnectorError::Plan(format!("{user:?} has no fact {id:?} any more")))?;
                self.memory()
                    .kv(user, i)?
                    .ok_or_else(|| ConnectorError::Plan(format!("fact {id:?} of {user:?} has no KV yet")))?
            }
        };
        if kv.len() != c.len {
            return Err(ConnectorError::Plan(format!(
                "chunk {:?}: {} tokens stored, {} planned",
                c.fact,
                kv.len(),
                c.len
            )));
        }
        Ok(kv)
    }

    /// The KV a prompt prefill of `tokens` alone at positions `start..`
    /// leaves in the cache, per layer `(K, V)` as `[tokens, kv_dim]` with K
    /// rotated: the reference the connector's loads are checked against
    /// (a chunk encoded on its own is the block-diagonal mask's KV, E3).
    pub fn reference_kv(&mut self, tokens: &[u32], start: u32) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let engine = self.session.engine_mut();
        let mut seq = engine.new_sequence_at(tokens.to_vec(), start)?;
        engine.prefill(&mut seq)?;
        (0..self.shape.num_layers)
            .map(|l| {
                let (k, v) = engine.cached_kv(&seq, l)?;
                Ok((k.data, v.data))
            })
            .collect()
    }
}

impl Core<CpuBackend> {
    /// Writes `plan`'s KV at positions `from..end` into `layers` (vLLM's host
    /// caches in layer order) at the slots of `block_ids`. `plan` must be
    /// one this core issued, unchanged; every layer is checked before the
    /// first write.
    pub fn load(
        &mut self,
        plan: &Plan,
        layers: &mut [(CacheMut<'_>, CacheView)],
        block_ids: &[u32],
        from: usize,
    ) -> Result<()> {
        let chunks = self.plan_kv(plan, layers.len())?;
        for (l, (cache, view)) in layers.iter_mut().enumerate() {
            let rows: Vec<Rows<'_>> = chunks
                .iter()
                .zip(&plan.chunks)
                .map(|(kv, c)| Rows { k: &kv.k[l].data, v: &kv.v[l].data, start: c.start })
                .collect();
            write_layer(cache, view, self.session.engine().model().rope(), &rows, block_ids, from)?;
        }
        self.note_loaded(plan, from);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl Core<inferscale_cuda::CudaBackend> {
    /// [`Core::load`] into vLLM's device caches (`bases[l]`: layer l's data
    /// pointer, every layer addressed by `view`), by our fused kernel on
    /// `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the device's primary context and
    /// each base a live bf16 allocation that `view` addresses; vLLM orders
    /// its own work on that stream.
    pub unsafe fn load_device(
        &mut self,
        plan: &Plan,
        bases: &[u64],
        view: &CacheView,
        block_ids: &[u32],
        from: usize,
        stream: u64,
    ) -> Result<()> {
        use inferscale_cuda::{ExternalCache, ExternalChunk};
        if view.dtype != crate::layout::DType::BF16 || view.strides.dim != 1 {
            return Err(ConnectorError::Unsupported(format!(
                "device caches must be bfloat16 with contiguous head dimensions ({:?}, dim stride {})",
                view.dtype, view.strides.dim
            )));
        }
        let chunks = self.plan_kv(plan, bases.len())?;
        let bs = view.geometry.block_size;
        let mut rows = Vec::with_capacity(chunks.len());
        for c in &plan.chunks {
            let first = from.clamp(c.start, c.start + c.len);
            let (mut positions, mut slots) = (Vec::new(), Vec::new());
            for p in first..c.start + c.len {
                let block = *block_ids.get(p / bs).ok_or_else(|| {
                    ConnectorError::Plan(format!("position {p} is past the request's {} blocks", block_ids.len()))
                })? as usize;
                if block >= view.num_blocks {
                    return Err(ConnectorError::Plan(format!(
                        "block {block} of a cache of {} blocks",
                        view.num_blocks
                    )));
                }
                positions.push(p as u32);
                slots.push((block * bs + p % bs) as u32);
            }
            rows.push((first - c.start, positions, slots));
        }
        let ext: Vec<ExternalChunk<'_>> = chunks
            .iter()
            .zip(&rows)
            .filter(|(_, (_, p, _))| !p.is_empty())
            .map(|(kv, (first, positions, slots))| ExternalChunk {
                k: &kv.k,
                v: &kv.v,
                first_row: *first,
                positions,
                slots,
            })
            .collect();
        let s = view.strides;
        let cache = ExternalCache {
            bases: bases.to_vec(),
            num_blocks: view.num_blocks,
            block_size: bs,
            kv_heads: view.geometry.kv_heads,
            head_dim: view.geometry.head_dim,
            s_block: s.block,
            s_slot: s.slot,
            s_head: s.head,
            s_kv: s.kv,
        };
        let engine = self.session.engine();
        // SAFETY: forwarded from the caller.
        unsafe { engine.backend().inject_external(&cache, &ext, engine.model().rope(), stream)? };
        self.note_loaded(plan, from);
        Ok(())
    }
}

/// A core on whichever backend it was opened with: what the PyO3 module
/// and the gRPC front share (behind one lock).
pub enum AnyCore {
    Cpu(Box<Core<CpuBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<Core<inferscale_cuda::CudaBackend>>),
}

impl AnyCore {
    /// The backend's name, as a worker's health answer gives it.
    pub fn backend_name(&self) -> &'static str {
        match self {
            AnyCore::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            AnyCore::Cuda(_) => "cuda",
        }
    }
}

/// The name vLLM's HF config gives a RoPE scaling (`rope_type`).
pub fn rope_type(s: &RopeScaling) -> &'static str {
    match s {
        RopeScaling::None => "default",
        RopeScaling::Linear { .. } => "linear",
        RopeScaling::Llama3 { .. } => "llama3",
        // Per-frequency divisors from a GGUF file: no HF counterpart, so it
        // never matches an engine's shape and nothing is injected.
        RopeScaling::Divisors(_) => "gguf-divisors",
    }
}

fn model_shape(files: &ModelFiles) -> ModelShape {
    let c = &files.config;
    ModelShape {
        architecture: inferscale_model::export::architecture(c.family).into(),
        num_layers: c.num_layers,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        hidden_size: c.hidden_size,
        vocab_size: c.vocab_size,
        rope_theta: c.rope.theta,
        rotary_dim: c.rope.dim,
        rope_type: rope_type(&c.rope.scaling).into(),
    }
}

/// 128 random bits, hex: unguessable, so a client cannot name another
/// request's plan.
fn random_id() -> Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|source| ConnectorError::Io { what: "reading /dev/urandom".into(), source })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}
