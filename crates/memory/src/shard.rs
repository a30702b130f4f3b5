//! Per-user memory: facts (durable source of truth), their pre-RoPE KV
//! (derived, persisted, re-encoded when missing), retrieval.
//!
//! On disk, under the memory directory:
//!
//! ```text
//! users/<hex of user id>/facts.log   fact records, fsynced before ingest returns
//! users/<hex of user id>/kv.log      KV segment: header record, then one record per fact
//! ```
//!
//! One directory per user keeps shards independent: forgetting a user is
//! removing its directory, and nothing of one user is ever read while
//! answering another.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use inferscale_engine::{Backend, Engine, KvChunk};
use inferscale_types::MemoryUnit;

use crate::cache::{Budgets, CacheStats, KvCache, Tier};
use crate::compose::{Composer, Prompts};
use crate::error::{MemoryError, Result, io};
use crate::fact::{Event, Fact, Record};
use crate::kvseg::{KvFormat, KvHeader};
use crate::log::{MAX_RECORD_BYTES, sync_dir};
use crate::retrieval::{self, Query, Retriever};
use crate::user::{Encoders, Encoding, UserShard};
use crate::users::Users;

/// Facts encoded per engine call by default (their forward passes are
/// packed together); see [`Memory::set_encode_batch`].
const ENCODE_BATCH: usize = 16;

/// What the shard's KV is made with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    /// Context window: turns encoded before each fact (0 = isolated).
    pub window: usize,
    /// Identifies the model whose KV this is (see [`fingerprint`]).
    pub fingerprint: String,
}

impl ShardSpec {
    /// The spec of a memory whose KV `files` encode with `window` turns of
    /// context after the header of `prompts`' system prompt (a non-default
    /// one is part of the fingerprint, see [`Prompts::kv_tag`]).
    pub fn new(files: &inferscale_model::ModelFiles, window: usize, prompts: &Prompts) -> Result<Self> {
        Ok(ShardSpec { window, fingerprint: fingerprint(files)? + &prompts.kv_tag() })
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IngestReport {
    pub added: usize,
    /// Turns whose id the user already had (ingest is idempotent).
    pub skipped: usize,
    pub encoded_tokens: usize,
}

/// Checks `turns` as [`Memory::ingest`] would, storing nothing: a caller
/// that ingests in several calls validates the whole request first.
pub fn validate(user: &str, turns: &[MemoryUnit]) -> Result<()> {
    if user.is_empty() {
        return Err(MemoryError::Invalid { what: "user", reason: "empty user id".into() });
    }
    let mut seen = std::collections::HashSet::new();
    for t in turns {
        if t.id.is_empty() || t.text.trim().is_empty() {
            return Err(MemoryError::Invalid {
                what: "turn",
                reason: format!("turn {:?} has an empty id or text", t.id),
            });
        }
        if t.id.len() > inferscale_types::MAX_ID_BYTES || t.source_turn.len() > inferscale_types::MAX_ID_BYTES {
            return Err(MemoryError::Invalid {
                what: "turn",
                reason: format!(
                    "a unit id (or source turn) of {} bytes; the limit is {}",
                    t.id.len().max(t.source_turn.len()),
                    inferscale_types::MAX_ID_BYTES
                ),
            });
        }
        if t.id.chars().chain(t.source_turn.chars()).any(char::is_control) {
            return Err(MemoryError::Invalid {
                what: "turn",
                reason: format!("turn id {:?} (or its source turn) contains control characters", t.id),
            });
        }
        if !seen.insert(t.id.as_str()) {
            return Err(MemoryError::Invalid { what: "turn", reason: format!("turn id {:?} appears twice", t.id) });
        }
        if t.source_turn == t.id {
            return Err(MemoryError::Invalid {
                what: "fact",
                reason: format!("fact {:?} names itself as its source turn", t.id),
            });
        }
        for (name, v) in [("agent_id", &t.agent_id), ("run_id", &t.run_id)] {
            if v.len() > 256 || v.chars().any(char::is_control) {
                return Err(MemoryError::Invalid {
                    what: "unit",
                    reason: format!("unit {:?}: {name} must be at most 256 bytes without control characters", t.id),
                });
            }
        }
        let meta = serde_json::Value::Object(t.metadata.clone()).to_string().len();
        if meta > inferscale_types::MAX_METADATA_BYTES {
            return Err(MemoryError::Invalid {
                what: "unit",
                reason: format!(
                    "unit {:?} has {meta} bytes of metadata; the limit is {}",
                    t.id,
                    inferscale_types::MAX_METADATA_BYTES
                ),
            });
        }
    }
    Ok(())
}

/// Bytes of a KV record beyond its tokens' (fact id, framing): ids are
/// short, this bounds them generously.
const RECORD_RESERVE: usize = 64 << 10;

pub(crate) fn check_length(u: &MemoryUnit, tokens: usize, max: usize) -> Result<()> {
    match tokens <= max {
        true => Ok(()),
        false => Err(MemoryError::Invalid {
            what: "unit",
            reason: format!(
                "unit {:?} is {tokens} tokens long; a unit may have at most {max} (split it, or store facts extracted from it)",
                u.id
            ),
        }),
    }
}

/// Where a shard's bytes are, for the stores-per-tier metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Pre-RoPE K and V cached in the backend's memory (device memory on a
    /// GPU backend, host memory on the CPU one).
    pub kv_resident_bytes: u64,
    /// Pre-RoPE K and V cached in the host tier (pinned host memory).
    pub kv_host_tier_bytes: u64,
    /// Fact and KV logs on disk.
    pub disk_bytes: u64,
    /// The KV cache's counters since the memory opened.
    pub cache: CacheStats,
}

pub struct Memory<B: Backend> {
    pub(crate) dir: PathBuf,
    pub(crate) spec: ShardSpec,
    /// What this shard's KV segments must have been made with, in the
    /// format new segments are written in.
    pub(crate) header: KvHeader,
    /// Every user, read from disk when first used (`users.rs`).
    pub(crate) users: Users<B>,
    /// Users whose stored memory failed to open as damaged (not a torn
    /// tail), with what was found: refused until repaired, never served
    /// as if empty. (A user found unreadable when first used is refused
    /// alike: [`Users::failures`].)
    pub(crate) damaged: BTreeMap<String, String>,
    /// Users whose unfinished ingest could not be rolled back yet
    /// (`commit.rs`): their writes wait, [`Memory::settle`] retries.
    pub(crate) unsettled: std::collections::BTreeSet<String>,
    /// Where the idle-time pass over KV records is (`scrub.rs`).
    pub(crate) scrub: ScrubCursor,
    /// Users that may have facts without KV (stored deferred, imported
    /// without it, or dropped as corrupt): [`Memory::encode_pending`]'s work.
    pub(crate) pending: std::collections::BTreeSet<String>,
    pub(crate) encode_batch: usize,
    /// The facts' KV held in memory, by tier (`cache.rs`).
    pub(crate) cache: KvCache<B>,
    /// Cache keys of facts being read off the engine thread (`fetch.rs`).
    pub(crate) reading: std::collections::HashSet<u64>,
    /// Facts resident before the last stop, not read back yet
    /// ([`Memory::load_resident`]).
    pub(crate) warm: std::collections::VecDeque<crate::resident::WarmFact>,
    /// The cache's version when its resident facts were last saved.
    pub(crate) resident_saved: Option<(u64, usize)>,
    /// Host-tier facts due for promotion (user, fact, cache key), for
    /// [`Memory::promotion_jobs`].
    pub(crate) promote: std::collections::VecDeque<(String, usize, u64)>,
    /// The backend's uploads for reads to place what they read in the
    /// tier the cache chose, on their own thread (`fetch.rs`).
    pub(crate) upload: crate::cache::Uploads<B::Tensor>,
    /// The model's context, in tokens: an encoding (header, window, fact)
    /// must fit it.
    pub(crate) context: usize,
    /// How [`Memory::retrieve`] ranks facts.
    retriever: Retriever,
    /// Exclusive lock on `dir/LOCK`, held while this value lives: a second
    /// writer would interleave appends and rewrites with ours.
    _lock: std::fs::File,
}

/// `user`'s shard, borrowing only the two maps a memory keeps of its users
/// (so that the caller may use the memory's other fields meanwhile): an
/// error for a damaged or unknown user.
pub(crate) fn shard_mut<'a, B: Backend>(
    users: &'a mut Users<B>,
    damaged: &BTreeMap<String, String>,
    user: &str,
) -> Result<&'a mut UserShard<B>> {
    if damaged.contains_key(user) {
        return Err(MemoryError::UserDamaged(user.to_string()));
    }
    users.open_now(user)?;
    users.get_mut(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))
}

/// The name of `user`'s directory under `users/`: its id's bytes in hex
/// (any id is a valid file name, and ids stay apart).
pub fn user_dir_name(user: &str) -> String {
    user.bytes().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn user_from_dir_name(name: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> =
        (0..name.len()).step_by(2).map(|i| name.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect();
    bytes.and_then(|b| String::from_utf8(b).ok())
}

/// A model identity for KV segments: family, shape and the file's size and
/// first MiB, cheap to compute and different for any other checkpoint.
pub fn fingerprint(files: &inferscale_model::ModelFiles) -> Result<String> {
    use std::io::Read;
    let c = &files.config;
    let mut h = crc32fast::Hasher::new();
    h.update(format!("{:?}", c).as_bytes());
    let path = if files.path.is_dir() { files.path.join("model.safetensors") } else { files.path.clone() };
    if let Ok(mut f) = std::fs::File::open(&path) {
        let len = f.metadata().map_err(io(&path))?.len();
        h.update(&len.to_le_bytes());
        let mut head = vec![0u8; 1 << 20];
        let n = f.read(&mut head).map_err(io(&path))?;
        h.update(&head[..n]);
    }
    Ok(format!("{:?}-{}l-{:08x}", c.family, c.num_layers, h.finalize()).to_lowercase())
}

/// How a memory stores and caches its KV.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// Format of new segments (`None`: the backend's own values, see
    /// [`KvFormat::for_backend`]). Segments already written keep theirs.
    pub format: Option<KvFormat>,
    /// Bytes of KV the device and host tiers may cache.
    pub budgets: Budgets,
    /// Promote a host-tier fact onto the device after this many hits in
    /// the host tier (0: never; `cache.rs`).
    pub promote_after: u32,
    /// Read each user when first used (and in idle time,
    /// [`Memory::open_some`]) rather than all of them before the memory
    /// opens: what a server does, so that a node of thousands of users
    /// answers within a second of a restart (`users.rs`). What reading a
    /// user later finds (a dropped tail, damage) is logged then, not
    /// returned by the open.
    pub lazy_users: bool,
    /// Keep a host tier under `budgets.host` even where the backend has
    /// none (the CPU): both tiers then live in the same memory, so nothing
    /// is faster for it, but reads, promotions and demotions between them
    /// run as on a GPU — for tests and for trying a policy without one.
    pub emulated_host_tier: bool,
}

impl<B: Backend> Memory<B> {
    /// Opens (or creates) the memory at `dir` with default
    /// [`StoreOptions`]: the backend's format, no cache limits.
    pub fn open(dir: &Path, spec: ShardSpec, engine: &Engine<B>) -> Result<(Self, Vec<String>)> {
        Self::open_with(dir, spec, engine, StoreOptions::default())
    }

    /// Opens (or creates) the memory at `dir`, reading every user's facts
    /// and the index of their KV records — not the KV, which is read when
    /// first needed ([`Memory::fetch`]), so opening costs the same whatever
    /// the KV's size. Returns warnings for anything dropped (torn log
    /// tails, corrupt KV records): facts whose KV is missing are re-encoded
    /// by [`Memory::ensure_kv`].
    pub fn open_with(
        dir: &Path,
        spec: ShardSpec,
        engine: &Engine<B>,
        options: StoreOptions,
    ) -> Result<(Self, Vec<String>)> {
        let c = engine.model().config();
        let be = engine.backend();
        let dtype = options.format.unwrap_or(KvFormat::for_backend(be.kv_bytes_per_value()));
        let kv_header = KvHeader {
            fingerprint: spec.fingerprint.clone(),
            window: spec.window,
            dtype,
            layers: c.num_layers,
            kv_dim: c.kv_dim(),
            head_dim: c.head_dim,
            layout: KvHeader::layout_of(dtype),
        };
        let users_dir = dir.join("users");
        std::fs::create_dir_all(&users_dir).map_err(io(&users_dir))?;
        let lock_path = dir.join("LOCK");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(MemoryError::Locked { path: dir.to_path_buf() }),
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&lock_path)(e)),
        }
        let mut warnings = recover(dir)?;
        let (mut listed, mut now) = (Vec::new(), Vec::new());
        let entries = std::fs::read_dir(&users_dir).map_err(io(&users_dir))?;
        for entry in entries {
            let entry = entry.map_err(io(&users_dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(user) = user_from_dir_name(&name) else {
                warnings.push(format!("{}: not a user directory, ignored", entry.path().display()));
                continue;
            };
            // A directory without a fact log holds no user (an ingest that
            // stored nothing): opening it would create files, which a full
            // disk refuses.
            let pending = entry.path().join(crate::manifest::PENDING).exists();
            if !pending && !entry.path().join("facts.log").exists() {
                let _ = std::fs::remove_dir_all(entry.path());
                continue;
            }
            // An unfinished ingest is rolled back before anything is served.
            match options.lazy_users && !pending {
                true => listed.push(user),
                false => now.push(user),
            }
        }
        listed.sort();
        // Read lazily, one user is still read now: a memory made with
        // another model is refused at open, not at its users' first use.
        if let Some(first) = listed.first().filter(|_| now.is_empty()) {
            now.push(first.clone());
            listed.remove(0);
        }
        let mut users = Users::listed(users_dir.clone(), kv_header.clone(), listed);
        let mut damaged = BTreeMap::new();
        for user in now {
            match UserShard::open(&users_dir.join(user_dir_name(&user)), &kv_header, &mut warnings) {
                Ok(shard) => users.insert(user, shard),
                // Out of file descriptors is the node's state, not damage.
                Err(e) if e.out_of_files() => return Err(e),
                // Damage to one user's files costs that user, not the node.
                Err(e @ (MemoryError::Damaged { .. } | MemoryError::Corrupt { .. } | MemoryError::Io { .. })) => {
                    warnings.push(format!("user {user:?} is unavailable until repaired: {e}"));
                    damaged.insert(user, e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
        let mut memory = Memory {
            dir: dir.to_path_buf(),
            spec,
            header: kv_header,
            pending: users.opened().map(|(u, _)| u.clone()).collect(),
            users,
            damaged,
            unsettled: Default::default(),
            scrub: Default::default(),
            encode_batch: ENCODE_BATCH,
            cache: {
                let mut cache = KvCache::new(be, options.budgets, c.num_layers, c.kv_dim(), options.emulated_host_tier);
                cache.set_promote_after(options.promote_after);
                cache
            },
            reading: Default::default(),
            warm: Default::default(),
            resident_saved: None,
            promote: Default::default(),
            upload: crate::cache::Uploads::of(be),
            context: c.max_position_embeddings,
            retriever: Retriever::default(),
            _lock: lock,
        };
        memory.recover_ingests(&mut warnings)?;
        Ok((memory, warnings))
    }

    /// Facts encoded per engine call. Each holds KV blocks of the engine's
    /// pool while it is encoded (its context window, then the fact), so a
    /// server that encodes between serving steps keeps this small and
    /// reserves that many encodings' blocks.
    pub fn set_encode_batch(&mut self, n: usize) {
        self.encode_batch = n.max(1);
    }

    pub fn spec(&self) -> &ShardSpec {
        &self.spec
    }

    /// Every user (read or not yet; not those found unreadable).
    pub fn users(&self) -> impl Iterator<Item = &str> {
        self.users.keys().map(String::as_str)
    }

    /// Users not read from disk yet (see [`StoreOptions::lazy_users`]).
    pub fn unread_users(&self) -> usize {
        self.users.unread()
    }

    /// Reads up to `max` users not read yet (idle-time work of a memory
    /// opened with [`StoreOptions::lazy_users`]); returns how many it read.
    /// What the reading found is acted on (`absorb_opened`).
    pub fn open_some(&mut self, max: usize) -> usize {
        let n = self.users.open_some(max);
        self.absorb_opened();
        n
    }

    /// Acts on what reading users through shared borrows found: warnings
    /// logged, facts without KV queued for background encoding, users
    /// found unreadable refused as damaged.
    pub(crate) fn absorb_opened(&mut self) {
        let opened = self.users.take_opened();
        for w in opened.warnings {
            tracing::warn!("{w}");
        }
        self.pending.extend(opened.need_kv);
        for (user, why) in opened.failed {
            self.users.remove(&user);
            self.damaged.insert(user, why);
        }
    }

    /// Every user with the digest of its units (equal on two workers
    /// exactly when both hold the same units, up to a 64-bit collision).
    /// Reads every user not read yet.
    pub fn digests(&self) -> impl Iterator<Item = (&str, u64)> {
        self.users.iter().map(|(u, s)| (u.as_str(), s.digest))
    }

    /// Bytes held per tier. O(users): meant for a scrape, not a hot path.
    /// The disk's bytes are those of the users read so far.
    pub fn footprint(&self) -> Footprint {
        Footprint {
            kv_resident_bytes: self.cache.bytes(Tier::Device),
            kv_host_tier_bytes: self.cache.bytes(Tier::Host),
            disk_bytes: self.users.opened().map(|(_, u)| u.log.len() + u.kv_log.len()).sum(),
            cache: self.cache.stats,
        }
    }

    /// The KV cache's counters since the memory opened.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats
    }

    /// Where fact `idx` of `user`'s KV is cached (`None`: on disk only, or
    /// not encoded).
    pub fn tier(&self, user: &str, idx: usize) -> Result<Option<Tier>> {
        let shard = self.user(user)?;
        Ok(shard.kv.get(idx).and_then(|k| self.cache.tier(k.key)))
    }

    /// The format `user`'s KV segment stores values in.
    pub fn kv_format(&self, user: &str) -> Result<KvFormat> {
        Ok(self.user(user)?.seg.dtype)
    }

    pub fn facts(&self, user: &str) -> Result<&[Fact]> {
        Ok(&self.user(user)?.facts)
    }

    /// `user`'s facts as the units they were stored from, in order.
    pub fn units(&self, user: &str) -> Result<Vec<MemoryUnit>> {
        Ok(self.facts(user)?.iter().map(|f| f.unit.clone()).collect())
    }

    /// The user's units with when each was stored and last changed.
    pub fn stored(&self, user: &str) -> Result<Vec<inferscale_types::StoredUnit>> {
        Ok(self.facts(user)?.iter().map(Fact::stored).collect())
    }

    /// Facts stored here, over the users read so far (every user, unless
    /// the memory was opened with [`StoreOptions::lazy_users`] moments ago).
    pub fn fact_count(&self) -> usize {
        self.users.opened().map(|(_, s)| s.facts.len()).sum()
    }

    /// The longest fact line a unit may make, in tokens: its encoding
    /// (after the header's `header_tokens`) must fit the model's context,
    /// and its KV one log record, in the widest format among this memory's
    /// segments and new ones (bf16 holds twice f32's tokens, fp8 four
    /// times).
    pub fn max_fact_tokens(&self, header_tokens: usize) -> usize {
        let by_context = self.context.saturating_sub(header_tokens + 1);
        // A record holds the fact's token ids and its K and V in every
        // layer, in its segment's format (fp8 adds scales per record); the
        // widest format of this memory's segments, old ones included, bounds
        // every unit. The fact id and framing take the rest of the reserve.
        let widest = self.users.opened().map(|(_, u)| &u.seg).chain([&self.header]).max_by_key(|h| h.tensor_bytes(1));
        let widest = widest.unwrap_or(&self.header);
        let fixed = widest.tensor_bytes(0);
        let per_token = 4 + widest.tensor_bytes(1) - fixed;
        let by_record = (MAX_RECORD_BYTES - RECORD_RESERVE).saturating_sub(fixed) / per_token.max(1);
        by_context.min(by_record)
    }

    /// Checks that every one of `units` fits ([`Memory::max_fact_tokens`]),
    /// storing nothing: a caller that ingests a request in several calls
    /// checks the whole request first, so that a unit too long to encode
    /// refuses the request before any of it is stored.
    ///
    /// It runs on the engine's thread for a whole request, so only lines
    /// that might not fit are tokenized: every token of a fact line covers
    /// at least one of its bytes (its `\n` included), bar one prefix token
    /// a SentencePiece tokenizer may add, so a line of `max - 2` bytes or
    /// fewer fits.
    pub fn check_fits(&self, units: &[MemoryUnit], composer: &Composer) -> Result<()> {
        let max = self.max_fact_tokens(composer.header().len());
        for u in units {
            let line = Composer::turn_text(&u.speaker, &u.time, &u.text);
            if line.len() + 2 > max {
                check_length(u, composer.fact(&line)?.len(), max)?;
            }
        }
        Ok(())
    }

    /// Where fact `id` of `user` is among [`Memory::facts`], if it is stored.
    pub fn fact_index(&self, user: &str, id: &str) -> Result<Option<usize>> {
        Ok(self.user(user)?.by_id.get(id).copied())
    }

    /// Where `user`'s directory is (or will be).
    pub(crate) fn user_dir(&self, user: &str) -> PathBuf {
        self.dir.join("users").join(user_dir_name(user))
    }

    pub(crate) fn user(&self, user: &str) -> Result<&UserShard<B>> {
        self.check_intact(user)?;
        self.users.get(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))
    }

    /// An error when `user`'s memory is damaged: a damaged user is neither
    /// read nor written (nor created anew over its files) until repaired.
    /// A user not read yet is read now, to know.
    pub(crate) fn check_intact(&self, user: &str) -> Result<()> {
        match self.damaged.contains_key(user) {
            true => Err(MemoryError::UserDamaged(user.to_string())),
            false => self.users.open_now(user),
        }
    }

    /// Users whose memory is damaged, with what was found (for operators:
    /// logs, `cluster status`; it names files).
    pub fn damaged(&self) -> impl Iterator<Item = (&str, &str)> {
        self.damaged.iter().map(|(u, why)| (u.as_str(), why.as_str())).chain(self.users.failures())
    }

    /// The KV of fact `idx` of `user`, if it is cached (see
    /// [`Memory::fetch`]).
    pub fn kv(&self, user: &str, idx: usize) -> Result<Option<&KvChunk<B>>> {
        Ok(self.user(user)?.kv.get(idx).and_then(|k| self.cache.get(k.key)).map(|c| &**c))
    }

    /// Whether fact `idx` of `user` has KV, cached or on disk.
    pub fn has_kv(&self, user: &str, idx: usize) -> Result<bool> {
        Ok(self.user(user)?.kv.get(idx).is_some_and(|k| k.at.is_some()))
    }

    /// Whether every one of `idxs` (facts of `user`) has its KV cached.
    pub fn resident(&self, user: &str, idxs: &[usize]) -> Result<bool> {
        let shard = self.user(user)?;
        Ok(idxs.iter().all(|&i| shard.kv.get(i).is_some_and(|k| self.cache.get(k.key).is_some())))
    }

    /// Takes `user`'s shard out of this memory, its cached KV with it.
    pub(crate) fn take_user(&mut self, user: &str) -> Option<UserShard<B>> {
        let shard = self.users.remove(user)?;
        shard.kv.iter().for_each(|k| self.cache.remove(k.key));
        Some(shard)
    }

    /// Whether `user` has any memory (a damaged one included).
    pub fn has_user(&self, user: &str) -> bool {
        self.users.listed_user(user) || self.damaged.contains_key(user)
    }

    /// Stores `turns` for `user`: facts are durable (fsynced) before this
    /// returns; then their KV is encoded with the shard's window and
    /// appended to the user's segment. Turns whose id is already stored are
    /// skipped. Invalid input stores nothing. The user's other facts that
    /// lack KV are left to [`Memory::encode_pending`] and to the requests
    /// that retrieve them ([`Memory::encode_facts`]).
    pub fn ingest(&mut self, user: &str, turns: &[MemoryUnit], enc: &mut Encoders<'_, B>) -> Result<IngestReport> {
        self.ingest_with(user, turns, enc, true)
    }

    /// [`Memory::ingest`] that stores the facts only: their KV is encoded
    /// when first needed ([`Memory::ensure_kv`]). A replica's copy, which
    /// may never serve, is stored this way.
    pub fn ingest_deferred(
        &mut self,
        user: &str,
        turns: &[MemoryUnit],
        enc: &mut Encoders<'_, B>,
    ) -> Result<IngestReport> {
        self.ingest_with(user, turns, enc, false)
    }

    fn ingest_with(
        &mut self,
        user: &str,
        turns: &[MemoryUnit],
        enc: &mut Encoders<'_, B>,
        encode: bool,
    ) -> Result<IngestReport> {
        validate(user, turns)?;
        self.check_intact(user)?;
        let how = self.encoding();
        let max = self.max_fact_tokens(enc.composer.header().len());
        if !self.users.contains_key(user) {
            let dir = self.user_dir(user);
            let mut warnings = Vec::new();
            let shard = UserShard::open(&dir, &self.header, &mut warnings)?;
            sync_dir(&self.dir.join("users"))?;
            self.users.insert(user.to_string(), shard);
        }
        let shard = shard_mut(&mut self.users, &self.damaged, user)?;
        let new: Vec<&MemoryUnit> = turns.iter().filter(|t| !shard.by_id.contains_key(&t.id)).collect();
        let mut report = IngestReport { skipped: turns.len() - new.len(), ..Default::default() };
        if new.is_empty() {
            return Ok(report);
        }
        // Facts first: tokens and embeddings, then one durable append.
        let texts: Vec<String> = new.iter().map(|t| Composer::turn_text(&t.speaker, &t.time, &t.text)).collect();
        // Every unit must fit before anything of the call is stored.
        let mut tokens = Vec::with_capacity(new.len());
        for (t, text) in new.iter().zip(&texts) {
            let ids = enc.composer.fact(text)?;
            check_length(t, ids.len(), max)?;
            tokens.push(ids);
        }
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let embeddings = enc.embedder.embed(enc.engine.backend(), &refs)?;
        let mut facts = Vec::with_capacity(new.len());
        for ((t, tokens), embedding) in new.iter().zip(tokens).zip(embeddings) {
            facts.push(Fact { unit: (*t).clone(), tokens, embedding, history: vec![Event::added(t)] });
        }
        let records: Vec<Vec<u8>> = facts.iter().map(Record::encode_put).collect();
        shard.log.append(&records.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
        let added: Vec<usize> = (shard.facts.len()..shard.facts.len() + facts.len()).collect();
        shard.push_facts(facts);
        report.added = new.len();
        if encode {
            // This call's facts only: other facts still without KV (a
            // replica's copy whose user it now serves) are the background's
            // and their requests' work, so that a write's latency never
            // includes a backlog it did not make.
            report.encoded_tokens = shard.encode_only(user, &added, how, enc, &mut self.cache)?;
        }
        if shard.lacks_kv() {
            self.pending.insert(user.to_string());
        }
        Ok(report)
    }

    /// Encodes every fact of `user` whose KV is missing (e.g. after a
    /// corrupt segment was detected); returns the tokens encoded.
    pub fn ensure_kv(&mut self, user: &str, enc: &mut Encoders<'_, B>) -> Result<usize> {
        let how = self.encoding();
        let shard = shard_mut(&mut self.users, &self.damaged, user)?;
        shard.encode_missing(user, usize::MAX, how, enc, &mut self.cache)
    }

    /// Encodes the KV of `user`'s facts `idxs` that have none (a request's
    /// few facts; the rest of the user's are the background's work).
    pub fn encode_facts(&mut self, user: &str, idxs: &[usize], enc: &mut Encoders<'_, B>) -> Result<usize> {
        let how = self.encoding();
        let shard = shard_mut(&mut self.users, &self.damaged, user)?;
        shard.encode_only(user, idxs, how, enc, &mut self.cache)
    }

    /// How this memory encodes facts' KV.
    pub(crate) fn encoding(&self) -> Encoding {
        Encoding { window: self.spec.window, batch: self.encode_batch, context: self.context }
    }

    /// Encodes up to `max_facts` facts that lack KV, of one user that has
    /// some: background work for idle time, so that a replica that takes
    /// over a user (or a user whose KV was dropped) answers at full speed.
    /// Returns the facts encoded (0: nothing is pending).
    pub fn encode_pending(&mut self, max_facts: usize, enc: &mut Encoders<'_, B>) -> Result<usize> {
        // Idle time also retries the rollbacks that failed (cheap if none),
        // and takes on what reading users found.
        self.settle();
        self.absorb_opened();
        let how = self.encoding();
        while let Some(user) = self.pending.first().cloned() {
            let Some(shard) = self.users.get_mut(&user) else {
                self.pending.remove(&user);
                continue;
            };
            let missing = shard.kv.iter().filter(|k| k.at.is_none()).count();
            if missing == 0 {
                self.pending.remove(&user);
                continue;
            }
            let n = missing.min(max_facts.max(1));
            if let Err(e) = shard.encode_missing(&user, n, how, enc, &mut self.cache) {
                // Not retried in the background; a request still encodes it.
                self.pending.remove(&user);
                return Err(e);
            }
            if n == missing {
                self.pending.remove(&user);
            }
            return Ok(n);
        }
        Ok(0)
    }

    /// The `k` facts that best answer `query`, best first, ranked by the
    /// shard's [`Retriever`] (see `retrieval.rs`). Only `user`'s facts
    /// are read. Dense search runs on the host for a user's few facts, else
    /// on `be` (`Backend::top_k`: one GEMV and a sort on a GPU) over the
    /// user's embeddings uploaded once after each change
    /// (`UserShard::dense_rank`); the lexical index is built once after each
    /// change.
    pub fn retrieve(&self, be: &B, user: &str, query: Query<'_>, k: usize) -> Result<Vec<usize>> {
        if k == 0 {
            return Err(MemoryError::Invalid { what: "k", reason: "k must be at least 1".into() });
        }
        let shard = self.user(user)?;
        let n = shard.facts.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let lexical = || shard.lexical_rank(query.text);
        Ok(match self.retriever {
            Retriever::Dense => shard.dense_rank(be, user, query.embedding, k)?,
            Retriever::Lexical => {
                // Facts sharing no term with the question follow in dense order.
                let mut order = lexical();
                if order.len() < k {
                    let dense = shard.dense_rank(be, user, query.embedding, n)?;
                    let seen: std::collections::HashSet<usize> = order.iter().copied().collect();
                    order.extend(dense.into_iter().filter(|i| !seen.contains(i)));
                }
                order.truncate(k);
                order
            }
            Retriever::Hybrid => {
                let dense = shard.dense_rank(be, user, query.embedding, n)?;
                let lexical = lexical();
                retrieval::fuse(&[(&dense, retrieval::DENSE_WEIGHT), (&lexical, retrieval::LEXICAL_WEIGHT)], k)
            }
        })
    }

    /// Ranks this shard's facts with `retriever` from now on.
    pub fn set_retriever(&mut self, retriever: Retriever) {
        self.retriever = retriever;
    }

    pub fn retriever(&self) -> Retriever {
        self.retriever
    }
}

/// Where the scrub pass is: the next user (by name) and fact.
#[derive(Debug, Default, Clone)]
pub(crate) struct ScrubCursor {
    pub(crate) user: String,
    pub(crate) fact: usize,
}

/// Run when a memory directory opens (under its lock): a user whose copy
/// was moved to `trash/` by an import that crashed before the staged copy
/// took its place gets it back; other leftovers of imports are removed.
/// Returns what it did, as warnings.
pub(crate) fn recover(memory_dir: &Path) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let users = memory_dir.join("users");
    let trash = memory_dir.join("trash");
    if trash.is_dir() {
        for entry in std::fs::read_dir(&trash).map_err(io(&trash))? {
            let entry = entry.map_err(io(&trash))?;
            let live = users.join(entry.file_name());
            if live.exists() {
                std::fs::remove_dir_all(entry.path()).map_err(io(&entry.path()))?;
            } else {
                std::fs::rename(entry.path(), &live).map_err(io(&entry.path()))?;
                warnings.push(format!("{}: restored after an interrupted import", live.display()));
            }
        }
        sync_dir(&users)?;
    }
    let staging = memory_dir.join("staging");
    if staging.is_dir() {
        std::fs::remove_dir_all(&staging).map_err(io(&staging))?;
    }
    Ok(warnings)
}
