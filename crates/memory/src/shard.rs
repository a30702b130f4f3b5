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

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use inferscale_engine::bert::Bert;
use inferscale_engine::{Backend, EncodeItem, Engine, KvChunk};
use inferscale_types::MemoryUnit;

use crate::compose::{Composer, Prompts};
use crate::error::{MemoryError, Result, io};
use crate::fact::{Event, Fact, Record};
use crate::kvseg::{KvHeader, StoredKv};
use crate::log::{MAX_RECORD_BYTES, RecordLog, sync_dir};
use crate::retrieval::{self, LexicalIndex, Query, Retriever};

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

/// The models and prompt pieces that turn text into facts and KV.
pub struct Encoders<'e, B: Backend> {
    pub engine: &'e mut Engine<B>,
    pub embedder: &'e Bert<B>,
    pub composer: &'e Composer,
}

/// Where a user's stored KV lives. A device backend keeps it in device
/// memory unless the shard's device budget is spent; then in its host tier
/// (pinned host memory that injection reads over the bus, overlapped with
/// the prefill). Backends without a host tier keep both in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
}

/// The tier of a user being placed: the device while the budget (`None`:
/// unlimited) holds the device bytes already placed plus this user's
/// estimate. A user stays where it was placed while it grows, so the budget
/// is checked at placement, not enforced byte by byte.
pub fn place(budget: Option<u64>, device_bytes: u64, estimate: u64) -> Tier {
    match budget {
        Some(b) if device_bytes.saturating_add(estimate) > b => Tier::Host,
        _ => Tier::Device,
    }
}

pub(crate) struct UserShard<B: Backend> {
    dir: PathBuf,
    tier: Tier,
    pub(crate) facts: Vec<Fact>,
    by_id: HashMap<String, usize>,
    kv: Vec<Option<KvChunk<B>>>,
    log: RecordLog,
    kv_log: RecordLog,
    /// The facts' embeddings where the backend searches them (device memory
    /// on a GPU), made by the first retrieval after the facts change and
    /// dropped (`None`) whenever they do.
    index: std::sync::Mutex<Option<B::Embeddings>>,
    /// BM25 over the fact lines, made and dropped likewise.
    lexical: std::sync::Mutex<Option<LexicalIndex>>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IngestReport {
    pub added: usize,
    /// Turns whose id the user already had (ingest is idempotent).
    pub skipped: usize,
    pub encoded_tokens: usize,
}

/// A change to one stored unit: a new text, new metadata, or both.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UnitUpdate {
    pub text: Option<String>,
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UpdateReport {
    /// False when the unit already was as asked (a retried update).
    pub changed: bool,
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

fn check_length(u: &MemoryUnit, tokens: usize, max: usize) -> Result<()> {
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
    /// Pre-RoPE K and V held in the backend's memory (device memory on a
    /// GPU backend, host memory on the CPU one).
    pub kv_resident_bytes: u64,
    /// Pre-RoPE K and V of users placed in the host tier.
    pub kv_host_tier_bytes: u64,
    /// Fact and KV logs on disk.
    pub disk_bytes: u64,
}

pub struct Memory<B: Backend> {
    pub(crate) dir: PathBuf,
    spec: ShardSpec,
    /// What this shard's KV segments must have been made with.
    pub(crate) header: KvHeader,
    pub(crate) users: BTreeMap<String, UserShard<B>>,
    /// Users that may have facts without KV (stored deferred, imported
    /// without it, or dropped as corrupt): [`Memory::encode_pending`]'s work.
    pub(crate) pending: std::collections::BTreeSet<String>,
    encode_batch: usize,
    /// Device bytes for users' KV before new users go to the host tier.
    device_budget: Option<u64>,
    bytes_per_value: usize,
    /// The model's context, in tokens: an encoding (header, window, fact)
    /// must fit it.
    context: usize,
    /// How [`Memory::retrieve`] ranks facts.
    retriever: Retriever,
    /// Exclusive lock on `dir/LOCK`, held while this value lives: a second
    /// writer would interleave appends and rewrites with ours.
    _lock: std::fs::File,
}

pub(crate) fn user_dir_name(user: &str) -> String {
    user.bytes().map(|b| format!("{b:02x}")).collect()
}

fn user_from_dir_name(name: &str) -> Option<String> {
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

impl<B: Backend> Memory<B> {
    /// Opens (or creates) the memory at `dir`, reloading every user's facts
    /// and KV. Returns warnings for anything dropped (torn log tails,
    /// corrupt KV records): facts whose KV is missing are re-encoded by
    /// [`Memory::ensure_kv`].
    pub fn open(dir: &Path, spec: ShardSpec, engine: &Engine<B>) -> Result<(Self, Vec<String>)> {
        Self::open_tiered(dir, spec, engine, None)
    }

    /// [`Memory::open`] with at most `device_budget` bytes of users' KV in
    /// device memory (`None`: no limit); users past it are placed in the
    /// host tier (see [`Tier`]).
    pub fn open_tiered(
        dir: &Path,
        spec: ShardSpec,
        engine: &Engine<B>,
        device_budget: Option<u64>,
    ) -> Result<(Self, Vec<String>)> {
        let c = engine.model().config();
        let kv_header = KvHeader {
            fingerprint: spec.fingerprint.clone(),
            window: spec.window,
            dtype: "f32".into(),
            layers: c.num_layers,
            kv_dim: c.kv_dim(),
        };
        let be = engine.backend();
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
        let mut warnings = crate::transfer::recover(dir)?;
        let mut users = BTreeMap::new();
        let bytes_per_value = be.kv_bytes_per_value();
        let mut device_bytes = 0;
        let entries = std::fs::read_dir(&users_dir).map_err(io(&users_dir))?;
        for entry in entries {
            let entry = entry.map_err(io(&users_dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(user) = user_from_dir_name(&name) else {
                warnings.push(format!("{}: not a user directory, ignored", entry.path().display()));
                continue;
            };
            let estimate = kv_estimate(&entry.path(), bytes_per_value);
            let tier = place(device_budget, device_bytes, estimate);
            if tier == Tier::Device {
                device_bytes += estimate;
            }
            let shard = UserShard::open(&entry.path(), be, &kv_header, tier, &mut warnings)?;
            users.insert(user, shard);
        }
        Ok((
            Memory {
                dir: dir.to_path_buf(),
                spec,
                header: kv_header,
                pending: users.keys().cloned().collect(),
                users,
                encode_batch: ENCODE_BATCH,
                device_budget,
                bytes_per_value,
                context: c.max_position_embeddings,
                retriever: Retriever::default(),
                _lock: lock,
            },
            warnings,
        ))
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

    pub fn users(&self) -> impl Iterator<Item = &str> {
        self.users.keys().map(String::as_str)
    }

    /// Bytes held per tier, with resident KV at `bytes_per_value` per
    /// element (the backend's). O(facts): meant for a scrape, not a hot path.
    pub fn footprint(&self) -> Footprint {
        let mut f = Footprint::default();
        for u in self.users.values() {
            let kv = u.kv_bytes(&self.header, self.bytes_per_value);
            match u.tier {
                Tier::Device => f.kv_resident_bytes += kv,
                Tier::Host => f.kv_host_tier_bytes += kv,
            }
            f.disk_bytes += u.log.len() + u.kv_log.len();
        }
        f
    }

    /// Where `user`'s KV lives.
    pub fn tier(&self, user: &str) -> Result<Tier> {
        Ok(self.user(user)?.tier)
    }

    /// The tier for a user arriving now with about `estimate` bytes of KV.
    pub(crate) fn place_new(&self, estimate: u64) -> Tier {
        if self.device_budget.is_none() {
            return Tier::Device;
        }
        let device: u64 = self
            .users
            .values()
            .filter(|u| u.tier == Tier::Device)
            .map(|u| u.kv_bytes(&self.header, self.bytes_per_value))
            .sum();
        place(self.device_budget, device, estimate)
    }

    pub fn facts(&self, user: &str) -> Result<&[Fact]> {
        Ok(&self.user(user)?.facts)
    }

    /// `user`'s facts as the units they were stored from, in order.
    pub fn units(&self, user: &str) -> Result<Vec<MemoryUnit>> {
        Ok(self.facts(user)?.iter().map(|f| f.unit.clone()).collect())
    }

    /// Facts stored here, over all users.
    pub fn fact_count(&self) -> usize {
        self.users.values().map(|s| s.facts.len()).sum()
    }

    /// The longest fact line a unit may make, in tokens: its encoding
    /// (after the header's `header_tokens`) must fit the model's context,
    /// and its KV one log record (f32 on disk).
    pub fn max_fact_tokens(&self, header_tokens: usize) -> usize {
        let by_context = self.context.saturating_sub(header_tokens + 1);
        // Per token: its id and its K and V in every layer. The record's
        // fact id and framing take the rest of the reserve.
        let per_token = 4 + 2 * self.header.layers * self.header.kv_dim * 4;
        let by_record = (MAX_RECORD_BYTES - RECORD_RESERVE) / per_token.max(1);
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

    fn user(&self, user: &str) -> Result<&UserShard<B>> {
        self.users.get(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))
    }

    /// The stored KV of fact `idx` of `user`, if encoded.
    pub fn kv(&self, user: &str, idx: usize) -> Result<Option<&KvChunk<B>>> {
        Ok(self.user(user)?.kv.get(idx).and_then(Option::as_ref))
    }

    /// Whether `user` has any memory.
    pub fn has_user(&self, user: &str) -> bool {
        self.users.contains_key(user)
    }

    /// Stores `turns` for `user`: facts are durable (fsynced) before this
    /// returns; then their KV is encoded with the shard's window and
    /// appended to the user's segment. Turns whose id is already stored are
    /// skipped. Invalid input stores nothing.
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
        let max = self.max_fact_tokens(enc.composer.header().len());
        if !self.users.contains_key(user) {
            let dir = self.dir.join("users").join(user_dir_name(user));
            let mut warnings = Vec::new();
            let tier = self.place_new(0);
            let shard = UserShard::open(&dir, enc.engine.backend(), &self.header, tier, &mut warnings)?;
            sync_dir(&self.dir.join("users"))?;
            self.users.insert(user.to_string(), shard);
        }
        let shard = self.users.get_mut(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))?;
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
        for f in facts {
            shard.by_id.insert(f.unit.id.clone(), shard.facts.len());
            shard.facts.push(f);
            shard.kv.push(None);
        }
        shard.facts_changed();
        report.added = new.len();
        match encode {
            true => {
                let (window, batch, context) = (self.spec.window, self.encode_batch, self.context);
                report.encoded_tokens = shard.encode_missing(window, batch, usize::MAX, context, enc)?
            }
            false => {
                self.pending.insert(user.to_string());
            }
        }
        Ok(report)
    }

    /// Encodes every fact of `user` whose KV is missing (e.g. after a
    /// corrupt segment was detected); returns the tokens encoded.
    pub fn ensure_kv(&mut self, user: &str, enc: &mut Encoders<'_, B>) -> Result<usize> {
        let (window, batch, context) = (self.spec.window, self.encode_batch, self.context);
        let shard = self.users.get_mut(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))?;
        shard.encode_missing(window, batch, usize::MAX, context, enc)
    }

    /// Encodes up to `max_facts` facts that lack KV, of one user that has
    /// some: background work for idle time, so that a replica that takes
    /// over a user (or a user whose KV was dropped) answers at full speed.
    /// Returns the facts encoded (0: nothing is pending).
    pub fn encode_pending(&mut self, max_facts: usize, enc: &mut Encoders<'_, B>) -> Result<usize> {
        let (window, batch, context) = (self.spec.window, self.encode_batch, self.context);
        while let Some(user) = self.pending.first().cloned() {
            let Some(shard) = self.users.get_mut(&user) else {
                self.pending.remove(&user);
                continue;
            };
            let missing = shard.kv.iter().filter(|k| k.is_none()).count();
            if missing == 0 {
                self.pending.remove(&user);
                continue;
            }
            let n = missing.min(max_facts.max(1));
            if let Err(e) = shard.encode_missing(window, batch, n, context, enc) {
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
    /// are read. Dense search runs on `be` (`Backend::top_k`: one GEMV and a
    /// sort on a GPU) over the user's embeddings uploaded once after each
    /// change; the lexical index is likewise built once after each change.
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

    /// Forgets one fact of `user` (`Some(id)`), or all of them.
    pub fn forget(&mut self, user: &str, fact: Option<&str>) -> Result<()> {
        match fact {
            Some(id) => self.forget_fact(user, id),
            None => self.forget_user(user),
        }
    }

    /// Removes `user` from memory and from disk.
    pub fn forget_user(&mut self, user: &str) -> Result<()> {
        let shard = self.users.remove(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))?;
        let dir = shard.dir.clone();
        drop(shard);
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        sync_dir(&self.dir.join("users"))
    }

    /// Changes one unit of `user` in place: a new text gets new tokens, a
    /// new embedding and new KV, encoded in the unit's place (the same
    /// context window; with `encode` false, when first needed), new
    /// metadata replaces the old; the change is added to the unit's history.
    /// The old KV is dropped (the KV log rewritten) before the fact log is
    /// rewritten, so a crash between leaves the unit as it was with its KV
    /// re-encoded when needed, and no KV made from the old text behind.
    /// An update that changes nothing does nothing (retries are safe). The
    /// KV of later units whose window held the old text is re-encoded with
    /// the new one, as the unit's own is.
    pub fn update(
        &mut self,
        user: &str,
        id: &str,
        change: &UnitUpdate,
        enc: &mut Encoders<'_, B>,
        encode: bool,
    ) -> Result<UpdateReport> {
        let max = self.max_fact_tokens(enc.composer.header().len());
        let shard = self.users.get_mut(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))?;
        let unknown = || MemoryError::UnknownFact { user: user.to_string(), id: id.to_string() };
        let idx = *shard.by_id.get(id).ok_or_else(unknown)?;
        let old = &shard.facts[idx];
        let mut unit = old.unit.clone();
        if let Some(text) = &change.text {
            unit.text.clone_from(text);
        }
        if let Some(metadata) = &change.metadata {
            unit.metadata.clone_from(metadata);
        }
        if unit == old.unit {
            return Ok(UpdateReport::default());
        }
        validate(user, std::slice::from_ref(&unit))?;
        let retext = unit.text != old.unit.text;
        let (tokens, embedding) = match retext {
            false => (old.tokens.clone(), old.embedding.clone()),
            true => {
                let line = Composer::turn_text(&unit.speaker, &unit.time, &unit.text);
                let tokens = enc.composer.fact(&line)?;
                check_length(&unit, tokens.len(), max)?;
                let embedding = enc.embedder.embed(enc.engine.backend(), &[line.as_str()])?.pop().unwrap_or_default();
                (tokens, embedding)
            }
        };
        let mut history = old.history.clone();
        history.push(Event::updated(&old.unit, &unit));
        if retext {
            // The KV made from the old text goes first (a crash then leaves
            // the old text with its KV re-encoded), to be made again from
            // the new.
            shard.drop_kv_from(idx, self.spec.window)?;
        }
        shard.facts[idx] = Fact { unit, tokens, embedding, history };
        shard.facts_changed();
        let records: Vec<Vec<u8>> = shard.facts.iter().map(Record::encode_put).collect();
        shard.log.rewrite(&records)?;
        let mut report = UpdateReport { changed: true, encoded_tokens: 0 };
        if retext {
            match encode {
                true => {
                    let (window, batch, context) = (self.spec.window, self.encode_batch, self.context);
                    report.encoded_tokens = shard.encode_missing(window, batch, usize::MAX, context, enc)?;
                }
                false => {
                    self.pending.insert(user.to_string());
                }
            }
        }
        Ok(report)
    }

    /// What happened to one unit of `user`, oldest first.
    pub fn history(&self, user: &str, id: &str) -> Result<&[Event]> {
        let shard = self.user(user)?;
        let idx = shard
            .by_id
            .get(id)
            .ok_or_else(|| MemoryError::UnknownFact { user: user.to_string(), id: id.to_string() })?;
        Ok(&shard.facts[*idx].history)
    }

    /// Removes one fact of `user` from memory and from disk (both logs are
    /// rewritten without it), and with it every stored tensor derived from
    /// its text: the KV of the facts whose context window held it (and of
    /// those it was the source turn of) is dropped too and re-encoded from
    /// the remaining units when next needed, or in idle time
    /// ([`Memory::encode_pending`]) — the KV an ingest of the remaining
    /// units would have made. The KV log is rewritten first: a crash before
    /// the fact log is leaves the fact stored (the forget was not
    /// acknowledged) with that KV re-encoded when needed, never KV derived
    /// from a forgotten unit.
    pub fn forget_fact(&mut self, user: &str, id: &str) -> Result<()> {
        let window = self.spec.window;
        let shard = self.users.get_mut(user).ok_or_else(|| MemoryError::UnknownUser(user.to_string()))?;
        let idx = *shard
            .by_id
            .get(id)
            .ok_or_else(|| MemoryError::UnknownFact { user: user.to_string(), id: id.to_string() })?;
        let cascades = shard.drop_kv_from(idx, window)?;
        shard.facts.remove(idx);
        shard.kv.remove(idx);
        shard.facts_changed();
        shard.by_id = shard.facts.iter().enumerate().map(|(i, f)| (f.unit.id.clone(), i)).collect();
        let records: Vec<Vec<u8>> = shard.facts.iter().map(Record::encode_put).collect();
        shard.log.rewrite(&records)?;
        if cascades {
            self.pending.insert(user.to_string());
        }
        Ok(())
    }
}

impl<B: Backend> UserShard<B> {
    /// Every fact's embedding, `[facts, dim]` row-major; an error naming the
    /// first fact of another width.
    fn embedding_rows(&self, user: &str, dim: usize) -> Result<Vec<f32>> {
        if let Some(f) = self.facts.iter().find(|f| f.embedding.len() != dim) {
            return Err(MemoryError::Invalid {
                what: "embedding",
                reason: format!("fact {:?} of {user:?} has {} values, the others {dim}", f.unit.id, f.embedding.len()),
            });
        }
        Ok(self.facts.iter().flat_map(|f| f.embedding.iter().copied()).collect())
    }

    /// Drops the search indexes: the facts they were made of have changed.
    fn facts_changed(&mut self) {
        *self.index.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
        *self.lexical.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The `k` facts of highest cosine similarity to `query`, best first;
    /// ties go to the earlier fact.
    fn dense_rank(&self, be: &B, user: &str, query: &[f32], k: usize) -> Result<Vec<usize>> {
        let Some(dim) = self.facts.first().map(|f| f.embedding.len()) else { return Ok(Vec::new()) };
        if query.len() != dim {
            return Err(MemoryError::Invalid {
                what: "query",
                reason: format!("an embedding of {} values for facts embedded in {dim}", query.len()),
            });
        }
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        let index = match &mut *index {
            Some(e) => e,
            slot => slot.insert(be.upload_embeddings(&self.embedding_rows(user, dim)?, dim)?),
        };
        Ok(be.top_k(index, query, k)?.into_iter().map(|i| i as usize).collect())
    }

    /// Facts whose lexical document shares a term with `text`, best BM25
    /// score first.
    fn lexical_rank(&self, text: &str) -> Vec<usize> {
        let mut index = self.lexical.lock().unwrap_or_else(|p| p.into_inner());
        let index = index.get_or_insert_with(|| {
            let docs: Vec<String> =
                (0..self.facts.len()).map(|i| retrieval::lexical_document(&self.facts, i)).collect();
            LexicalIndex::new(&docs.iter().map(String::as_str).collect::<Vec<_>>())
        });
        index.rank(text)
    }

    pub(crate) fn open(dir: &Path, be: &B, header: &KvHeader, tier: Tier, warnings: &mut Vec<String>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let (log, rec) = RecordLog::open(&dir.join("facts.log"))?;
        if let Some(r) = &rec.reason {
            warnings.push(format!(
                "{}: dropped a torn tail of {} bytes ({r})",
                log.path().display(),
                rec.truncated_bytes
            ));
        }
        let mut facts: Vec<Fact> = Vec::new();
        for bytes in &rec.records {
            match Record::decode(bytes, log.path())? {
                Record::Put(f) => {
                    facts.retain(|x| x.unit.id != f.unit.id);
                    facts.push(*f);
                }
                Record::Forget(id) => facts.retain(|x| x.unit.id != id),
            }
        }
        let by_id = facts.iter().enumerate().map(|(i, f)| (f.unit.id.clone(), i)).collect::<HashMap<_, _>>();
        let mut kv: Vec<Option<KvChunk<B>>> = (0..facts.len()).map(|_| None).collect();
        let kv_path = dir.join("kv.log");
        let (mut kv_log, krec) = RecordLog::open(&kv_path)?;
        if let Some(r) = &krec.reason {
            warnings.push(format!(
                "{}: dropped a corrupt tail of {} bytes ({r}); those facts are re-encoded",
                kv_path.display(),
                krec.truncated_bytes
            ));
        }
        match krec.records.split_first() {
            None => kv_log.append(&[&header.encode()])?,
            Some((first, rest)) => {
                let found = KvHeader::decode(first, &kv_path)?;
                if &found != header {
                    return Err(MemoryError::KvMismatch {
                        path: kv_path,
                        found: found.describe(),
                        expected: header.describe(),
                        hint: found.mismatch_hint(header),
                    });
                }
                for bytes in rest {
                    let stored = StoredKv::decode(bytes, header, &kv_path)?;
                    if let Some(&i) = by_id.get(&stored.fact_id)
                        && facts[i].tokens == stored.tokens
                    {
                        kv[i] = Some(match tier {
                            Tier::Device => KvChunk::from_host(be, stored.tokens, &stored.k, &stored.v)?,
                            Tier::Host => KvChunk::from_host_tier(be, stored.tokens, &stored.k, &stored.v)?,
                        });
                    }
                }
            }
        }
        Ok(UserShard {
            dir: dir.to_path_buf(),
            tier,
            facts,
            by_id,
            kv,
            log,
            kv_log,
            index: Default::default(),
            lexical: Default::default(),
        })
    }

    /// Bytes of this user's stored KV in the backend's tensors.
    fn kv_bytes(&self, header: &KvHeader, bytes_per_value: usize) -> u64 {
        let per_token = 2 * (header.layers * header.kv_dim * bytes_per_value) as u64;
        self.kv.iter().flatten().map(|c| c.len() as u64 * per_token).sum()
    }

    /// Where fact `i`'s context window ends: its source turn when that turn
    /// is stored before it, else the fact itself.
    fn context_anchor(&self, i: usize) -> usize {
        let source = &self.facts[i].unit.source_turn;
        match self.by_id.get(source) {
            Some(&j) if !source.is_empty() && j < i => j,
            _ => i,
        }
    }

    /// Encodes up to `limit` facts without KV: [header][the `window` units
    /// stored before the fact, or before its source turn][fact] — fewer
    /// units when those would not fit the model's `context` with the fact
    /// (the oldest go first; units longer than the context allows are
    /// refused at ingest). `batch` facts per engine call, so that short
    /// encodings share forward passes; each batch's KV is appended to the
    /// segment at once.
    fn encode_missing(
        &mut self,
        window: usize,
        batch: usize,
        limit: usize,
        context: usize,
        enc: &mut Encoders<'_, B>,
    ) -> Result<usize> {
        let missing: Vec<usize> = (0..self.facts.len()).filter(|&i| self.kv[i].is_none()).take(limit).collect();
        let mut tokens = 0;
        for group in missing.chunks(batch) {
            let contexts: Vec<Vec<u32>> = group
                .iter()
                .map(|&i| {
                    let anchor = self.context_anchor(i);
                    let mut c = enc.composer.header().to_vec();
                    let room = context.saturating_sub(c.len() + self.facts[i].tokens.len());
                    let lo = anchor.saturating_sub(window);
                    let lens: Vec<usize> = self.facts[lo..anchor].iter().map(|f| f.tokens.len()).collect();
                    let start = lo + window_start(&lens, window, room);
                    self.facts[start..anchor].iter().for_each(|f| c.extend_from_slice(&f.tokens));
                    c
                })
                .collect();
            let items: Vec<EncodeItem<'_>> = group
                .iter()
                .zip(&contexts)
                .map(|(&i, c)| EncodeItem { context: c, fact: &self.facts[i].tokens, fact_position: c.len() as u32 })
                .collect();
            let chunks = enc.engine.encode_batch(&items)?;
            let mut records = Vec::with_capacity(group.len());
            let mut placed = Vec::with_capacity(group.len());
            let be = enc.engine.backend();
            for ((&i, chunk), context) in group.iter().zip(chunks).zip(&contexts) {
                let (k, v) = chunk.to_host(be)?;
                let fact = &self.facts[i];
                placed.push(match self.tier {
                    Tier::Device => chunk,
                    Tier::Host => KvChunk::from_host_tier(be, chunk.tokens.clone(), &k, &v)?,
                });
                records.push(StoredKv { fact_id: fact.unit.id.clone(), tokens: fact.tokens.clone(), k, v }.encode());
                tokens += context.len() + fact.tokens.len();
            }
            self.kv_log.append(&records.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
            for (&i, chunk) in group.iter().zip(placed) {
                self.kv[i] = Some(chunk);
            }
        }
        Ok(tokens)
    }

    /// The ids of the facts whose stored KV was made with fact `idx`'s text
    /// before it: those whose context window (the `window` units before
    /// their anchor, [`UserShard::context_anchor`]) holds it, and those it
    /// is the source turn of (forgetting it moves their anchor). A window
    /// trimmed to fit the context may not have held it; re-encoding such a
    /// fact makes the KV it had.
    fn derived_from(&self, idx: usize, window: usize) -> Vec<String> {
        let id = &self.facts[idx].unit.id;
        (0..self.facts.len())
            .filter(|&j| j != idx)
            .filter(|&j| {
                let anchor = self.context_anchor(j);
                (anchor.saturating_sub(window) <= idx && idx < anchor) || self.facts[j].unit.source_turn == *id
            })
            .map(|j| self.facts[j].unit.id.clone())
            .collect()
    }

    /// Drops the KV made from fact `idx`'s text — its own and that of the
    /// facts [`UserShard::derived_from`] it — from the segment on disk
    /// (durably) and from memory. True when other facts lost theirs.
    fn drop_kv_from(&mut self, idx: usize, window: usize) -> Result<bool> {
        let mut ids = self.derived_from(idx, window);
        let cascades = !ids.is_empty();
        ids.push(self.facts[idx].unit.id.clone());
        self.rewrite_kv_without(&ids)?;
        for id in &ids {
            if let Some(&i) = self.by_id.get(id) {
                self.kv[i] = None;
            }
        }
        Ok(cascades)
    }

    fn rewrite_kv_without(&mut self, ids: &[String]) -> Result<()> {
        let path = self.kv_log.path().to_path_buf();
        let (_, rec) = RecordLog::open(&path)?;
        let mut keep = Vec::with_capacity(rec.records.len());
        for (i, bytes) in rec.records.into_iter().enumerate() {
            // The header stays; fact records are kept unless they are one of `ids`.
            let drop_it = i > 0 && {
                let mut r = crate::fact::Cursor { bytes: &bytes, pos: 0, path: &path };
                let id = r.string()?;
                ids.contains(&id)
            };
            if !drop_it {
                keep.push(bytes);
            }
        }
        self.kv_log.rewrite(&keep)
    }
}

/// A user's KV bytes once loaded, from its segment on disk (f32 values
/// there); 0 when it has none yet.
pub(crate) fn kv_estimate(user_dir: &Path, bytes_per_value: usize) -> u64 {
    let on_disk = std::fs::metadata(user_dir.join("kv.log")).map_or(0, |m| m.len());
    on_disk / 4 * bytes_per_value as u64
}

/// Where a fact's context window starts among the units before it
/// (`lens`: their lengths in tokens): at most `window` units, the oldest
/// left out until the rest fit `room` tokens.
fn window_start(lens: &[usize], window: usize, room: usize) -> usize {
    let mut start = lens.len().saturating_sub(window);
    let mut used: usize = lens[start..].iter().sum();
    while used > room && start < lens.len() {
        used -= lens[start];
        start += 1;
    }
    start
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_drops_its_oldest_units_only_when_they_do_not_fit() {
        let lens = [5, 40, 30, 20, 10];
        assert_eq!(window_start(&lens, 3, 1_000), 2, "the last three units");
        assert_eq!(window_start(&lens, 0, 1_000), 5, "no window");
        assert_eq!(window_start(&lens, 10, 1_000), 0, "all five");
        assert_eq!(window_start(&lens, 3, 35), 3, "30 + 20 + 10 > 35: the oldest goes");
        assert_eq!(window_start(&lens, 3, 30), 3, "20 + 10 fit exactly");
        assert_eq!(window_start(&lens, 3, 5), 5, "not even the newest fits");
        assert_eq!(window_start(&[], 3, 0), 0);
    }

    #[test]
    fn placement_keeps_the_device_within_budget_at_placement() {
        assert_eq!(place(None, u64::MAX, 1), Tier::Device);
        assert_eq!(place(Some(100), 60, 40), Tier::Device);
        assert_eq!(place(Some(100), 60, 41), Tier::Host);
        assert_eq!(place(Some(100), 101, 0), Tier::Host);
        assert_eq!(place(Some(0), 0, 0), Tier::Device, "an empty user costs nothing yet");
        assert_eq!(place(Some(10), u64::MAX, u64::MAX), Tier::Host, "no overflow");
    }
}
