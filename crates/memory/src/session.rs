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
use inferscale_types::{MemoryUnit, Mode, Scope};

use crate::answer::{Facts, Prepared, prepare};
use crate::compose::{Chat, Composer, Prompts};
use crate::edit::{UnitUpdate, UpdateReport};
use crate::error::{MemoryError, Result};
use crate::fetch::{FetchReport, Fetched, Pinned, ReadDone};
use crate::retrieval::Query;
use crate::shard::{IngestReport, Memory};
use crate::user::Encoders;

/// One search result: a fact (an index into [`Memory::facts`]) and its
/// score, the cosine similarity of its embedding and the query's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub index: usize,
    pub score: f32,
}

/// Questions embedded in one forward pass at most: a restart's burst of
/// hundreds of arrivals is embedded a few passes at a time, its activations
/// bounded.
pub const QUESTION_BATCH: usize = 32;

pub struct Session<B: Backend> {
    files: Arc<ModelFiles>,
    engine: Engine<B>,
    embedder: Bert<B>,
    memory: Memory<B>,
    composer: Composer,
    /// The configured system prompt's header, prefilled once; every chat
    /// with memory forks it (a client's own system prompt follows the
    /// memory block, so no other header is ever needed: docs/design.md §3).
    header: Sequence,
    /// A completion's header (the tokenizer's start tokens, possibly
    /// none), prefilled once.
    raw_header: Sequence,
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
        let start = composer.raw_header()?;
        let raw_header = match start.is_empty() {
            true => engine.empty_sequence(),
            false => {
                let mut seq = engine.new_sequence(start)?;
                engine.prefill(&mut seq)?;
                seq
            }
        };
        Ok(Session { files, engine, embedder, memory, composer, header, raw_header })
    }

    /// Tokens of the header a request is laid out under: none without
    /// memory (the whole prompt is computed), a completion's start tokens,
    /// or the configured header.
    pub fn header_len(&self, chat: &Chat, mode: Mode) -> usize {
        match (mode, chat.raw) {
            (Mode::None, _) => 0,
            (_, true) => self.raw_header.len(),
            (_, false) => self.header.len(),
        }
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
        self.memory.commit_import(user, staged)
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

    /// Starts an all-or-nothing ingest of one request's `units` for `user`,
    /// before its first batch (see [`Memory::begin_ingest`]): a crash before
    /// [`Session::end_ingest`] commits it removes, at the next start, what
    /// its batches stored.
    pub fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()> {
        self.memory.begin_ingest(user, units)
    }

    /// Ends the ingest begun for `user`: `commit` keeps what its batches
    /// stored; otherwise it is removed, with the KV derived from it. Returns
    /// whether units went away — removed, or hidden by an undo that failed
    /// and is retried ([`Memory::abort_ingest`]) — with the undo's error.
    pub fn end_ingest(&mut self, user: &str, commit: bool) -> (bool, Result<()>) {
        if commit {
            return (false, self.memory.commit_ingest(user));
        }
        match self.memory.abort_ingest(user) {
            Ok(removed) => (removed > 0, Ok(())),
            Err(e) => (true, Err(e)),
        }
    }

    /// Forgets one unit of `user`, or all of them.
    pub fn forget(&mut self, user: &str, unit: Option<&str>) -> Result<()> {
        self.memory.forget(user, unit)
    }

    /// Removes `user`, who moved away; nothing to do for a user not here.
    pub fn drop_user(&mut self, user: &str) -> Result<()> {
        match self.memory.has_user(user) {
            true => self.memory.forget_user(user),
            false => Ok(()),
        }
    }

    /// Changes one unit of `user` (see [`Memory::update`]); with
    /// `defer_kv` (a replica's copy) a new text's KV is encoded when first
    /// needed.
    pub fn update(&mut self, user: &str, id: &str, change: &UnitUpdate, defer_kv: bool) -> Result<UpdateReport> {
        let (memory, mut enc) = self.encoders();
        memory.update(user, id, change, &mut enc, !defer_kv)
    }

    /// Encodes up to `max` stored facts that have no KV yet (background
    /// work for an idle engine). Returns how many it encoded.
    pub fn encode_pending(&mut self, max: usize) -> Result<usize> {
        let (memory, mut enc) = self.encoders();
        memory.encode_pending(max, &mut enc)
    }

    /// Makes the KV of `user`'s facts `idxs` resident and pins it while
    /// the returned [`Pinned`] lives ([`Memory::fetch`]: facts on disk are
    /// read now), encoding first what has none (never encoded, or a record
    /// that failed its check).
    pub fn fetch(&mut self, user: &str, idxs: &[usize]) -> Result<(Pinned<B>, FetchReport)> {
        let got = self.fetch_with(user, idxs, true, true)?;
        Ok((got.pinned, got.report))
    }

    /// [`Session::fetch`], reading facts whose KV is on disk only when
    /// `read`; otherwise they come back in `cold` (see
    /// [`Memory::fetch_cached`]). Facts with no KV at all are encoded when
    /// `encode` (those of `idxs` only), else come back in `missing`.
    pub fn fetch_with(&mut self, user: &str, idxs: &[usize], read: bool, encode: bool) -> Result<Fetched<B>> {
        let mut got = self.fetch_once(user, idxs, read)?;
        if got.missing.is_empty() || !encode {
            return Ok(got);
        }
        let missing = std::mem::take(&mut got.missing);
        let (memory, mut enc) = self.encoders();
        memory.encode_facts(user, &missing, &mut enc)?;
        let again = self.fetch_once(user, &missing, read)?;
        if let Some(&i) = again.missing.first() {
            let id = self.memory.facts(user)?.get(i).map(|f| f.unit.id.clone()).unwrap_or_default();
            return Err(MemoryError::Invalid { what: "memory", reason: format!("fact {id:?} of {user:?} has no KV") });
        }
        got.pinned.extend(again.pinned);
        got.report.add(again.report);
        got.cold.extend(again.cold);
        Ok(got)
    }

    fn fetch_once(&mut self, user: &str, idxs: &[usize], read: bool) -> Result<Fetched<B>> {
        let be = self.engine.backend();
        match read {
            true => self.memory.fetch(be, user, idxs),
            false => self.memory.fetch_cached(user, idxs),
        }
    }

    /// Caches what a background read of a fact's KV read
    /// ([`Memory::complete_read`]).
    pub fn complete_read(&mut self, done: ReadDone<B>) -> Result<bool> {
        self.memory.complete_read(self.engine.backend(), done)
    }

    /// [`Session::fetch`] for a request being laid out in `mode`, when its
    /// facts are not all resident already (a caller that fetched them at
    /// admission holds them).
    fn fetch_for(&mut self, user: &str, facts: &[usize], mode: Mode) -> Result<Option<Pinned<B>>> {
        if !mode.injects() || facts.is_empty() || self.memory.resident(user, facts)? {
            return Ok(None);
        }
        Ok(Some(self.fetch(user, facts)?.0))
    }

    /// Encodes whatever KV of `user`'s facts is missing (a replica's copy,
    /// an import without KV), so that kv mode can inject them all. Returns
    /// how many facts it encoded.
    pub fn ensure_kv(&mut self, user: &str) -> Result<usize> {
        let (memory, mut enc) = self.encoders();
        memory.ensure_kv(user, &mut enc)
    }

    /// Sentence embeddings of `texts` by the retrieval encoder, and the
    /// tokens it read (each text cut to the encoder's length, as
    /// sentence-transformers does). Encoded a batch at a time, so a large
    /// request does not make one huge forward pass.
    pub fn embed(&self, texts: &[String]) -> Result<(Vec<Vec<f32>>, usize)> {
        const BATCH: usize = 32;
        let ids = texts.iter().map(|t| self.embedder.tokenize(t)).collect::<std::result::Result<Vec<_>, _>>()?;
        let tokens = ids.iter().map(Vec::len).sum();
        let mut vectors = Vec::with_capacity(ids.len());
        for batch in ids.chunks(BATCH) {
            vectors.extend(self.embedder.embed_ids(self.engine.backend(), batch)?);
        }
        Ok((vectors, tokens))
    }

    /// `user`'s facts for `query` in the retriever's order (the one chat
    /// requests use), those in `scope` whose metadata passes `filters`
    /// ([`crate::filter_matches`]) and whose score reaches `threshold`, at
    /// most `top_k`. The score is the cosine similarity of the query's and
    /// the fact's embeddings (`search.rs`). A user without memory has no
    /// results; a malformed filter is an error either way.
    pub fn search(
        &self,
        user: &str,
        query: &str,
        top_k: usize,
        threshold: Option<f32>,
        filters: &serde_json::Map<String, serde_json::Value>,
        scope: &Scope,
    ) -> Result<Vec<Hit>> {
        crate::search::matches(&serde_json::Map::new(), filters)?;
        let facts = match self.memory.has_user(user) {
            true => self.memory.facts(user)?,
            false => return Ok(Vec::new()),
        };
        if facts.is_empty() || top_k == 0 {
            return Ok(Vec::new());
        }
        let backend = self.engine.backend();
        let embedding = self.embedder.embed(backend, &[query])?.pop().unwrap_or_default();
        let order = self.memory.retrieve(backend, user, Query { text: query, embedding: &embedding }, facts.len())?;
        let mut hits = Vec::new();
        for index in order {
            let f = &facts[index];
            let score = crate::search::score(&embedding, &f.embedding);
            let outside = threshold.is_some_and(|t| score < t) || !scope.contains(&f.unit);
            if outside || !crate::search::matches(&f.unit.metadata, filters)? {
                continue;
            }
            hits.push(Hit { index, score });
            if hits.len() == top_k {
                break;
            }
        }
        Ok(hits)
    }

    /// `user`'s `k` best facts for `question`, best first, as indices into
    /// [`Memory::facts`]; none for a user without memory.
    pub fn retrieve(&mut self, user: &str, question: &str, k: usize) -> Result<Vec<usize>> {
        Ok(self.retrieve_many(user, &[question], k)?.pop().unwrap_or_default())
    }

    /// [`Session::retrieve`] among the units of `scope` only (one agent's,
    /// one run's): the retriever ranks all of the user's facts, the first
    /// `k` in scope are kept.
    pub fn retrieve_in(&mut self, user: &str, question: &str, k: usize, scope: &Scope) -> Result<Vec<usize>> {
        if !self.memory.has_user(user) {
            return Ok(Vec::new());
        }
        let embedding = self.embed_questions(&[question])?.pop().unwrap_or_default();
        self.retrieve_embedded(user, question, &embedding, k, scope)
    }

    /// The retrieval encoder's embeddings of `questions`, a batch of up to
    /// [`QUESTION_BATCH`] a forward pass: a serving engine embeds the
    /// questions that arrived together at once (the encoder's pass costs
    /// mostly its launches, whatever the batch) and retrieves for each with
    /// [`Session::retrieve_embedded`].
    pub fn embed_questions(&self, questions: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.embed_in_passes(questions, QUESTION_BATCH)
    }

    /// Embeddings of `questions`, `per_pass` to a forward pass; one per
    /// question or an error.
    fn embed_in_passes(&self, questions: &[&str], per_pass: usize) -> Result<Vec<Vec<f32>>> {
        let mut embeddings = Vec::with_capacity(questions.len());
        for batch in questions.chunks(per_pass.max(1)) {
            embeddings.extend(self.embedder.embed(self.engine.backend(), batch)?);
        }
        if embeddings.len() != questions.len() {
            return Err(MemoryError::Invalid { what: "question", reason: "no embedding".into() });
        }
        Ok(embeddings)
    }

    /// [`Session::retrieve_in`] for a question already embedded
    /// ([`Session::embed_questions`]).
    pub fn retrieve_embedded(
        &self,
        user: &str,
        question: &str,
        embedding: &[f32],
        k: usize,
        scope: &Scope,
    ) -> Result<Vec<usize>> {
        if !self.memory.has_user(user) {
            return Ok(Vec::new());
        }
        let (backend, query) = (self.engine.backend(), Query { text: question, embedding });
        if scope.is_all() {
            return self.memory.retrieve(backend, user, query, k);
        }
        let n = self.memory.facts(user).map_or(0, <[_]>::len);
        if n == 0 {
            return Ok(Vec::new());
        }
        let order = self.memory.retrieve(backend, user, query, n)?;
        let facts = self.memory.facts(user)?;
        Ok(order.into_iter().filter(|&i| scope.contains(&facts[i].unit)).take(k).collect())
    }

    /// [`Session::retrieve`] for several questions of one user, their
    /// embeddings computed in one batch.
    pub fn retrieve_many(&mut self, user: &str, questions: &[&str], k: usize) -> Result<Vec<Vec<usize>>> {
        if questions.is_empty() || !self.memory.has_user(user) {
            return Ok(vec![Vec::new(); questions.len()]);
        }
        // One pass for all of them, as the evaluations were measured.
        let embeddings = self.embed_in_passes(questions, questions.len())?;
        let backend = self.engine.backend();
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

    /// What a request computes after its header: with memory, what follows
    /// the memory block (its system prompt and earlier turns, the question:
    /// [`Composer::tail`]); without, its whole prompt ([`Composer::plain`]).
    pub fn tail(&self, chat: &Chat, mode: Mode) -> Result<Vec<u32>> {
        match mode {
            Mode::None => self.composer.plain(chat),
            _ => self.composer.tail(chat),
        }
    }

    /// Lays out a request of `facts.user` under the configured header:
    /// the header forked, the facts injected or pasted as their recall
    /// says, `question` (a tail) pending.
    pub fn prepare(&mut self, facts: Facts<'_>, question: &[u32]) -> Result<Prepared> {
        self.prepare_chat(&Chat::default(), facts, question)
    }

    /// Lays out one request of `chat`, `tail` being [`Session::tail`]'s:
    /// without memory a fresh sequence of its whole prompt; a completion
    /// after the start tokens; a chat after the configured header. Facts
    /// whose KV is needed are fetched first (`facts.paste` are not).
    pub fn prepare_chat(&mut self, chat: &Chat, facts: Facts<'_>, tail: &[u32]) -> Result<Prepared> {
        if facts.recall.mode == Mode::None {
            let seq = self.engine.new_sequence(tail.to_vec())?;
            return Ok(Prepared {
                seq,
                fact_ids: Vec::new(),
                memory_tokens: 0,
                pasted_tokens: 0,
                header_tokens: 0,
                header_cached: false,
            });
        }
        let inject: Vec<usize> = facts.order.iter().copied().filter(|i| !facts.paste.contains(i)).collect();
        let _held = self.fetch_for(facts.user, &inject, facts.recall.mode)?;
        let header = if chat.raw { &self.raw_header } else { &self.header };
        prepare(&mut self.engine, &self.memory, header, facts, tail)
    }
}
