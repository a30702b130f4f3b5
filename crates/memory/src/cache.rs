//! Which facts' KV is resident, in which tier, and what leaves when a tier
//! is full (docs/design.md §8).
//!
//! Three tiers: the device (KV the injection kernel reads from device
//! memory), the host tier (pinned host memory the kernel reads over the
//! bus) and the disk (every fact's segment record, always). The cache holds
//! a fact's KV in at most one of the first two; each has a byte budget.
//! The unit is one fact's KV: a request injects the k facts retrieval
//! picked out of hundreds, so caching whole users would move and hold
//! ~30× the bytes a request reads (k = 20 of a LoCoMo user's ~600 turns).
//!
//! Policy: least recently used within each tier, a fact in one tier at a
//! time, and no copies between the tiers on a request's path. KV read from
//! disk goes to the device tier while that has room under a device budget
//! (the reader thread copies it there on a stream of its own; reads bound
//! for the device reserve their bytes until cached), else to the host tier
//! when the
//! backend has one (a copy into pinned memory, no device work; injection
//! reads it over the bus, overlapped with the prefill: +2.1 ms at k = 50
//! for the 8B shape, docs/design.md §8), whose least recently used facts
//! are dropped to make room (the disk has them). A full device tier does
//! not turn over on reads: after a restart it holds the first facts asked
//! for, which under skewed popularity are mostly the popular users'.
//! KV computed on the device (an ingest's encoding) stays there where it
//! fits without evicting, else goes to the host tier where it fits, else
//! only to disk: an ingest does not push out the users being served. A hit
//! is served from the tier it is in. Moving facts between the tiers (a
//! host-tier hit promoted, a device victim demoted) was measured on the
//! H200 at 30–45 ms per fact of the 8B shape through the backend's
//! per-layer copies (`bench store`, 2026-12-03), far more than the bus
//! reads it saves, so the engine thread never moves facts. A device tier
//! that turns over instead promotes by reading again: with
//! `promote_after` = N (off by default until measured), a host-tier fact
//! hit N times there is read from its segment again by a reader thread,
//! onto the device through the readers' own upload (`fetch.rs`,
//! [`crate::Memory::promotion_jobs`]), and takes its place in the device
//! tier's LRU order there, the device's least recently used unpinned facts
//! leaving it — demoted: read again from their segments into the host
//! tier by a reader thread ([`KvCache::take_demotions`]), not copied down
//! (the device-to-host copy measured above), by the owner the memory
//! gave each fact it cached ([`KvCache::set_owner`]: reads and encodings);
//! a victim without one leaves for the disk. A promotion reserves its
//! device bytes like a read bound there, and is not started when pinned
//! facts leave it no room. KV a request holds
//! (an [`Arc`] clone: a pin, from admission to layout) is never evicted;
//! when pins leave no room, the fact is placed past the budget rather than
//! refused, and counted.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use inferscale_engine::backend::{KvUpload, KvUploadFp8};
use inferscale_engine::{Backend, KvChunk};
use inferscale_model::HostTensor;

use crate::error::Result;

/// Where a cached fact's KV lives. A device backend keeps it in device
/// memory or in its host tier (pinned host memory that injection reads over
/// the bus, overlapped with the prefill); a backend without a host tier
/// (the CPU one) has only the first, unless the store emulates one
/// ([`crate::StoreOptions::emulated_host_tier`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
}

impl Tier {
    fn at(self) -> usize {
        self as usize
    }
}

/// Byte budgets of the two memory tiers (`None`: no limit).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    pub device: Option<u64>,
    pub host: Option<u64>,
}

/// Counters since the memory opened, for the worker's metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Facts a request found resident, per tier.
    pub hits: [u64; 2],
    /// Facts a request had to read from disk.
    pub misses: u64,
    pub loaded_bytes: u64,
    /// Facts dropped from a tier to make room, per tier.
    pub evictions: [u64; 2],
    /// Facts placed past a budget because pinned facts filled it.
    pub over_budget: u64,
    /// Records that failed their checksum when read (re-encoded).
    pub corrupt: u64,
    /// Host-tier facts read again onto the device (promoted).
    pub promoted: u64,
    /// Device-tier facts a promotion evicted, read again into the host
    /// tier (demoted).
    pub demoted: u64,
    /// Facts resident before a restart, read back into a tier
    /// (`resident.rs`).
    pub warmed: u64,
}

struct Entry<B: Backend> {
    chunk: Arc<KvChunk<B>>,
    tier: Tier,
    stamp: u64,
    bytes: u64,
    /// Hits since it was placed in its tier.
    hits: u32,
    /// A promotion of it was asked for ([`KvCache::promotion_due`]).
    promoting: bool,
    /// The user and index of its fact, where the caller said
    /// ([`KvCache::set_owner`]): what a demotion reads it again by.
    owner: Option<(String, usize)>,
}

impl<B: Backend> Entry<B> {
    /// Held by a request (pinned) besides the cache.
    fn pinned(&self) -> bool {
        Arc::strong_count(&self.chunk) > 1
    }
}

/// KV to cache: already where it was computed (a device chunk), host
/// tensors read from a segment, or those tensors already placed by a
/// reader thread in the tier [`KvCache::read_target`] chose (with the
/// backend's [`Backend::device_tier_upload`] or
/// [`Backend::host_tier_upload`] and their fp8 kin).
pub(crate) enum Source<B: Backend> {
    Chunk(KvChunk<B>),
    Host { tokens: Vec<u32>, k: Vec<HostTensor>, v: Vec<HostTensor> },
    Uploaded(KvChunk<B>, Tier),
}

/// How hard an insertion may push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Evict least recently used facts to make room (a request needs it).
    Demand,
    /// Only where it fits as things are — KV a reader placed, only in its
    /// tier —; else not cached (freshly encoded, or read back after a
    /// restart: `resident.rs`).
    Fill,
}

pub(crate) struct KvCache<B: Backend> {
    entries: HashMap<u64, Entry<B>>,
    /// Per tier, stamp → key, oldest first.
    lru: [BTreeMap<u64, u64>; 2],
    bytes: [u64; 2],
    budgets: Budgets,
    /// Whether the backend has a host tier apart from its device memory.
    host_tier: bool,
    clock: u64,
    /// Device bytes reserved by reads bound for the device tier.
    reserved: u64,
    /// Bytes per stored K or V element on the backend.
    bytes_per_value: u64,
    /// Per token: 2 (K, V) × layers × kv_dim values.
    values_per_token: u64,
    /// Host-tier hits after which a fact is promoted (0: never).
    promote_after: u32,
    /// Device facts evicted while the device tier turns over, to read
    /// again into the host tier: (user, index, key), oldest first.
    demotions: std::collections::VecDeque<(String, usize, u64)>,
    pub(crate) stats: CacheStats,
}

/// Demotions waiting for a reader at most; older ones are dropped (their
/// facts stay on disk, as without demotion).
const MAX_DEMOTIONS_QUEUED: usize = 256;

impl<B: Backend> KvCache<B> {
    /// A cache for `be`'s KV of a model of `layers` × `kv_dim`, with a host
    /// tier where the backend has one or `emulated_host_tier` asks for one
    /// ([`crate::StoreOptions::emulated_host_tier`]).
    pub(crate) fn new(be: &B, budgets: Budgets, layers: usize, kv_dim: usize, emulated_host_tier: bool) -> Self {
        let host_tier = be.has_host_tier() || emulated_host_tier;
        Self::with_tiers(budgets, host_tier, be.kv_bytes_per_value(), layers, kv_dim)
    }

    /// Promotes host-tier facts after `n` hits there (0: never); see the
    /// module doc.
    pub(crate) fn set_promote_after(&mut self, n: u32) {
        self.promote_after = n;
    }

    fn with_tiers(budgets: Budgets, host_tier: bool, bytes_per_value: usize, layers: usize, kv_dim: usize) -> Self {
        KvCache {
            entries: HashMap::new(),
            lru: Default::default(),
            bytes: [0; 2],
            budgets,
            host_tier,
            clock: 0,
            reserved: 0,
            bytes_per_value: bytes_per_value as u64,
            values_per_token: (2 * layers * kv_dim) as u64,
            promote_after: 0,
            demotions: Default::default(),
            stats: CacheStats::default(),
        }
    }

    /// Bytes resident per tier.
    pub(crate) fn bytes(&self, tier: Tier) -> u64 {
        self.bytes[tier.at()]
    }

    pub(crate) fn get(&self, key: u64) -> Option<&Arc<KvChunk<B>>> {
        self.entries.get(&key).map(|e| &e.chunk)
    }

    pub(crate) fn tier(&self, key: u64) -> Option<Tier> {
        self.entries.get(&key).map(|e| e.tier)
    }

    /// Bytes per stored K or V element on the backend.
    pub(crate) fn bytes_per_value(&self) -> u64 {
        self.bytes_per_value
    }

    /// The tier a read of a fact of `tokens` tokens goes to, and the device
    /// bytes reserved for it until [`KvCache::release`]: the device tier
    /// while it has room beside what is resident and the reads already
    /// bound for it, else the host tier (evicting there). `per_value`:
    /// bytes per K or V value the read will take in device memory (`None`:
    /// the backend cannot place reads there from another thread). Reads go
    /// to the device only under a device budget: without one, a large store
    /// read back after a restart would take device memory the engine's
    /// activations need (the host tier is where unbudgeted reads go).
    /// Without a host tier every read goes to the device (and reserves
    /// nothing: there is no other place).
    pub(crate) fn read_target(&mut self, tokens: usize, per_value: Option<u64>) -> (Tier, u64) {
        if !self.host_tier {
            return (Tier::Device, 0);
        }
        let (Some(per_value), Some(_)) = (per_value, self.budgets.device) else { return (Tier::Host, 0) };
        let bytes = tokens as u64 * self.values_per_token * per_value;
        match self.fits(Tier::Device, self.reserved.saturating_add(bytes)) {
            true => {
                self.reserved += bytes;
                (Tier::Device, bytes)
            }
            false => (Tier::Host, 0),
        }
    }

    /// Changes when a fact is cached, used or dropped: what the saved list
    /// of resident facts was made at (`resident.rs`).
    pub(crate) fn version(&self) -> (u64, usize) {
        (self.clock, self.entries.len())
    }

    /// Every cached fact: the device tier's, then the host tier's, each most
    /// recently used first, with the owner the cache was told
    /// ([`KvCache::set_owner`]).
    pub(crate) fn resident(&self) -> impl Iterator<Item = (Tier, u64, Option<(&str, usize)>)> {
        [Tier::Device, Tier::Host].into_iter().flat_map(move |tier| {
            self.lru[tier.at()].values().rev().map(move |&key| {
                let owner = self.entries[&key].owner.as_ref().map(|(u, i)| (u.as_str(), *i));
                (tier, key, owner)
            })
        })
    }

    /// [`KvCache::read_target`] for a fact that was in `was` before a
    /// restart (`resident.rs`): a host-tier fact goes back to the host
    /// tier, leaving the device's room to what requests read.
    pub(crate) fn warm_target(&mut self, was: Tier, tokens: usize, per_value: Option<u64>) -> (Tier, u64) {
        match (was, self.host_tier) {
            (Tier::Host, true) => (Tier::Host, 0),
            _ => self.read_target(tokens, per_value),
        }
    }

    /// Records which fact `key` holds the KV of (`user`'s fact `idx`), so
    /// that a device tier turning over can demote it ([`KvCache::take_demotions`]).
    pub(crate) fn set_owner(&mut self, key: u64, user: &str, idx: usize) {
        if let Some(e) = self.entries.get_mut(&key) {
            e.owner = Some((user.to_string(), idx));
        }
    }

    /// Up to `max` device facts a promotion evicted (oldest first), for
    /// reading again into the host tier: (user, index when evicted, key).
    /// Only while promotions are on, with a host tier, and for facts whose
    /// owner the cache was told; the rest leave for the disk.
    pub(crate) fn take_demotions(&mut self, max: usize) -> Vec<(String, usize, u64)> {
        let n = max.min(self.demotions.len());
        self.demotions.drain(..n).collect()
    }

    /// Releases device bytes [`KvCache::read_target`] reserved (the read is
    /// cached, or dropped).
    pub(crate) fn release(&mut self, reserved: u64) {
        self.reserved = self.reserved.saturating_sub(reserved);
    }

    /// Marks `key` used now; returns the tier it is in.
    pub(crate) fn hit(&mut self, key: u64) -> Option<Tier> {
        let tier = self.tier(key)?;
        self.stats.hits[tier.at()] += 1;
        self.touch(key);
        Some(tier)
    }

    /// Whether `key`, just hit, is due for promotion: in the host tier, hit
    /// there `promote_after` times, under a device budget, and not asked
    /// for already. Answers yes once per placement.
    pub(crate) fn promotion_due(&mut self, key: u64) -> bool {
        let (after, device_budget) = (self.promote_after, self.budgets.device.is_some());
        match self.entries.get_mut(&key) {
            Some(e) if after > 0 && device_budget && e.tier == Tier::Host && !e.promoting && e.hits >= after => {
                e.promoting = true;
                true
            }
            _ => false,
        }
    }

    /// Reserves device room for promoting `key` (still in the host tier)
    /// at `per_value` bytes a value there: the bytes reserved, or `None`
    /// when the device cannot take it — a fact larger than the budget, or
    /// pinned facts holding the room the least recently used would free.
    /// [`KvCache::release`] frees the reservation.
    pub(crate) fn reserve_promotion(&mut self, key: u64, per_value: u64) -> Option<u64> {
        let e = self.entries.get(&key).filter(|e| e.tier == Tier::Host)?;
        let bytes = e.chunk.len() as u64 * self.values_per_token * per_value;
        let budget = self.budgets.device?;
        let unpinned: u64 = self.lru[Tier::Device.at()]
            .values()
            .map(|k| &self.entries[k])
            .filter(|e| !e.pinned())
            .map(|e| e.bytes)
            .sum();
        let held = self.bytes[Tier::Device.at()] - unpinned + self.reserved;
        match held.saturating_add(bytes) <= budget {
            true => {
                self.reserved += bytes;
                Some(bytes)
            }
            false => {
                // Asked again after its next hits.
                if let Some(e) = self.entries.get_mut(&key) {
                    (e.hits, e.promoting) = (0, false);
                }
                None
            }
        }
    }

    /// Caches `source` under `key` (replacing what it held); returns the
    /// tier it went to, or `None` when [`Admit::Fill`] found no room.
    pub(crate) fn insert(&mut self, be: &B, key: u64, source: Source<B>, admit: Admit) -> Result<Option<Tier>> {
        let was = self.take(key).map(|e| e.tier);
        let bytes = match &source {
            // What it holds where the reader put it (fp8 kept as fp8: half).
            Source::Uploaded(c, _) => c.k.iter().chain(&c.v).map(|t| be.stored_bytes(t) as u64).sum(),
            Source::Chunk(c) => c.len() as u64 * self.values_per_token * self.bytes_per_value,
            Source::Host { tokens, .. } => tokens.len() as u64 * self.values_per_token * self.bytes_per_value,
        };
        let host_tier = self.host_tier;
        // Where KV goes that no reader placed (the host tier, which holds
        // more, when there is one).
        let home = if host_tier { Tier::Host } else { Tier::Device };
        let tier = match (admit, &source) {
            // A reader placed it: there, or nowhere.
            (Admit::Fill, Source::Uploaded(_, placed)) => match self.fits(*placed, bytes) {
                true => *placed,
                false => return Ok(None),
            },
            (Admit::Fill, _) if self.fits(Tier::Device, bytes) => Tier::Device,
            (Admit::Fill, _) if host_tier && self.fits(Tier::Host, bytes) => Tier::Host,
            (Admit::Fill, _) => return Ok(None),
            (Admit::Demand, source) => {
                let tier = match source {
                    Source::Uploaded(_, placed) => *placed,
                    _ => home,
                };
                if !self.make_room(tier, bytes) {
                    self.stats.over_budget += 1;
                }
                tier
            }
        };
        let chunk = match (source, tier) {
            (Source::Chunk(c), Tier::Device) => c,
            (Source::Uploaded(c, placed), _) => {
                debug_assert_eq!(tier, placed, "a reader's KV is cached where it placed it");
                c
            }
            (Source::Chunk(c), Tier::Host) => {
                let (k, v) = c.to_host(be)?;
                KvChunk::from_host_tier(be, c.tokens, &k, &v)?
            }
            (Source::Host { tokens, k, v }, Tier::Device) => KvChunk::from_host(be, tokens, &k, &v)?,
            (Source::Host { tokens, k, v }, Tier::Host) => KvChunk::from_host_tier(be, tokens, &k, &v)?,
        };
        self.put(key, chunk, tier, bytes);
        if (was, tier) == (Some(Tier::Host), Tier::Device) {
            self.stats.promoted += 1;
        }
        Ok(Some(tier))
    }

    /// Brings each tier back within its budget where pins had pushed it
    /// past (its least recently used unpinned facts leave, as on an
    /// insertion): pins are released without the cache seeing it.
    pub(crate) fn trim(&mut self) {
        for tier in [Tier::Device, Tier::Host] {
            if !self.fits(tier, 0) {
                self.make_room(tier, 0);
            }
        }
    }

    /// Drops `key`'s KV (its fact changed or is gone). A request holding
    /// it keeps its copy until it is done with it.
    pub(crate) fn remove(&mut self, key: u64) {
        self.take(key);
    }

    fn take(&mut self, key: u64) -> Option<Entry<B>> {
        let e = self.entries.remove(&key)?;
        self.lru[e.tier.at()].remove(&e.stamp);
        self.bytes[e.tier.at()] -= e.bytes;
        Some(e)
    }

    fn put(&mut self, key: u64, chunk: KvChunk<B>, tier: Tier, bytes: u64) {
        self.clock += 1;
        self.lru[tier.at()].insert(self.clock, key);
        self.bytes[tier.at()] += bytes;
        let entry =
            Entry { chunk: Arc::new(chunk), tier, stamp: self.clock, bytes, hits: 0, promoting: false, owner: None };
        self.entries.insert(key, entry);
    }

    fn touch(&mut self, key: u64) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru[e.tier.at()].remove(&e.stamp);
            e.stamp = self.clock;
            e.hits = e.hits.saturating_add(1);
            self.lru[e.tier.at()].insert(self.clock, key);
        }
    }

    fn budget(&self, tier: Tier) -> Option<u64> {
        match tier {
            Tier::Device => self.budgets.device,
            Tier::Host => self.budgets.host,
        }
    }

    fn fits(&self, tier: Tier, bytes: u64) -> bool {
        self.budget(tier).is_none_or(|b| self.bytes[tier.at()].saturating_add(bytes) <= b)
    }

    /// Drops `tier`'s least recently used unpinned facts until `bytes`
    /// more fit its budget; drops nothing when they cannot be made to fit.
    /// Returns whether `bytes` fit now.
    fn make_room(&mut self, tier: Tier, bytes: u64) -> bool {
        let Some(budget) = self.budget(tier) else { return true };
        if bytes > budget {
            return false;
        }
        // Past the budget already (pins placed facts beyond it): back under.
        let excess = (self.bytes[tier.at()] + bytes).saturating_sub(budget);
        let mut freed = 0;
        let mut victims = Vec::new();
        for (_, &key) in self.lru[tier.at()].iter() {
            if freed >= excess {
                break;
            }
            let e = &self.entries[&key];
            if !e.pinned() {
                freed += e.bytes;
                victims.push(key);
            }
        }
        if freed < excess {
            return false;
        }
        // A device tier that turns over (promotions) sends its victims to
        // the host tier, read again from their segments there by a reader:
        // sent to the disk, a promotion costs a fact as often as it saves
        // one (scripts/cache_policy_sim.py).
        let demote = tier == Tier::Device && self.host_tier && self.promote_after > 0;
        for key in victims {
            let owner = self.take(key).and_then(|e| e.owner);
            self.stats.evictions[tier.at()] += 1;
            if let (true, Some((user, idx))) = (demote, owner) {
                if self.demotions.len() == MAX_DEMOTIONS_QUEUED {
                    self.demotions.pop_front();
                }
                self.demotions.push_back((user, idx, key));
            }
        }
        true
    }
}

/// The backend's uploads that reader threads place what they read with,
/// per tier.
pub(crate) struct Uploads<T> {
    pub(crate) device: TierUploads<T>,
    pub(crate) host: TierUploads<T>,
}

/// One tier's uploads (`None`: the engine thread places it).
pub(crate) struct TierUploads<T> {
    pub(crate) bf: Option<KvUpload<T>>,
    /// fp8 records kept as fp8 in that tier.
    pub(crate) fp8: Option<KvUploadFp8<T>>,
}

impl<T> Clone for TierUploads<T> {
    fn clone(&self) -> Self {
        TierUploads { bf: self.bf.clone(), fp8: self.fp8.clone() }
    }
}

impl<T> Uploads<T> {
    pub(crate) fn of<B: Backend<Tensor = T>>(be: &B) -> Self {
        let host = TierUploads { bf: be.host_tier_upload(), fp8: be.host_tier_upload_fp8() };
        // Without a host tier, the "host tier" uploads place KV as any
        // upload does: in the backend's (only) memory.
        let device = match be.has_host_tier() {
            true => TierUploads { bf: be.device_tier_upload(), fp8: be.device_tier_upload_fp8() },
            false => host.clone(),
        };
        Uploads { device, host }
    }
}

#[cfg(test)]
mod tests {
    use inferscale_engine::CpuBackend;

    use super::*;

    /// A fact of `n` tokens whose values are `x`: one layer, 2 values per token.
    fn fact(n: usize, x: f32) -> Source<CpuBackend> {
        let t = HostTensor { shape: vec![n, 2], data: vec![x; 2 * n] };
        Source::Host { tokens: vec![1; n], k: vec![t.clone()], v: vec![t] }
    }

    /// Device room for 3 one-token facts, host room for 2 (16 bytes each:
    /// K and V, 2 values of 4 bytes).
    fn cache() -> KvCache<CpuBackend> {
        KvCache::with_tiers(Budgets { device: Some(48), host: Some(32) }, true, 4, 1, 2)
    }

    fn tiers(c: &KvCache<CpuBackend>, keys: std::ops::Range<u64>) -> Vec<Option<Tier>> {
        keys.map(|k| c.tier(k)).collect()
    }

    #[test]
    fn unplaced_reads_go_to_the_host_tier_encodings_to_the_device_and_each_tier_drops_its_oldest() {
        let be = CpuBackend;
        let mut c = cache();
        use Tier::*;
        // KV read from disk that no reader placed goes to the host tier,
        // which drops its least recently used to make room; a hit is served
        // where it is.
        for key in 0..2 {
            assert_eq!(c.insert(&be, key, fact(1, key as f32), Admit::Demand).unwrap(), Some(Host));
        }
        assert_eq!(c.hit(0), Some(Host));
        c.insert(&be, 2, fact(1, 2.0), Admit::Demand).unwrap();
        assert_eq!(tiers(&c, 0..3), [Some(Host), None, Some(Host)]);
        assert_eq!((c.stats.evictions, c.stats.hits), ([0, 1], [0, 1]));
        // Encoded KV stays on the device while it fits, then goes to the
        // host tier where it fits without evicting, else is not cached.
        let chunk = |x: f32| match fact(1, x) {
            Source::Host { tokens, k, v } => Source::Chunk(KvChunk::from_host(&be, tokens, &k, &v).unwrap()),
            s => s,
        };
        for key in 10..13 {
            assert_eq!(c.insert(&be, key, chunk(key as f32), Admit::Fill).unwrap(), Some(Device));
        }
        assert_eq!(c.insert(&be, 13, chunk(13.0), Admit::Fill).unwrap(), None, "both tiers full");
        assert_eq!((c.bytes(Device), c.bytes(Host)), (48, 32));
        // The KV is the same wherever it went.
        let (k, _) = c.get(2).unwrap().to_host(&be).unwrap();
        assert_eq!(k[0].data, [2.0, 2.0]);
        let (k, _) = c.get(11).unwrap().to_host(&be).unwrap();
        assert_eq!(k[0].data, [11.0, 11.0]);
        c.remove(0);
        assert_eq!((c.bytes(Host), c.tier(0)), (16, None));
    }

    #[test]
    fn reads_go_to_the_device_while_it_has_room_counting_reads_in_flight() {
        let be = CpuBackend;
        let mut c = cache();
        use Tier::*;
        // 16 bytes a one-token fact at 4 bytes a value: the device's 48 take three.
        let placed = |c: &mut KvCache<CpuBackend>, key: u64, to: Tier| {
            let Source::Host { tokens, k, v } = fact(1, key as f32) else { unreachable!() };
            let chunk = KvChunk::from_host(&be, tokens, &k, &v).unwrap();
            c.insert(&be, key, Source::Uploaded(chunk, to), Admit::Demand).unwrap()
        };
        let (a, ra) = c.read_target(1, Some(4));
        let (b, rb) = c.read_target(1, Some(4));
        assert_eq!((a, ra, b, rb), (Device, 16, Device, 16));
        assert_eq!(placed(&mut c, 0, a), Some(Device));
        c.release(ra);
        // One resident and one in flight leave room for one more, not two.
        assert_eq!(c.read_target(1, Some(4)), (Device, 16));
        assert_eq!(c.read_target(1, Some(4)), (Host, 0), "the device is spoken for");
        c.release(rb);
        c.release(16);
        // A backend that cannot upload to the device from a reader: host.
        assert_eq!(c.read_target(1, None), (Host, 0));
        // fp8 kept as fp8 reserves a byte a value: four one-token facts' worth.
        assert_eq!(c.read_target(2, Some(1)), (Device, 8));
        c.release(8);
        assert_eq!(placed(&mut c, 1, Device), Some(Device));
        assert_eq!(placed(&mut c, 2, Device), Some(Device));
        assert_eq!(c.read_target(1, Some(4)), (Host, 0), "device full");
        assert_eq!(placed(&mut c, 3, Host), Some(Host));
        assert_eq!(tiers(&c, 0..4), [Some(Device), Some(Device), Some(Device), Some(Host)]);
        assert_eq!(c.stats.evictions, [0, 0]);
        // Without a host tier every read goes to the device and reserves nothing.
        let mut one = KvCache::<CpuBackend>::with_tiers(Budgets { device: Some(16), host: None }, false, 4, 1, 2);
        assert_eq!(one.read_target(100, Some(4)), (Device, 0));
        // Without a device budget reads go to the host tier, however small.
        let mut unbounded = KvCache::<CpuBackend>::with_tiers(Budgets { device: None, host: None }, true, 4, 1, 2);
        assert_eq!(unbounded.read_target(1, Some(1)), (Host, 0));
    }

    #[test]
    fn host_tier_hits_promote_onto_the_device_whose_unpinned_least_recently_used_facts_leave() {
        let be = CpuBackend;
        use Tier::*;
        // Room for two one-token facts (16 bytes) in each tier.
        let mut c = KvCache::with_tiers(Budgets { device: Some(32), host: Some(32) }, true, 4, 1, 2);
        c.set_promote_after(2);
        let placed = |c: &mut KvCache<CpuBackend>, key: u64, to: Tier| {
            let Source::Host { tokens, k, v } = fact(1, key as f32) else { unreachable!() };
            let chunk = KvChunk::from_host(&be, tokens, &k, &v).unwrap();
            c.insert(&be, key, Source::Uploaded(chunk, to), Admit::Demand).unwrap()
        };
        placed(&mut c, 0, Device);
        placed(&mut c, 1, Device);
        placed(&mut c, 2, Host);
        // One host hit is not enough, the second is — and is asked for once.
        c.hit(2);
        assert!(!c.promotion_due(2));
        c.hit(2);
        assert!(c.promotion_due(2));
        assert!(!c.promotion_due(2), "asked for once");
        // A device fact is never due.
        c.hit(0);
        c.hit(0);
        assert!(!c.promotion_due(0));
        // 0 is pinned, 1 (least recently used) is not: room for the promotion.
        let pin0 = c.get(0).unwrap().clone();
        assert_eq!(c.reserve_promotion(2, 4), Some(16));
        // Reads bound for the device see the room as taken meanwhile.
        assert_eq!(c.read_target(1, Some(4)), (Host, 0));
        // The read lands: 2 moves to the device, 1 leaves it, the pinned 0 stays.
        c.release(16);
        assert_eq!(placed(&mut c, 2, Device), Some(Device));
        assert_eq!(tiers(&c, 0..3), [Some(Device), None, Some(Device)]);
        assert_eq!((c.stats.promoted, c.stats.evictions, c.bytes(Host)), (1, [1, 0], 0));

        // Every device fact pinned: no promotion starts, and the fact is
        // asked for again only after as many hits again.
        placed(&mut c, 3, Host);
        let pin2 = c.get(2).unwrap().clone();
        c.hit(3);
        c.hit(3);
        assert!(c.promotion_due(3));
        assert_eq!(c.reserve_promotion(3, 4), None);
        assert_eq!(c.reserve_promotion(2, 4), None, "only host-tier facts are promoted");
        c.hit(3);
        assert!(!c.promotion_due(3));
        c.hit(3);
        assert!(c.promotion_due(3));
        drop((pin0, pin2));
        assert_eq!(c.reserve_promotion(3, 4), Some(16));
        assert_eq!(tiers(&c, 0..4), [Some(Device), None, Some(Device), Some(Host)], "nothing moved yet");

        // Off (the default), or without a device budget: never due.
        let mut off = KvCache::<CpuBackend>::with_tiers(Budgets { device: Some(32), host: Some(32) }, true, 4, 1, 2);
        let mut unbudgeted = KvCache::<CpuBackend>::with_tiers(Budgets { device: None, host: Some(32) }, true, 4, 1, 2);
        unbudgeted.set_promote_after(1);
        for c in [&mut off, &mut unbudgeted] {
            c.insert(&be, 9, fact(1, 9.0), Admit::Demand).unwrap();
            for _ in 0..3 {
                c.hit(9);
            }
            assert!(!c.promotion_due(9));
        }
    }

    #[test]
    fn a_device_tier_turning_over_demotes_its_victims_whose_owner_it_knows() {
        let be = CpuBackend;
        use Tier::*;
        let placed = |c: &mut KvCache<CpuBackend>, key: u64, to: Tier| {
            let Source::Host { tokens, k, v } = fact(1, key as f32) else { unreachable!() };
            let chunk = KvChunk::from_host(&be, tokens, &k, &v).unwrap();
            c.insert(&be, key, Source::Uploaded(chunk, to), Admit::Demand).unwrap()
        };
        let promote = |c: &mut KvCache<CpuBackend>, key: u64| {
            c.hit(key);
            assert!(c.promotion_due(key));
            let reserved = c.reserve_promotion(key, 4).unwrap();
            c.release(reserved);
            assert_eq!(placed(c, key, Device), Some(Device));
        };
        // Two one-token facts in each tier; promotions after one host hit.
        let mut c = KvCache::with_tiers(Budgets { device: Some(32), host: Some(32) }, true, 4, 1, 2);
        c.set_promote_after(1);
        placed(&mut c, 0, Device);
        placed(&mut c, 1, Device);
        placed(&mut c, 2, Host);
        placed(&mut c, 3, Host);
        c.set_owner(0, "ann", 3);
        c.set_owner(9, "nobody", 0); // not cached: nothing to own
        // Promoting 2 evicts the device's least recently used, 0, whose
        // owner the cache knows: its demotion is queued, once.
        promote(&mut c, 2);
        assert_eq!(tiers(&c, 0..4), [None, Some(Device), Some(Device), Some(Host)]);
        assert_eq!(c.take_demotions(8), [("ann".to_string(), 3, 0)]);
        assert!(c.take_demotions(8).is_empty());
        // Promoting 3 evicts 1, whose owner it was not told: to the disk.
        promote(&mut c, 3);
        assert_eq!(tiers(&c, 0..4), [None, None, Some(Device), Some(Device)]);
        assert!(c.take_demotions(8).is_empty());
        assert_eq!((c.stats.promoted, c.stats.evictions), (2, [2, 0]));

        // Promotions off, or no host tier: a device eviction queues nothing.
        let mut off = KvCache::with_tiers(Budgets { device: Some(16), host: Some(32) }, true, 4, 1, 2);
        let mut no_host = KvCache::with_tiers(Budgets { device: Some(16), host: None }, false, 4, 1, 2);
        no_host.set_promote_after(1);
        for c in [&mut off, &mut no_host] {
            placed(c, 0, Device);
            c.set_owner(0, "ann", 0);
            placed(c, 1, Device);
            assert_eq!((c.tier(0), c.stats.evictions[0]), (None, 1));
            assert!(c.take_demotions(8).is_empty());
        }
    }

    #[test]
    fn pinned_facts_stay_and_a_fact_that_cannot_fit_goes_past_the_budget() {
        let be = CpuBackend;
        let mut c = KvCache::with_tiers(Budgets { device: Some(32), host: None }, false, 4, 1, 2);
        c.insert(&be, 0, fact(1, 0.0), Admit::Demand).unwrap();
        c.insert(&be, 1, fact(1, 1.0), Admit::Demand).unwrap();
        let pin = c.get(0).unwrap().clone();
        // 0 is older but pinned: 1 goes.
        c.insert(&be, 2, fact(1, 2.0), Admit::Demand).unwrap();
        assert_eq!(tiers(&c, 0..3), [Some(Tier::Device), None, Some(Tier::Device)]);
        let pin2 = c.get(2).unwrap().clone();
        // Both pinned: the new fact is placed past the budget, not refused.
        assert_eq!(c.insert(&be, 3, fact(1, 3.0), Admit::Demand).unwrap(), Some(Tier::Device));
        assert_eq!((c.bytes(Tier::Device), c.stats.over_budget), (48, 1));
        // Fill never evicts: nothing fits now.
        assert_eq!(c.insert(&be, 4, fact(1, 4.0), Admit::Fill).unwrap(), None);
        drop((pin, pin2));
        // Unpinned, they go in LRU order until the budget holds again.
        c.insert(&be, 5, fact(1, 5.0), Admit::Demand).unwrap();
        assert_eq!(tiers(&c, 0..6), [None, None, None, Some(Tier::Device), None, Some(Tier::Device)]);
        assert_eq!(c.bytes(Tier::Device), 32);
        // No host tier: a fact larger than the device budget still serves.
        assert_eq!(c.insert(&be, 6, fact(4, 6.0), Admit::Demand).unwrap(), Some(Tier::Device));
        assert_eq!(c.stats.over_budget, 2);
    }
}
