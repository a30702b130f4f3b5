//! What the memory tiers held, saved so that a restart reads it back before
//! requests ask for it (docs/design.md §8; docs/serving.md, "Restarts").
//!
//! After a restart both tiers are empty and every request's facts are on
//! disk: the first seconds are a burst of reads (on the 400-user stream, a
//! hundred requests whose TTFT p50 was 1.2 s while the steady one is 75 ms,
//! docs/performance.md). The facts that were resident are the ones the next
//! requests ask for — popularity is skewed and changes slowly — so a
//! server with `--kv-warm-restart` on saves which they were
//! ([`Memory::save_resident`]: user and fact id, the device tier's then the
//! host tier's, most recently used first) when it stops, and in idle time
//! now and then for a crash; after a start
//! it reads them back ([`Memory::warm_jobs`]) on reader threads that
//! requests leave free, in that order: a device-tier fact where a request's
//! read would go, a host-tier fact back to the host tier, where that still
//! has room. (Off by default: on the 400-user stream the first requests
//! came too soon after the start for the reads to get ahead of them.)
//!
//! It is a hint, never a source of truth: a warm read never evicts what a
//! request read, never runs ahead of a request's read, skips facts
//! forgotten or changed since (the read checks the record is the fact's),
//! and a list that is damaged, from another memory or unreadable is
//! ignored with a warning — a restart then is as cold as without one.

use std::collections::VecDeque;
use std::path::Path;

use inferscale_engine::Backend;

use crate::cache::{KvCache, Tier};
use crate::error::Result;
use crate::fetch::{ReadFor, ReadJob};
use crate::log;
use crate::shard::{Memory, user_dir_name, user_from_dir_name};

/// The list's file in the memory directory.
pub(crate) const RESIDENT: &str = "resident";

/// The list's first line: what it is and its version.
const MAGIC: &str = "inferscale resident 1";

/// One fact that was resident, from the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WarmFact {
    pub(crate) user: String,
    pub(crate) fact: String,
    pub(crate) tier: Tier,
}

/// Entries a call of [`Memory::warm_jobs`] looks at, at most: those of
/// users it may not read now wait for a later call, in their place.
const LOOK_AHEAD: usize = 256;

/// The list as text: the magic line, a line per fact (`d` or `h`, the
/// user's and the fact's ids in hex: any id fits a line), then `crc32`
/// and the checksum of everything before that line.
fn encode<'a>(facts: impl Iterator<Item = (Tier, &'a str, &'a str)>) -> Vec<u8> {
    let mut out = format!("{MAGIC}\n");
    for (tier, user, fact) in facts {
        let t = match tier {
            Tier::Device => 'd',
            Tier::Host => 'h',
        };
        out.push_str(&format!("{t} {} {}\n", user_dir_name(user), user_dir_name(fact)));
    }
    let crc = crc32fast::hash(out.as_bytes());
    out.push_str(&format!("crc32 {crc:08x}\n"));
    out.into_bytes()
}

/// The facts of a list [`encode`] wrote, or what is wrong with it.
fn decode(bytes: &[u8]) -> std::result::Result<Vec<WarmFact>, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "not text".to_string())?;
    let text = text.strip_suffix('\n').ok_or("cut short")?;
    let (body, last) = text.split_at(text.rfind('\n').map(|i| i + 1).ok_or("no checksum line")?);
    let crc = last
        .strip_prefix("crc32 ")
        .filter(|h| h.len() == 8 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    let crc = crc.and_then(|h| u32::from_str_radix(h, 16).ok()).ok_or_else(|| format!("bad checksum line {last:?}"))?;
    if crc32fast::hash(body.as_bytes()) != crc {
        return Err("checksum mismatch".into());
    }
    let mut lines = body.lines();
    if lines.next() != Some(MAGIC) {
        return Err(format!("not a resident list of this version (expected {MAGIC:?} first)"));
    }
    lines
        .enumerate()
        .map(|(n, line)| {
            let bad = || format!("line {}: {line:?}", n + 2);
            let mut parts = line.split(' ');
            let tier = match parts.next() {
                Some("d") => Tier::Device,
                Some("h") => Tier::Host,
                _ => return Err(bad()),
            };
            let (Some(user), Some(fact), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad());
            };
            let (Some(user), Some(fact)) = (user_from_dir_name(user), user_from_dir_name(fact)) else {
                return Err(bad());
            };
            Ok(WarmFact { user, fact, tier })
        })
        .collect()
}

/// The list saved in `dir` (empty when there is none), or why it cannot
/// be used. The file stays: the next save replaces it.
fn load(dir: &Path) -> std::result::Result<VecDeque<WarmFact>, String> {
    let path = dir.join(RESIDENT);
    let cold = |why: String| format!("{}: ignored ({why}); the KV cache starts cold", path.display());
    match std::fs::read(&path) {
        Ok(bytes) => decode(&bytes).map(VecDeque::from).map_err(cold),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(VecDeque::new()),
        Err(e) => Err(cold(e.to_string())),
    }
}

impl<B: Backend> Memory<B> {
    /// Reads the list the last stop saved, for [`Memory::warm_jobs`] to
    /// read back; returns a warning for a list that cannot be used (it is
    /// then ignored). Opening the memory does not read it: only a server
    /// that warms its tiers after a restart asks.
    pub fn load_resident(&mut self) -> Option<String> {
        let (warm, warning) = match load(&self.dir) {
            Ok(warm) => (warm, None),
            Err(why) => (VecDeque::new(), Some(why)),
        };
        self.warm = warm;
        warning
    }

    /// Whether a fact was cached, used or dropped since the list was last
    /// saved (or it never was): what a periodic save asks first.
    pub fn resident_changed(&self) -> bool {
        self.resident_saved != Some(self.cache.version())
    }

    /// Saves which facts the tiers hold (see the module doc), then the
    /// facts of the last stop's list not read back yet, replacing that
    /// list; returns how many. Written whole or not at all
    /// (`log::replace`): a failure (a full disk) leaves the previous list,
    /// which is only a hint, and is the caller's to log.
    pub fn save_resident(&mut self) -> Result<usize> {
        let version = self.cache.version();
        let mut facts = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (tier, key, owner) in self.cache.resident() {
            // The fact's id by the index the cache was told, or, where a
            // forget moved it since, by its key.
            let Some((user, idx)) = owner else { continue };
            let Some(shard) = self.users.get(user) else { continue };
            let i = match shard.kv.get(idx) {
                Some(kv) if kv.key == key => Some(idx),
                _ => shard.kv.iter().position(|kv| kv.key == key),
            };
            if let Some(fact) = i.and_then(|i| shard.facts.get(i)) {
                seen.insert((user, fact.unit.id.as_str()));
                facts.push((tier, user, fact.unit.id.as_str()));
            }
        }
        for w in &self.warm {
            if seen.insert((&w.user, &w.fact)) {
                facts.push((w.tier, &w.user, &w.fact));
            }
        }
        let path = self.dir.join(RESIDENT);
        log::replace(&path, &encode(facts.iter().copied()))?;
        log::sync_dir(&self.dir)?;
        self.resident_saved = Some(version);
        Ok(facts.len())
    }

    /// Facts of the saved list not read back yet.
    pub fn warm_left(&self) -> usize {
        self.warm.len()
    }

    /// Reads of the saved list's next facts, at most `max`, for reader
    /// threads that requests leave free; cached by
    /// [`Memory::complete_read`] where their tier has room. Facts cached
    /// meanwhile, being read, forgotten or without a record are skipped.
    /// Users not read from disk yet are read here, at most `opens` (a few
    /// milliseconds each, on the caller's thread); the facts of others
    /// keep their place for a later call.
    pub fn warm_jobs(&mut self, max: usize, opens: usize) -> Vec<ReadJob<B>> {
        let (mut jobs, mut later, mut opened, mut looked) = (Vec::new(), Vec::new(), 0, 0);
        while jobs.len() < max
            && looked < LOOK_AHEAD
            && let Some(w) = self.warm.pop_front()
        {
            looked += 1;
            if self.damaged.contains_key(&w.user) || !self.users.listed_user(&w.user) {
                continue;
            }
            if !self.users.is_read(&w.user) {
                if opened == opens {
                    later.push(w);
                    continue;
                }
                opened += 1;
            }
            let Some(shard) = self.users.get(&w.user) else { continue };
            let Some(i) = shard.by_id.get(&w.fact).copied() else { continue };
            let Some(key) = shard.kv.get(i).filter(|kv| kv.at.is_some()).map(|kv| kv.key) else { continue };
            if self.cache.get(key).is_some() || self.reading.contains(&key) {
                continue;
            }
            let place = |cache: &mut KvCache<B>, tokens, per_value| Some(cache.warm_target(w.tier, tokens, per_value));
            if let Some(mut job) = self.read_job(&w.user, i, place) {
                job.purpose = ReadFor::Restart;
                self.reading.insert(key);
                jobs.push(job);
            }
        }
        for w in later.into_iter().rev() {
            self.warm.push_front(w);
        }
        if opened > 0 {
            self.absorb_opened();
        }
        jobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Vec<(Tier, &'static str, &'static str)> {
        vec![(Tier::Device, "alice", "t-1"), (Tier::Device, "bob smith\n", "t 2"), (Tier::Host, "ünï", "")]
    }

    #[test]
    fn a_list_reads_back_as_written_in_order() {
        let got = decode(&encode(facts().into_iter())).unwrap();
        let want: Vec<WarmFact> = facts()
            .into_iter()
            .map(|(tier, user, fact)| WarmFact { user: user.into(), fact: fact.into(), tier })
            .collect();
        assert_eq!(got, want);
        assert_eq!(decode(&encode(std::iter::empty())).unwrap(), vec![]);
    }

    #[test]
    fn any_flipped_bit_or_cut_is_refused() {
        let bytes = encode(facts().into_iter());
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[i] ^= 1 << bit;
                assert!(decode(&bad).is_err(), "byte {i} bit {bit} flipped was accepted");
            }
        }
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "cut at {n} was accepted");
        }
    }

    #[test]
    fn another_version_is_refused_by_name() {
        let text = "inferscale resident 2\n";
        let bytes = format!("{text}crc32 {:08x}\n", crc32fast::hash(text.as_bytes()));
        let err = decode(bytes.as_bytes()).unwrap_err();
        assert!(err.contains("not a resident list of this version"), "{err}");
    }
}
