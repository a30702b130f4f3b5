//! Making a request's facts' KV resident (docs/design.md §8): cached facts
//! are hits; facts whose KV is only on disk are read — at once
//! ([`Memory::fetch`]), or off the engine thread while the request is
//! served without them ([`Memory::fetch_cached`], [`ReadJob`],
//! [`Memory::complete_read`]) — and cached.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use inferscale_engine::{Backend, KvChunk};

use crate::cache::TierUploads;
use crate::cache::{Admit, KvCache, Source, Tier};
use crate::error::{MemoryError, Result};
use crate::kvseg::{KvFormat, KvHeader, StoredKv};
use crate::log::{Frame, read_frame_at};
use crate::shard::Memory;

/// KV a request holds: while this lives, the cache does not evict it.
pub struct Pinned<B: Backend> {
    chunks: Vec<Arc<KvChunk<B>>>,
}

impl<B: Backend> Pinned<B> {
    /// Facts held.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Holds `other`'s facts too.
    pub fn extend(&mut self, other: Pinned<B>) {
        self.chunks.extend(other.chunks);
    }
}

/// What a fetch found and did.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct FetchReport {
    /// Facts found cached, per tier.
    pub device_hits: usize,
    pub host_hits: usize,
    /// Facts read from disk, their record bytes, and the time the reads
    /// took (read, check, decode, cache).
    pub loaded: usize,
    pub loaded_bytes: u64,
    pub load_seconds: f64,
}

impl FetchReport {
    /// Adds `other`'s counts to this one's.
    pub fn add(&mut self, other: FetchReport) {
        self.device_hits += other.device_hits;
        self.host_hits += other.host_hits;
        self.loaded += other.loaded;
        self.loaded_bytes += other.loaded_bytes;
        self.load_seconds += other.load_seconds;
    }
}

pub struct Fetched<B: Backend> {
    pub pinned: Pinned<B>,
    pub report: FetchReport,
    /// Facts without KV: to encode ([`Memory::ensure_kv`]).
    pub missing: Vec<usize>,
    /// Facts whose KV is on disk and was not read ([`Memory::fetch_cached`]).
    pub cold: Vec<usize>,
}

/// One fact's KV record to read off the engine thread: everything the read
/// needs, so that it holds no reference into the memory.
pub struct ReadJob<B: Backend> {
    user: String,
    key: u64,
    frame: Frame,
    path: PathBuf,
    seg: KvHeader,
    fact_id: String,
    tokens: Vec<u32>,
    /// The tier the cache chose for it, and the device bytes it reserved
    /// there ([`Memory::read_jobs`]).
    to: Tier,
    reserved: u64,
    /// Places the KV in that tier (`None`: the engine thread places it).
    upload: TierUploads<B::Tensor>,
    /// Whose read it is.
    pub(crate) purpose: ReadFor,
}

/// Why a [`ReadJob`] reads: it decides how what it read is cached and
/// counted ([`Memory::complete_read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadFor {
    /// A request's fact (or a promotion's): cached, evicting if need be;
    /// a miss when it was not cached.
    Request,
    /// A device victim read again into the host tier
    /// ([`KvCache::take_demotions`]).
    Demotion,
    /// A fact that was resident before a restart (`resident.rs`): cached
    /// only where its tier has room, never counted as a miss.
    Restart,
}

/// A finished [`ReadJob`], for [`Memory::complete_read`].
pub struct ReadDone<B: Backend> {
    job: ReadJob<B>,
    /// The record's KV as the cache takes it: decoded tensors for the
    /// engine thread to place, or already placed by the reader.
    result: Result<Source<B>>,
    pub seconds: f64,
}

impl<B: Backend> ReadJob<B> {
    /// Reads and checks the record (its CRC, then that it is this fact's:
    /// the segment may have been rewritten since), decodes it and, when the
    /// backend lets other threads upload, places it: conversion and pinned
    /// copy are this thread's work, not the engine thread's. An upload that
    /// fails (no pinned memory) leaves the tensors for the engine thread,
    /// whose own attempt then reports the error; only a bad record counts
    /// as one.
    pub fn run(self) -> ReadDone<B> {
        let t0 = Instant::now();
        let result = read_frame_at(&self.path, self.frame).and_then(|bytes| self.place(&bytes));
        ReadDone { job: self, result, seconds: t0.elapsed().as_secs_f64() }
    }

    /// The record's KV as the cache takes it, placed in the job's tier. An
    /// fp8 record goes there as stored when the backend keeps fp8 in that
    /// tier (its injection dequantizes); any other is decoded and converted.
    fn place(&self, bytes: &[u8]) -> Result<Source<B>> {
        if let (Some(up), KvFormat::Fp8) = (&self.upload.fp8, self.seg.dtype) {
            let (fact_id, tokens, kv) = StoredKv::fp8_parts(bytes, &self.seg, &self.path)?;
            self.check_ours(&fact_id, &tokens)?;
            match up(&kv) {
                Ok(mut k) if k.len() == kv.tensors() => {
                    let v = k.split_off(kv.layers);
                    return Ok(Source::Uploaded(KvChunk { tokens, k, v }, self.to));
                }
                // As below: decoded, the engine thread's own upload reports it.
                _ => {}
            }
        }
        let s = StoredKv::decode(bytes, &self.seg, &self.path)?;
        self.check_ours(&s.fact_id, &s.tokens)?;
        let placed = self.upload.bf.as_ref().map(|up| KvChunk::from_host_tier_with(up, s.tokens.clone(), &s.k, &s.v));
        Ok(match placed {
            Some(Ok(chunk)) => Source::Uploaded(chunk, self.to),
            _ => Source::Host { tokens: s.tokens, k: s.k, v: s.v },
        })
    }

    /// The record is this fact's (the segment may have been rewritten since
    /// the read was planned).
    fn check_ours(&self, fact_id: &str, tokens: &[u32]) -> Result<()> {
        match fact_id == self.fact_id && tokens == self.tokens {
            true => Ok(()),
            false => Err(MemoryError::Corrupt {
                path: self.path.clone(),
                offset: self.frame.offset,
                reason: format!("the record indexed for fact {:?} is another's", self.fact_id),
            }),
        }
    }
}

impl<B: Backend> Memory<B> {
    /// The read of `user`'s fact `i`'s record (`None`: it has none, or
    /// `place` declined), bound for the tier `place` picks from the fact's
    /// tokens and the bytes a value takes in device memory (`None`: readers
    /// cannot place there), with the device bytes it reserved.
    pub(crate) fn read_job(
        &mut self,
        user: &str,
        i: usize,
        place: impl FnOnce(&mut KvCache<B>, usize, Option<u64>) -> Option<(Tier, u64)>,
    ) -> Option<ReadJob<B>> {
        let shard = self.users.get(user)?;
        let (fact, kv) = (shard.facts.get(i)?, shard.kv.get(i)?);
        let frame = kv.at?;
        let device = &self.upload.device;
        // What the record takes in device memory: fp8 as stored where the
        // backend keeps it so, else the backend's own values.
        let per_value = match (shard.seg.dtype, &device.fp8) {
            (KvFormat::Fp8, Some(_)) => Some(1),
            _ => device.bf.as_ref().map(|_| self.cache.bytes_per_value()),
        };
        let (to, reserved) = place(&mut self.cache, fact.tokens.len(), per_value)?;
        let upload = match to {
            Tier::Device => device.clone(),
            Tier::Host => self.upload.host.clone(),
        };
        Some(ReadJob {
            upload,
            to,
            reserved,
            user: user.to_string(),
            key: kv.key,
            frame,
            path: shard.kv_log.path().to_path_buf(),
            seg: shard.seg.clone(),
            fact_id: fact.unit.id.clone(),
            tokens: fact.tokens.clone(),
            purpose: ReadFor::Request,
        })
    }

    /// [`Memory::read_job`] bound for the tier the cache picks
    /// (`KvCache::read_target`): the device while it has room, else the
    /// host tier.
    fn cache_read_job(&mut self, user: &str, i: usize) -> Option<ReadJob<B>> {
        self.read_job(user, i, |cache, tokens, per_value| Some(cache.read_target(tokens, per_value)))
    }
}

impl<B: Backend> Memory<B> {
    /// Makes the KV of `user`'s facts `idxs` resident and pins it for as
    /// long as the returned [`Pinned`] lives (a request holds it from
    /// admission to layout). Cached facts count as hits, served from the
    /// tier they are in; the others are read from the segment now — the
    /// [`ReadJob`]s of [`Memory::read_jobs`], several at once, each checked
    /// against its CRC and its fact and decoded from the segment's format —
    /// and cached as [`Memory::complete_read`] caches a background read,
    /// evicting the least recently used (`cache.rs`). Facts without KV
    /// (never encoded, or a record that failed its check, now dropped) are
    /// returned in `missing` for [`Memory::ensure_kv`].
    pub fn fetch(&mut self, be: &B, user: &str, idxs: &[usize]) -> Result<Fetched<B>> {
        let mut out = self.fetch_cached(user, idxs)?;
        if out.cold.is_empty() {
            return Ok(out);
        }
        let cold = std::mem::take(&mut out.cold);
        if !self.users.contains_key(user) {
            return Err(MemoryError::UnknownUser(user.to_string()));
        }
        let jobs: Vec<(usize, ReadJob<B>)> =
            cold.iter().filter_map(|&i| self.cache_read_job(user, i).map(|job| (i, job))).collect();
        let t0 = Instant::now();
        let (idx, jobs): (Vec<usize>, Vec<ReadJob<B>>) = jobs.into_iter().unzip();
        for (i, done) in idx.into_iter().zip(run_parallel(jobs)) {
            let (key, bytes) = (done.job.key, done.job.frame.len as u64);
            // Pinned as it is cached, so that the next ones cannot evict it.
            match self.complete_read(be, done)? {
                true => {
                    out.report.loaded += 1;
                    out.report.loaded_bytes += bytes;
                    out.pinned.chunks.extend(self.cache.get(key).cloned());
                }
                false => out.missing.push(i),
            }
        }
        out.report.load_seconds = t0.elapsed().as_secs_f64();
        Ok(out)
    }

    /// [`Memory::fetch`] without reading anything: facts whose KV is on
    /// disk only are returned in `cold` (for the caller to read off the
    /// engine thread with [`Memory::read_jobs`], and to serve this request
    /// without their KV).
    pub fn fetch_cached(&mut self, user: &str, idxs: &[usize]) -> Result<Fetched<B>> {
        self.check_intact(user)?;
        let shard = self.users.get(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))?;
        if let Some(&i) = idxs.iter().find(|&&i| i >= shard.facts.len()) {
            return Err(MemoryError::Invalid {
                what: "fact",
                reason: format!("{user:?} has {} facts, not {}", shard.facts.len(), i + 1),
            });
        }
        self.cache.trim();
        let mut out = Fetched {
            pinned: Pinned { chunks: Vec::new() },
            report: FetchReport::default(),
            missing: Vec::new(),
            cold: Vec::new(),
        };
        for &i in idxs {
            let key = shard.kv[i].key;
            match self.cache.hit(key) {
                Some(Tier::Device) => out.report.device_hits += 1,
                Some(Tier::Host) => {
                    out.report.host_hits += 1;
                    if self.promote.len() < MAX_PROMOTIONS_QUEUED && self.cache.promotion_due(key) {
                        self.promote.push_back((user.to_string(), i, key));
                    }
                }
                None if shard.kv[i].at.is_some() => out.cold.push(i),
                None => out.missing.push(i),
            }
            // Pinned at once, so that what is cached next cannot evict it.
            if let Some(c) = self.cache.get(key) {
                out.pinned.chunks.push(c.clone());
            }
        }
        Ok(out)
    }

    /// Reads of `user`'s facts `idxs` (from [`Fetched::cold`]) for another
    /// thread to run ([`ReadJob::run`]); facts already being read, cached
    /// meanwhile, or without a record are left out.
    pub fn read_jobs(&mut self, user: &str, idxs: &[usize]) -> Result<Vec<ReadJob<B>>> {
        let keys: Vec<Option<u64>> = {
            let shard = self.user(user)?;
            idxs.iter().map(|&i| shard.kv.get(i).filter(|kv| kv.at.is_some()).map(|kv| kv.key)).collect()
        };
        let mut jobs = Vec::new();
        for (&i, key) in idxs.iter().zip(keys) {
            let Some(key) = key else { continue };
            if self.cache.get(key).is_some() || self.reading.contains(&key) {
                continue;
            }
            if let Some(job) = self.cache_read_job(user, i) {
                self.reading.insert(key);
                jobs.push(job);
            }
        }
        Ok(jobs)
    }

    /// Reads that move facts between the tiers, at most `max`, for the
    /// reader threads; cached by [`Memory::complete_read`] like any read:
    /// first the device facts promotions evicted, into the host tier
    /// (demotions), then promotions of host-tier facts onto the device
    /// (see `cache.rs`: facts hit `promote_after` times in the host tier).
    /// Empty unless promotions are on, the backend can place reads on the
    /// device from another thread, and one is due.
    pub fn promotion_jobs(&mut self, max: usize) -> Vec<ReadJob<B>> {
        let mut jobs = Vec::new();
        for (user, idx, key) in self.cache.take_demotions(max) {
            // Cached again meanwhile (a request read it), or being read.
            if self.cache.tier(key).is_some() || self.reading.contains(&key) {
                continue;
            }
            // Where its fact is now (a forget moves the later ones down).
            let Some(i) = self.users.get(&user).and_then(|s| match s.kv.get(idx) {
                Some(kv) if kv.key == key => Some(idx),
                _ => s.kv.iter().position(|kv| kv.key == key),
            }) else {
                continue;
            };
            if let Some(mut job) = self.read_job(&user, i, |_, _, _| Some((Tier::Host, 0))) {
                job.purpose = ReadFor::Demotion;
                self.reading.insert(key);
                jobs.push(job);
            }
        }
        while jobs.len() < max
            && let Some((user, i, key)) = self.promote.pop_front()
        {
            if self.cache.tier(key) != Some(Tier::Host) || self.reading.contains(&key) {
                continue;
            }
            if self.users.get(&user).and_then(|s| s.kv.get(i)).is_none_or(|kv| kv.key != key) {
                continue;
            }
            let place = |cache: &mut KvCache<B>, _, per_value: Option<u64>| {
                Some((Tier::Device, cache.reserve_promotion(key, per_value?)?))
            };
            if let Some(job) = self.read_job(&user, i, place) {
                self.reading.insert(key);
                jobs.push(job);
            }
        }
        jobs
    }

    /// Caches what a [`ReadJob`] read, if its fact still has that record
    /// (it may have been forgotten, updated or moved meanwhile: then the
    /// read is dropped). A record that failed its check is dropped and its
    /// fact re-encoded when next needed. Returns whether it cached the KV.
    pub fn complete_read(&mut self, be: &B, done: ReadDone<B>) -> Result<bool> {
        let ReadDone { job, result, .. } = done;
        self.reading.remove(&job.key);
        self.cache.release(job.reserved);
        let Some(shard) = self.users.get(&job.user) else { return Ok(false) };
        let Some(i) = shard.kv.iter().position(|k| k.key == job.key && k.at == Some(job.frame)) else {
            return Ok(false);
        };
        let cached = self.cache.tier(job.key).is_some();
        match result {
            // A demotion or warm read whose fact a request's read cached
            // meanwhile: that copy stays.
            Ok(_) if job.purpose != ReadFor::Request && cached => Ok(false),
            Ok(source) => {
                // A promotion's fact is cached already (in the host tier), a
                // demotion's was evicted by one, a warm read's was never
                // asked for: no miss.
                if !cached && job.purpose == ReadFor::Request {
                    self.cache.stats.misses += 1;
                    self.cache.stats.loaded_bytes += job.frame.len as u64;
                }
                let admit = match job.purpose {
                    ReadFor::Restart => Admit::Fill,
                    ReadFor::Request | ReadFor::Demotion => Admit::Demand,
                };
                let placed = self.cache.insert(be, job.key, source, admit)?;
                if placed.is_some() {
                    self.cache.set_owner(job.key, &job.user, i);
                    match job.purpose {
                        ReadFor::Demotion => self.cache.stats.demoted += 1,
                        ReadFor::Restart => self.cache.stats.warmed += 1,
                        ReadFor::Request => {}
                    }
                }
                Ok(placed.is_some())
            }
            Err(e) => {
                tracing::warn!(user = job.user, error = %e, "a stored KV record failed its check; the fact is re-encoded");
                self.drop_records(&job.user, &[i])?;
                Ok(false)
            }
        }
    }

    /// Forgets the records of `user`'s facts `idxs` (they failed their
    /// check): the facts are re-encoded when next needed.
    fn drop_records(&mut self, user: &str, idxs: &[usize]) -> Result<()> {
        if idxs.is_empty() {
            return Ok(());
        }
        let shard = crate::shard::shard_mut(&mut self.users, &self.damaged, user)?;
        idxs.iter().for_each(|&i| shard.kv[i].at = None);
        self.cache.stats.corrupt += idxs.len() as u64;
        self.pending.insert(user.to_string());
        Ok(())
    }
}

/// Promotions waiting for [`Memory::promotion_jobs`] at most: a caller
/// that never asks (a CLI command) holds no more than this.
const MAX_PROMOTIONS_QUEUED: usize = 256;

/// Runs `jobs` several at once, in order: a device queue (NVMe) reaches
/// its bandwidth only with many reads in flight, and decoding a compact
/// format is work for more than one core.
fn run_parallel<B: Backend>(mut jobs: Vec<ReadJob<B>>) -> Vec<ReadDone<B>> {
    const READERS: usize = 8;
    if jobs.len() < 2 {
        return jobs.into_iter().map(ReadJob::run).collect();
    }
    let per = jobs.len().div_ceil(READERS);
    let mut parts = Vec::new();
    while !jobs.is_empty() {
        let rest = jobs.split_off(per.min(jobs.len()));
        parts.push(std::mem::replace(&mut jobs, rest));
    }
    std::thread::scope(|s| {
        let handles: Vec<_> =
            parts.into_iter().map(|p| s.spawn(move || p.into_iter().map(ReadJob::run).collect::<Vec<_>>())).collect();
        // A reader that panicked is a bug: its panic goes on here.
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}
