//! The memory commands, written once over [`Session`] for every engine:
//! the native engine thread and the vLLM connector hand the protocol their
//! session through [`super::MemoryHost::with_shard`], and each command is
//! carried out here, the same code for both. What the hosts must do beside
//! a change of a user's memory (fail requests that retrieved from it,
//! start a new prefix-cache generation) they do in
//! [`super::MemoryHost::memory_changed`], which the protocol calls.

use std::path::PathBuf;

use inferscale_engine::Backend;
use inferscale_memory::{
    Event as UnitEvent, Footprint, ImportReport, IngestReport, KvHeader, MemoryUnit, Scope, Session, ShardRecord,
    StagedShard, UnitUpdate, UpdateReport,
};
use inferscale_types::StoredUnit;

use crate::error::Result;

/// What a memory shard holds, for [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holdings {
    pub users: usize,
    pub facts: usize,
    /// Users refused because their stored memory is damaged, and users
    /// whose failed ingest is still being undone.
    pub damaged_users: usize,
    pub unsettled_users: usize,
    /// Users not read from disk yet (a memory opened lazily): `facts` and
    /// the footprint's disk bytes count the others.
    pub unread_users: usize,
    /// Bytes per tier, when asked for (O(facts) to measure).
    pub footprint: Option<Footprint>,
}

/// Sentence embeddings of a request's texts, in order, and the tokens the
/// encoder read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub tokens: usize,
}

/// A memory search (`/v1/memories/search`): `user`'s units for `query`.
#[derive(Debug, Clone, Default)]
pub struct SearchQuery {
    pub user: String,
    pub query: String,
    pub top_k: usize,
    /// Results score at least this (cosine similarity).
    pub threshold: Option<f32>,
    /// Metadata filters (`inferscale_memory::filter_matches`).
    pub filters: serde_json::Map<String, serde_json::Value>,
    /// Only units of this agent / run.
    pub scope: Scope,
}

/// Most results one search may ask for.
pub const MAX_SEARCH_TOP_K: usize = 1000;

/// Most texts one embeddings request may carry (OpenAI's limit).
pub const MAX_EMBED_INPUTS: usize = 2048;

/// A memory shard as the protocol uses it (object-safe: a host may hold
/// sessions of several backends). Every input has passed the protocol's
/// checks.
pub trait Shard {
    /// The context window (in turns) the shard's KV is encoded with.
    fn window(&self) -> usize;

    /// Sentence embeddings of `texts` (each non-empty) by the retrieval
    /// encoder.
    fn embed(&self, texts: &[String]) -> Result<Embedded>;

    /// A user's units for a search, each with its score, best first.
    fn search(&self, q: &SearchQuery) -> Result<Vec<(StoredUnit, f32)>>;

    /// Changes one unit of `user`; requests laid out later use the new one.
    fn update(&mut self, user: &str, id: &str, change: &UnitUpdate, defer_kv: bool) -> Result<UpdateReport>;

    /// One unit's history, oldest first.
    fn history(&self, user: &str, id: &str) -> Result<Vec<UnitEvent>>;

    /// Checks that every one of `units` can be encoded and stored, storing
    /// nothing: a request is refused whole before any of it is stored.
    fn check_fits(&self, units: &[MemoryUnit]) -> Result<()>;

    /// Stores a few of `user`'s validated units and, unless `defer_kv`,
    /// encodes their KV (the protocol splits large ingests into batches).
    fn ingest(&mut self, user: &str, units: &[MemoryUnit], defer_kv: bool) -> Result<IngestReport>;

    /// Starts the all-or-nothing ingest of one request ([`Session::begin_ingest`]).
    fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()>;

    /// Commits or removes the ingest begun for `user`
    /// ([`Session::end_ingest`]): whether units went away, and the error.
    fn end_ingest(&mut self, user: &str, commit: bool) -> (bool, Result<()>);

    /// `user`'s stored units, in order, with when each was stored and
    /// last changed.
    fn units(&self, user: &str) -> Result<Vec<StoredUnit>>;

    /// Forgets one unit of `user`, or all of them.
    fn forget(&mut self, user: &str, unit: Option<&str>) -> Result<()>;

    /// What the shard holds (with its bytes per tier when `footprint`).
    fn holdings(&self, footprint: bool) -> Holdings;

    /// Every user held here and, in the same order, the digest of each
    /// one's units (the leader replaces a replica whose digest differs from
    /// the home's) — no digests while a restarted memory still has users
    /// it has not read: reading them all at once would hold up serving, and
    /// the leader waits for digests it lacks rather than guess.
    fn users(&self) -> (Vec<String>, Vec<u64>);

    /// `user`'s fact ids in order (empty for an unknown user).
    fn fact_ids(&self, user: &str) -> Vec<String>;

    /// The shard's KV header and `user`'s fact ids: the start of an export.
    fn export_begin(&self, user: &str) -> Result<(KvHeader, Vec<String>)>;

    /// Transfer records for a prefix of `ids` (about `max_bytes`), and how
    /// many ids they cover.
    fn export(&self, user: &str, ids: &[String], with_kv: bool, max_bytes: usize) -> Result<(Vec<ShardRecord>, usize)>;

    /// Where imports are staged, and the KV header a shard must match.
    fn import_target(&self) -> Result<(PathBuf, KvHeader)>;

    /// Commits a staged shard in place of `user`'s copy.
    fn commit_import(&mut self, user: &str, staged: StagedShard) -> Result<ImportReport>;

    /// Removes `user`, who moved away (nothing to do for a user not here).
    fn drop_user(&mut self, user: &str) -> Result<()>;
}

impl<B: Backend> Shard for Session<B> {
    fn window(&self) -> usize {
        self.memory().spec().window
    }

    fn embed(&self, texts: &[String]) -> Result<Embedded> {
        let (vectors, tokens) = Session::embed(self, texts)?;
        Ok(Embedded { vectors, tokens })
    }

    fn search(&self, q: &SearchQuery) -> Result<Vec<(StoredUnit, f32)>> {
        let hits = Session::search(self, &q.user, &q.query, q.top_k, q.threshold, &q.filters, &q.scope)?;
        let facts = self.memory().facts(&q.user).unwrap_or_default();
        Ok(hits.iter().filter_map(|h| facts.get(h.index).map(|f| (f.stored(), h.score))).collect())
    }

    fn update(&mut self, user: &str, id: &str, change: &UnitUpdate, defer_kv: bool) -> Result<UpdateReport> {
        Ok(Session::update(self, user, id, change, defer_kv)?)
    }

    fn history(&self, user: &str, id: &str) -> Result<Vec<UnitEvent>> {
        Ok(self.memory().history(user, id)?.to_vec())
    }

    fn check_fits(&self, units: &[MemoryUnit]) -> Result<()> {
        Ok(Session::check_fits(self, units)?)
    }

    fn ingest(&mut self, user: &str, units: &[MemoryUnit], defer_kv: bool) -> Result<IngestReport> {
        Ok(Session::ingest(self, user, units, defer_kv)?)
    }

    fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()> {
        Ok(Session::begin_ingest(self, user, units)?)
    }

    fn end_ingest(&mut self, user: &str, commit: bool) -> (bool, Result<()>) {
        let (removed, r) = Session::end_ingest(self, user, commit);
        (removed, r.map_err(Into::into))
    }

    fn units(&self, user: &str) -> Result<Vec<StoredUnit>> {
        Ok(self.memory().stored(user)?)
    }

    fn forget(&mut self, user: &str, unit: Option<&str>) -> Result<()> {
        Ok(Session::forget(self, user, unit)?)
    }

    fn holdings(&self, footprint: bool) -> Holdings {
        let memory = self.memory();
        Holdings {
            users: memory.users().count(),
            facts: memory.fact_count(),
            damaged_users: memory.damaged().count(),
            unsettled_users: memory.unsettled_count(),
            unread_users: memory.unread_users(),
            footprint: footprint.then(|| memory.footprint()),
        }
    }

    fn users(&self) -> (Vec<String>, Vec<u64>) {
        let memory = self.memory();
        match memory.unread_users() {
            0 => memory.digests().map(|(u, d)| (u.to_string(), d)).unzip(),
            _ => (memory.users().map(str::to_string).collect(), Vec::new()),
        }
    }

    fn fact_ids(&self, user: &str) -> Vec<String> {
        self.memory().fact_ids(user)
    }

    fn export_begin(&self, user: &str) -> Result<(KvHeader, Vec<String>)> {
        Ok(self.memory().export_begin(user)?)
    }

    fn export(&self, user: &str, ids: &[String], with_kv: bool, max_bytes: usize) -> Result<(Vec<ShardRecord>, usize)> {
        Ok(self.memory().export(user, ids, with_kv, max_bytes)?)
    }

    fn import_target(&self) -> Result<(PathBuf, KvHeader)> {
        let m = self.memory();
        Ok((m.dir().to_path_buf(), m.kv_header().clone()))
    }

    fn commit_import(&mut self, user: &str, staged: StagedShard) -> Result<ImportReport> {
        Ok(Session::commit_import(self, user, staged)?)
    }

    fn drop_user(&mut self, user: &str) -> Result<()> {
        Ok(Session::drop_user(self, user)?)
    }
}
