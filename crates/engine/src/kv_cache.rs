//! Paged KV cache bookkeeping: a pool of fixed-size blocks and per-sequence
//! block tables. Pure logic — block ids and token counts, no tensors; the
//! backend owns the memory the ids index (`slot = block · BLOCK_SIZE + offset`).
//!
//! Blocks are reference-counted so that sequences can share a prefix (the
//! cached prompt header); a [`BlockTable`] returns its references when it is
//! dropped, so a cancelled or finished sequence can never leak blocks.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{EngineError, Result};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

#[derive(Debug)]
struct PoolState {
    refcount: Vec<u32>,
    /// Free block ids, handed out from the front and returned to the back so
    /// that allocation order is deterministic.
    free: VecDeque<u32>,
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

    pub fn free_blocks(&self) -> usize {
        self.lock().free.len()
    }

    /// Takes `n` blocks, all or none.
    pub fn allocate(&self, n: usize) -> Option<Vec<u32>> {
        let mut s = self.lock();
        if s.free.len() < n {
            return None;
        }
        let ids: Vec<u32> = s.free.drain(..n).collect();
        for &id in &ids {
            s.refcount[id as usize] = 1;
        }
        Some(ids)
    }

    fn retain(&self, ids: &[u32]) {
        let mut s = self.lock();
        for &id in ids {
            s.refcount[id as usize] += 1;
        }
    }

    fn release(&self, ids: &[u32]) {
        let mut s = self.lock();
        for &id in ids {
            let rc = &mut s.refcount[id as usize];
            debug_assert!(*rc > 0, "double free of block {id}");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                s.free.push_back(id);
            }
        }
    }

    pub fn refcount(&self, id: u32) -> u32 {
        self.lock().refcount.get(id as usize).copied().unwrap_or(0)
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
