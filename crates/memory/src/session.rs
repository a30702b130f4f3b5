//! Answering from memory, assembled once: a [`Session`] owns the engine,
//! the embedder, the memory shard, the composer of the §3 layout
//! (`docs/design.md`) and the prefilled header, so that every caller — the
//! worker's engine thread, the vLLM connector's core, the CLI's `ask` and
//! `eval` — ingests, retrieves and lays out a request the same way, and
//! none of them wires encoders and composers together by hand.
//!
//! The model files are shared (`Arc`): the session keeps them for the
//! tokenizer (streamed detokenization) and the model's facts, with no
//! borrowed lifetimes to thread through its owners.

use std::sync::Arc;

use inferscale_engine::bert::Bert;
use inferscale_engine::{Backend, Engine, Sequence};
use inferscale_model::{ModelFiles, Tokenizer};
use inferscale_types::{MemoryUnit, Mode};

use crate::answer::{Prepared, prepare};
use crate::compose::{Composer, Prompts};
use crate::error::{MemoryError, Result};
use crate::retrieval::Query;
use crate::shard::{Encoders, IngestReport, Memory};

pub struct Session<B: Backend> {
    files: Arc<ModelFiles>,
    engine: Engine<B>,
    embedder: Bert<B>,
    memory: Memory<B>,
    composer: Composer,
    /// The header, prefilled once; every request forks it.
    header: Sequence,
}

impl<B: Backend> Session<B> {
    /// A session over `memory` with `prompts`' header, prefilled now. The
    /// memory's KV must have been made with the same system prompt (its
    /// `ShardSpec` says so; see [`crate::ShardSpec::new`]).
    pub fn new(
        files: Arc<ModelFiles>,
        mut engine: Engine<B>,
        embedder: Bert<B>,
        memory: Memory<B>,
        prompts: &Prompts,
    ) -> Result<Self> {
        let composer = Composer::new(&files, prompts)?;
        let mut header = engine.new_sequence(composer.header().to_vec())?;
        engine.prefill(&mut header)?;
        Ok(Session { files, engine, embedder, memory, composer, header })
    }

    pub fn files(&self) -> &Arc<ModelFiles> {
        &self.files
    }

    /// The model's tokenizer (a session's model always has one: the
    /// composer needs it).
    pub fn tokenizer(&self) -> &Tokenizer {
        self.composer.tokenizer()
    }

    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }

    /// The engine, for running the forward passes of laid-out requests.
    pub fn engine_mut(&mut self) -> &mut Engine<B> {
        &mut self.engine
    }

    pub fn embedder(&self) -> &Bert<B> {
        &self.embedder
    }

    pub fn memory(&self) -> &Memory<B> {
        &self.memory
    }

    pub fn memory_mut(&mut self) -> &mut Memory<B> {
        &mut self.memory
    }

    pub fn composer(&self) -> &Composer {
        &self.composer
    }

    /// The prefilled header every request starts from.
    pub fn header(&self) -> &Sequence {
        &self.header
    }

    /// Runs `f` with `other` (a memory of the same model and prompts) in
    /// place of this session's, then puts both back: an evaluation compares
    /// memories of several context windows on one loaded model.
    pub fn with_memory<R>(&mut self, other: &mut Memory<B>, f: impl FnOnce(&mut Self) -> R) -> R {
        std::mem::swap(&mut self.memory, other);
        let r = f(self);
        std::mem::swap(&mut self.memory, other);
        r
    }

    fn encoders(&mut self) -> (&mut Memory<B>, Encoders<'_, B>) {
        let enc = Encoders { engine: &mut self.engine, embedder: &self.embedder, composer: &self.composer };
        (&mut self.memory, enc)
    }

    /// Commits a staged shard in place of `user`'s copy here (see
    /// [`Memory::commit_import`]).
    pub fn commit_import(&mut self, user: &str, staged: crate::StagedShard) -> Result<crate::ImportReport> {
        self.memory.commit_import(self.engine.backend(), user, staged)
    }

    /// Checks that every one of `units` fits the model's context and a log
    /// record once encoded, storing nothing (see [`Memory::check_fits`]).
    pub fn check_fits(&self, units: &[MemoryUnit]) -> Result<()> {
        self.memory.check_fits(units, &self.composer)
    }

    /// Stores `units` for `user` (durably, before returning) and, unless
    /// `defer_kv`, encodes their KV; deferred KV is encoded when a request
    /// first needs it or by [`Session::encode_pending`].
    pub fn ingest(&mut self, user: &str, units: &[MemoryUnit], defer_kv: bool) -> Result<IngestReport> {
        let (memory, mut enc) = self.encoders();
        match defer_kv {
            true => memory.ingest_deferred(user, units, &mut enc),
            false => memory.ingest(user, units, &mut enc),
        }
    }

    /// Encodes up to `max` stored facts that have no KV yet (background
    /// work for an idle engine). Returns how many it encoded.
    pub fn encode_pending(&mut self, max: usize) -> Result<usize> {
        let (memory, mut enc) = self.encoders();
        memory.encode_pending(max, &mut enc)
    }

    /// Encodes whatever KV of `user`'s facts is missing (a replica's copy,
    /// an import without KV), so that kv mode can inject them all. Returns
    /// how many facts it encoded.
    pub fn ensure_kv(&mut self, user: &str) -> Result<usize> {
        let (memory, mut enc) = self.encoders();
        memory.ensure_kv(user, &mut enc)
    }

    /// `user`'s `k` best facts for `question`, best first, as indices into
    /// [`Memory::facts`]; none for a user without memory.
    pub fn retrieve(&mut self, user: &str, question: &str, k: usize) -> Result<Vec<usize>> {
        Ok(self.retrieve_many(user, &[question], k)?.pop().unwrap_or_default())
    }

    /// [`Session::retrieve`] for several questions of one user, their
    /// embeddings computed in one batch.
    pub fn retrieve_many(&mut self, user: &str, questions: &[&str], k: usize) -> Result<Vec<Vec<usize>>> {
        if questions.is_empty() || !self.memory.has_user(user) {
            return Ok(vec![Vec::new(); questions.len()]);
        }
        let backend = self.engine.backend();
        let embeddings = self.embedder.embed(backend, questions)?;
        if embeddings.len() != questions.len() {
            return Err(MemoryError::Invalid { what: "question", reason: "no embedding".into() });
        }
        questions
            .iter()
            .zip(&embeddings)
            .map(|(&text, embedding)| self.memory.retrieve(backend, user, Query { text, embedding }, k))
            .collect()
    }

    /// The question's tokens: instruction, question, end of the user turn.
    pub fn question(&self, text: &str) -> Result<Vec<u32>> {
        self.composer.question(text)
    }

    /// Lays out a request of `user`: the header forked, `facts` (indices,
    /// best first) injected or pasted as `mode` says, `question` pending.
    pub fn prepare(
        &mut self,
        user: &str,
        facts: &[usize],
        mode: Mode,
        blend_ratio: f32,
        question: &[u32],
    ) -> Result<Prepared> {
        prepare(&mut self.engine, &self.memory, user, facts, mode, blend_ratio, &self.header, question)
    }
}
