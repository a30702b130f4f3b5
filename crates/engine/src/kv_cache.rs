//! Paged KV cache bookkeeping: a pool of fixed-size blocks and per-sequence
//! block tables. Pure logic — block ids and token counts, no tensors; the
//! backend owns the memory the ids index (`slot = block · BLOCK_SIZE + offset`).
//!
//! Blocks are reference-counted so that sequences can share a prefix (the
//! cached prompt header); a [`BlockTable`] returns its references when it is
//! dropped, so a cancelled or finished sequence can never leak blocks.
//!
//! The pool is also the automatic prefix cache (as vLLM's): a full block a
//! sequence computed from its start is registered under a [`BlockKey`] —
//! the hash of everything before it and its own tokens — and stays
//! findable after its sequence ends, until its memory is needed. Blocks no
//! sequence holds are reused never-cached first, then cached ones least
//! recently released first; a sequence releases its blocks last to first,
//! so a prefix's tail goes before its head, which more prompts share.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{EngineError, Result};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

/// A full block's identity in the prefix cache: the chain hash of the
/// tokens before it (salted, so that one user's prompts are never found
/// by another's) and its own tokens. Keeping the tokens makes a wrong hit
/// need a 64-bit collision of the whole prefix before the block, not just
/// of the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey {
    parent: u64,
    tokens: [u32; BLOCK_SIZE],
}

/// The keys of a token sequence's full blocks, from its start: one per
/// complete block of `tokens`, chained from `salt`. Keys live in one
/// process only (`DefaultHasher` is deterministic but unspecified across
/// Rust releases), which is all an in-memory cache needs.
pub fn block_keys(salt: &[u8], tokens: &[u32]) -> Vec<BlockKey> {
    let mut h = DefaultHasher::new();
    salt.hash(&mut h);
    let mut parent = h.finish();
    tokens
        .chunks_exact(BLOCK_SIZE)
        .map(|chunk| {
            let mut key = BlockKey { parent, tokens: [0; BLOCK_SIZE] };
            key.tokens.copy_from_slice(chunk);
            let mut h = DefaultHasher::new();
            key.hash(&mut h);
            parent = h.finish();
            key
        })
        .collect()
}

/// The prefix cache's counters since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Blocks looked up and found.
    pub hits: u64,
    /// Blocks looked up and not found (a lookup stops at its first miss).
    pub misses: u64,
    /// Cached blocks whose memory was taken for other tokens.
    pub evictions: u64,
    /// Blocks cached now, held by a sequence or not.
    pub cached: usize,
}

#[derive(Debug)]
struct PoolState {
    refcount: Vec<u32>,
    /// Free blocks never cached (or no longer), handed out from the front
    /// and returned to the back so that allocation order is deterministic.
    free: VecDeque<u32>,
    /// Per block, its key while it is in the prefix cache.
    key_of: Vec<Option<BlockKey>>,
    by_key: HashMap<BlockKey, u32>,
    /// Cached blocks no sequence holds, by when they were released (oldest
    /// first); `idle_since[block]` is the block's entry here.
    idle: BTreeMap<u64, u32>,
    idle_since: Vec<u64>,
    clock: u64,
    stats: PrefixStats,
}

impl PoolState {
    /// One more holder of `id`; a cached block nobody held leaves the idle list.
    fn hold(&mut self, id: u32) {
        let i = id as usize;
        if self.refcount[i] == 0 && self.key_of[i].is_some() {
            self.idle.remove(&self.idle_since[i]);
        }
        self.refcount[i] += 1;
    }
}

/// A shared pool of KV blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    state: Arc<Mutex<PoolState>>,
    total: usize,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        BlockPool {
            state: Arc::new(Mutex::new(PoolState {
                refcount: vec![0; num_blocks],
                free: (0..num_blocks as u32).collect(),
                key_of: vec![None; num_blocks],
                by_key: HashMap::new(),
                idle: BTreeMap::new(),
                idle_since: vec![0; num_blocks],
                clock: 0,
                stats: PrefixStats::default(),
            })),
            total: num_blocks,
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding the lock cannot leave the counts half-updated
        // (each operation completes before unlocking), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Blocks no sequence holds: never-cached ones and cached ones whose
    /// memory may be taken.
    pub fn free_blocks(&self) -> usize {
        let s = self.lock();
        s.free.len() + s.idle.len()
    }

    /// Takes `n` blocks, all or none: never-cached ones first, then the
    /// least recently released cached ones (leaving the cache).
    pub fn allocate(&self, n: usize) -> Option<Vec<u32>> {
        let mut s = self.lock();
        if s.free.len() + s.idle.len() < n {
            return None;
        }
        let from_free = n.min(s.free.len());
        let mut ids: Vec<u32> = s.free.drain(..from_free).collect();
        while ids.len() < n {
            let Some((_, id)) = s.idle.pop_first() else { break };
            if let Some(key) = s.key_of[id as usize].take() {
                s.by_key.remove(&key);
            }
            s.stats.evictions += 1;
            ids.push(id);
        }
        for &id in &ids {
            s.refcount[id as usize] = 1;
        }
        Some(ids)
    }

    fn retain(&self, ids: &[u32]) {
        let mut s = self.lock();
        for &id in ids {
            s.hold(id);
        }
    }

    /// Drops one hold of each block. Never-cached blocks go back in order;
    /// cached ones are stamped last to first, so that of a released prefix
    /// the tail is evicted before the head.
    fn release(&self, ids: &[u32]) {
        let mut s = self.lock();
        let mut idle = Vec::new();
        for &id in ids {
            let i = id as usize;
            let rc = &mut s.refcount[i];
            debug_assert!(*rc > 0, "double free of block {id}");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                match s.key_of[i] {
                    Some(_) => idle.push(id),
                    None => s.free.push_back(id),
                }
            }
        }
        for id in idle.into_iter().rev() {
            s.clock += 1;
            let t = s.clock;
            s.idle_since[id as usize] = t;
            s.idle.insert(t, id);
        }
    }

    pub fn refcount(&self, id: u32) -> u32 {
        self.lock().refcount.get(id as usize).copied().unwrap_or(0)
    }

    /// The cached block holding `key`, with a hold taken for the caller.
    fn find(&self, key: &BlockKey) -> Option<u32> {
        let mut s = self.lock();
        match s.by_key.get(key).copied() {
            Some(id) => {
                s.hold(id);
                s.stats.hits += 1;
                Some(id)
            }
            None => {
                s.stats.misses += 1;
                None
            }
        }
    }

    /// Caches `block` (held, fully computed, never to be written again)
    /// under `key`, unless the key is cached already (another sequence
    /// computed the same block) or the block is.
    fn register(&self, key: BlockKey, block: u32) {
        let mut s = self.lock();
        let i = block as usize;
        if s.by_key.contains_key(&key) || s.key_of[i].is_some() {
            return;
        }
        s.by_key.insert(key, block);
        s.key_of[i] = Some(key);
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        let s = self.lock();
        PrefixStats { cached: s.by_key.len(), ..s.stats }
    }
}

/// The blocks of one sequence, in position order.
#[derive(Debug)]
pub struct BlockTable {
    pool: BlockPool,
    blocks: Vec<u32>,
}

impl BlockTable {
    pub fn new(pool: &BlockPool) -> Self {
        BlockTable { pool: pool.clone(), blocks: Vec::new() }
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Grows the table to hold `tokens` positions, all or nothing.
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        let needed = tokens.div_ceil(BLOCK_SIZE).saturating_sub(self.blocks.len());
        if needed == 0 {
            return Ok(());
        }
        let ids = self.pool.allocate(needed).ok_or_else(|| EngineError::OutOfBlocks {
            needed,
            free: self.pool.free_blocks(),
            total: self.pool.total_blocks(),
        })?;
        self.blocks.extend(ids);
        Ok(())
    }

    /// Cache slot of `position`. The position must be within capacity.
    pub fn slot(&self, position: usize) -> u32 {
        self.blocks[position / BLOCK_SIZE] * BLOCK_SIZE as u32 + (position % BLOCK_SIZE) as u32
    }

    /// A new table sharing this table's first `tokens / BLOCK_SIZE` full
    /// blocks (refcounted). Positions past the shared blocks are the new
    /// table's own, so writing them never touches the shared prefix.
    pub fn share_prefix(&self, tokens: usize) -> BlockTable {
        let n = (tokens / BLOCK_SIZE).min(self.blocks.len());
        let shared = self.blocks[..n].to_vec();
        self.pool.retain(&shared);
        BlockTable { pool: self.pool.clone(), blocks: shared }
    }

    /// Takes the cached blocks of `keys[from..]`, in order, until the first
    /// key not cached; block `i` of the table becomes the cached block of
    /// `keys[i]` (a block the table held there is released). Returns the
    /// end of the blocks now matching `keys` (`from` when none was found).
    pub(crate) fn reuse(&mut self, keys: &[BlockKey], from: usize) -> usize {
        let mut end = from;
        for (i, key) in keys.iter().enumerate().skip(from) {
            if i > self.blocks.len() {
                break;
            }
            let Some(block) = self.pool.find(key) else { break };
            match self.blocks.get_mut(i) {
                Some(old) => {
                    let old = std::mem::replace(old, block);
                    self.pool.release(&[old]);
                }
                None => self.blocks.push(block),
            }
            end = i + 1;
        }
        end
    }

    /// Caches blocks `range` of the table under their `keys`: the caller
    /// says they are fully computed from the sequence's start.
    pub(crate) fn register(&self, keys: &[BlockKey], range: std::ops::Range<usize>) {
        for i in range {
            if let (Some(key), Some(&block)) = (keys.get(i), self.blocks.get(i)) {
                self.pool.register(*key, block);
            }
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.pool.release(&self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_order_and_free_on_drop() {
        let pool = BlockPool::new(4);
        let mut a = BlockTable::new(&pool);
        a.reserve(17).unwrap();
        assert_eq!(a.blocks(), &[0, 1]);
        assert_eq!(a.slot(16), 16);
        let mut b = BlockTable::new(&pool);
        b.reserve(1).unwrap();
        assert_eq!(b.blocks(), &[2]);
        drop(a);
        assert_eq!(pool.free_blocks(), 3);
        // Freed blocks go to the back of the queue.
        let mut c = BlockTable::new(&pool);
        c.reserve(48).unwrap();
        assert_eq!(c.blocks(), &[3, 0, 1]);
        assert_eq!(c.slot(33), 16 + 1);
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let pool = BlockPool::new(2);
        let mut a = BlockTable::new(&pool);
        let e = a.reserve(3 * BLOCK_SIZE).unwrap_err();
        assert!(matches!(e, EngineError::OutOfBlocks { needed: 3, free: 2, total: 2 }));
        assert_eq!(pool.free_blocks(), 2);
        assert!(a.blocks().is_empty());
    }

    fn tokens(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + seed).collect()
    }

    #[test]
    fn cached_blocks_are_found_by_their_whole_prefix_and_salt() {
        let a = block_keys(b"alice", &tokens(40, 0));
        assert_eq!(a.len(), 2, "only full blocks have keys");
        assert_eq!(a, block_keys(b"alice", &tokens(32, 0)));
        // The same second block after another first block, or under
        // another salt, is another key.
        let mut other = tokens(32, 0);
        other[3] += 1;
        assert_ne!(block_keys(b"alice", &other)[1], a[1]);
        assert_ne!(block_keys(b"bob", &tokens(32, 0))[0], a[0]);

        let pool = BlockPool::new(6);
        let mut t = BlockTable::new(&pool);
        t.reserve(40).unwrap(); // blocks 0, 1, 2
        t.register(&a, 0..2);
        drop(t);
        // Cached blocks nobody holds still count as free.
        assert_eq!(pool.free_blocks(), 6);
        assert_eq!(pool.prefix_stats().cached, 2);

        let mut u = BlockTable::new(&pool);
        assert_eq!(u.reuse(&a, 0), 2);
        assert_eq!(u.blocks(), &[0, 1]);
        assert_eq!((pool.refcount(0), pool.refcount(1)), (1, 1));
        assert_eq!(pool.free_blocks(), 4);
        // Another salt finds nothing; the lookup stops at the first miss.
        let mut v = BlockTable::new(&pool);
        assert_eq!(v.reuse(&block_keys(b"bob", &tokens(32, 0)), 0), 0);
        let s = pool.prefix_stats();
        assert_eq!((s.hits, s.misses), (2, 1));
    }

    #[test]
    fn a_hit_replaces_the_block_the_table_held_there() {
        let pool = BlockPool::new(4);
        let keys = block_keys(b"", &tokens(32, 5));
        let mut a = BlockTable::new(&pool);
        a.reserve(32).unwrap(); // 0, 1
        a.register(&keys, 0..2);
        let mut b = BlockTable::new(&pool);
        b.reserve(1).unwrap(); // 2: say, a fork's copy of a header's last block
        assert_eq!(b.reuse(&keys, 0), 2);
        assert_eq!(b.blocks(), &[0, 1]);
        assert_eq!(pool.refcount(2), 0, "the replaced block was released");
        assert_eq!((pool.refcount(0), pool.refcount(1)), (2, 2));
        // Starting past the table's end finds nothing (a gap would follow).
        let mut c = BlockTable::new(&pool);
        assert_eq!(c.reuse(&keys, 1), 1);
        assert!(c.blocks().is_empty());
    }

    #[test]
    fn never_cached_blocks_go_first_then_cached_ones_tail_first() {
        let pool = BlockPool::new(5);
        let keys = block_keys(b"", &tokens(48, 1));
        let mut a = BlockTable::new(&pool);
        a.reserve(48).unwrap(); // 0, 1, 2
        a.register(&keys, 0..3);
        drop(a);
        // Two never-cached blocks are free: they go first.
        let mut b = BlockTable::new(&pool);
        b.reserve(32).unwrap();
        assert_eq!(b.blocks(), &[3, 4]);
        assert_eq!(pool.prefix_stats().evictions, 0);
        // Then the prefix's tail, then its middle.
        let mut c = BlockTable::new(&pool);
        c.reserve(32).unwrap();
        assert_eq!(c.blocks(), &[2, 1]);
        assert_eq!(pool.prefix_stats().evictions, 2);
        assert_eq!(pool.prefix_stats().cached, 1);
        // The head is still found; what followed it is not.
        let mut d = BlockTable::new(&pool);
        assert_eq!(d.reuse(&keys, 0), 1);
        assert_eq!(d.blocks(), &[0]);
        // A held cached block is never evicted: the pool is full.
        assert!(pool.allocate(1).is_none());
        drop((b, c));
        // A registered key is not taken again by another block.
        let mut e = BlockTable::new(&pool);
        e.reserve(16).unwrap();
        e.register(&keys, 0..1);
        assert_eq!(pool.prefix_stats().cached, 1);
        drop(d);
        assert_eq!(pool.free_blocks(), 4);
    }

    #[test]
    fn shared_prefix_is_refcounted() {
        let pool = BlockPool::new(4);
        let mut a = BlockTable::new(&pool);
        a.reserve(40).unwrap(); // blocks 0,1,2
        let mut b = a.share_prefix(40); // full blocks 0,1 only
        assert_eq!(b.blocks(), &[0, 1]);
        assert_eq!(pool.refcount(0), 2);
        b.reserve(40).unwrap();
        assert_eq!(b.blocks(), &[0, 1, 3]);
        drop(a);
        assert_eq!(pool.refcount(0), 1);
        assert_eq!(pool.refcount(2), 0);
        drop(b);
        assert_eq!(pool.free_blocks(), 4);
    }
}
