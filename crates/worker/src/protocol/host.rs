//! What differs between the kinds of worker ([`MemoryHost`]), and what
//! both report: stats and load.

use inferscale_memory::CacheStats;

use super::job::{Events, GenerateJob};
use super::shard::Shard;
use crate::error::Result;

/// Counters and gauges of a worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub load: Load,
    pub users: usize,
    pub facts: usize,
    pub damaged_users: usize,
    pub unsettled_users: usize,
    /// Users not read from disk since the start (read on first use and in
    /// idle time).
    pub unread_users: usize,
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

/// What a memory shard changed, for [`MemoryHost::memory_changed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Units stored, or one changed.
    Written,
    /// Units removed: a forget, or an ingest undone.
    Removed,
    /// The user's copy replaced by an imported one, or dropped after a move.
    Moved,
}

/// An engine with a memory shard: what differs between the kinds of
/// worker — generating, what the engine can do, its load, and what it does
/// when a user's memory changes. The memory commands themselves are the
/// protocol's, over the host's [`Shard`]. Called from the one thread that
/// runs the `Protocol`; every input has passed the protocol's checks.
pub trait MemoryHost {
    /// Whether the engine can serve [`Mode::Blend`] (recompute part of the
    /// injected KV inside its own forward pass).
    fn blends(&self) -> bool {
        true
    }

    /// Starts answering an admitted request: its events (tokens, then
    /// finished or failed) go to `events`, now or later. An error refuses
    /// it (the protocol reports it and counts the failure).
    fn generate(&mut self, job: GenerateJob, events: Events) -> Result<()>;

    /// The engine's running batch and queue.
    fn load(&self) -> Load;

    /// Runs `f` on the memory shard (under the host's lock, where the
    /// shard is shared with the engine's other threads).
    fn with_shard<T>(&mut self, f: impl FnOnce(&mut dyn Shard) -> Result<T>) -> Result<T>;

    /// `user`'s memory changed: requests that retrieved from it but have
    /// not used it yet must not lay out from the new one (they fail as
    /// forgotten or moving), and caches keyed by the memory's content must
    /// not be hit again.
    fn memory_changed(&mut self, user: &str, change: Change);
}
