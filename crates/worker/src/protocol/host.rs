//! What differs between the kinds of worker ([`MemoryHost`]), and what
//! both report: stats, load, holdings, search results.

use std::path::PathBuf;

use inferscale_engine::Backend;
use inferscale_memory::{
    CacheStats, Event as UnitEvent, Footprint, Hit, ImportReport, IngestReport, KvHeader, Memory, MemoryUnit, Scope,
    ShardRecord, StagedShard, UnitUpdate, UpdateReport,
};
use inferscale_types::StoredUnit;

use super::job::{Events, GenerateJob};
use crate::error::Result;

/// Counters and gauges of a worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub load: Load,
    pub users: usize,
    pub facts: usize,
    pub damaged_users: usize,
    pub unsettled_users: usize,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub window: usize,
    /// Pre-RoPE KV of the memory held in the backend's memory, and the
    /// memory's logs on disk (0 unless asked for).
    pub kv_resident_bytes: u64,
    /// Pre-RoPE KV cached in the backend's host tier.
    pub kv_host_tier_bytes: u64,
    pub disk_bytes: u64,
    /// The memory's KV cache counters (0 unless asked for).
    pub kv_cache: CacheStats,
}

/// What an engine reports of its running batch, for [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Requests beyond which new ones are refused as queue-full.
    pub max_queue: usize,
}

/// What a memory shard holds, for [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holdings {
    pub users: usize,
    pub facts: usize,
    /// Users refused because their stored memory is damaged, and users
    /// whose failed ingest is still being undone.
    pub damaged_users: usize,
    pub unsettled_users: usize,
    /// Bytes per tier, when asked for (O(facts) to measure).
    pub footprint: Option<Footprint>,
}

/// The units of search `hits` over `user`'s facts in `memory`, with their
/// scores (what both hosts answer a search with).
pub fn search_results<B: Backend>(memory: &Memory<B>, user: &str, hits: &[Hit]) -> Vec<(StoredUnit, f32)> {
    let facts = memory.facts(user).unwrap_or_default();
    hits.iter().filter_map(|h| facts.get(h.index).map(|f| (f.stored(), h.score))).collect()
}

/// What `memory` holds (with its bytes per tier when `footprint`).
pub fn holdings<B: Backend>(memory: &Memory<B>, footprint: bool) -> Holdings {
    Holdings {
        users: memory.users().count(),
        facts: memory.fact_count(),
        damaged_users: memory.damaged().count(),
        unsettled_users: memory.unsettled_count(),
        footprint: footprint.then(|| memory.footprint()),
    }
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

/// An engine with a memory shard: what differs between the kinds of
/// worker. Called from the one thread that runs the `Protocol`; every
/// input has passed the protocol's checks.
pub trait MemoryHost {
    /// The context window (in turns) the shard's KV is encoded with.
    fn window(&self) -> usize;

    /// Whether the engine can serve [`Mode::Blend`] (recompute part of the
    /// injected KV inside its own forward pass).
    fn blends(&self) -> bool {
        true
    }

    /// Sentence embeddings of `texts` (each non-empty) by the retrieval
    /// encoder.
    fn embed(&mut self, texts: &[String]) -> Result<Embedded>;

    /// A user's units for a search, each with its score, best first
    /// (`inferscale_memory::Session::search`).
    fn search(&mut self, q: &SearchQuery) -> Result<Vec<(StoredUnit, f32)>>;

    /// Changes one unit of `user` (`inferscale_memory::Memory::update`);
    /// requests that retrieved it and are laid out later use the new one.
    fn update(&mut self, user: &str, id: &str, change: &UnitUpdate, defer_kv: bool) -> Result<UpdateReport>;

    /// One unit's history, oldest first.
    fn history(&self, user: &str, id: &str) -> Result<Vec<UnitEvent>>;

    /// Starts answering an admitted request: its events (tokens, then
    /// finished or failed) go to `events`, now or later. An error refuses
    /// it (the protocol reports it and counts the failure).
    fn generate(&mut self, job: GenerateJob, events: Events) -> Result<()>;

    /// Checks that every one of `units` can be encoded and stored (length
    /// against the model's context and a log record), storing nothing: a
    /// request is refused whole before any of it is stored.
    fn check_fits(&self, units: &[MemoryUnit]) -> Result<()>;

    /// Stores a few of `user`'s validated units and, unless `defer_kv`,
    /// encodes their KV (the protocol splits large ingests into batches).
    fn ingest(&mut self, user: &str, units: &[MemoryUnit], defer_kv: bool) -> Result<IngestReport>;

    /// Starts an all-or-nothing ingest of one request's `units` for
    /// `user`, before its first batch ([`inferscale_memory::Memory::begin_ingest`]):
    /// a crash before [`MemoryHost::end_ingest`] commits it removes, at
    /// the next start, what its batches stored.
    fn begin_ingest(&mut self, user: &str, units: &[MemoryUnit]) -> Result<()>;

    /// Ends the ingest begun for `user`: `commit` keeps what its batches
    /// stored; otherwise it is removed (with the KV derived from it).
    fn end_ingest(&mut self, user: &str, commit: bool) -> Result<()>;

    /// `user`'s stored units, in order, with when each was stored and
    /// last changed.
    fn units(&self, user: &str) -> Result<Vec<StoredUnit>>;

    /// Forgets one unit of `user`, or all of them; requests that retrieved
    /// from the memory but have not used it yet fail as forgotten.
    fn forget(&mut self, user: &str, unit: Option<&str>) -> Result<()>;

    fn load(&self) -> Load;

    fn holdings(&self, footprint: bool) -> Holdings;

    /// Every user held here, with the digest of its units (the leader
    /// replaces a replica whose digest differs from the home's).
    fn users(&self) -> Vec<(String, u64)>;

    /// `user`'s fact ids in order (empty for an unknown user).
    fn fact_ids(&self, user: &str) -> Vec<String>;

    /// The shard's KV header and `user`'s fact ids: the start of an export.
    fn export_begin(&self, user: &str) -> Result<(KvHeader, Vec<String>)>;

    /// Transfer records for a prefix of `ids` (about `max_bytes`), and how
    /// many ids they cover.
    fn export(&self, user: &str, ids: &[String], with_kv: bool, max_bytes: usize) -> Result<(Vec<ShardRecord>, usize)>;

    /// Where imports are staged, and the KV header a shard must match.
    fn import_target(&self) -> Result<(PathBuf, KvHeader)>;

    /// Commits a staged shard in place of `user`'s copy; requests that
    /// retrieved from the old copy and have not used it fail as moving.
    fn commit_import(&mut self, user: &str, staged: StagedShard) -> Result<ImportReport>;

    /// Removes `user`, who has moved away (its unstarted requests fail as
    /// moving); nothing to do for a user this shard does not have.
    fn drop_user(&mut self, user: &str) -> Result<()>;
}
