//! One user's shard: facts in memory (the durable source of truth is
//! `facts.log`), the index of their KV records in `kv.log`, and the search
//! indexes over them. The KV itself lives in the memory's cache
//! (`cache.rs`), under each fact's key, loaded from the segment when first
//! needed: opening a user reads its facts and the heads of its KV records,
//! never the tensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use inferscale_engine::bert::Bert;
use inferscale_engine::{Backend, EncodeItem, Engine};

use crate::cache::{Admit, KvCache, Source};
use crate::compose::Composer;
use crate::erase::is_erased;
use crate::error::{MemoryError, Result, io};
use crate::fact::{Fact, Record};
use crate::frame::FRAME_BYTES;
use crate::kvseg::{KvHeader, StoredKv};
use crate::log::{Frame, RecordLog};
use crate::retrieval::{self, LexicalIndex};

/// The models and prompt pieces that turn text into facts and KV.
pub struct Encoders<'e, B: Backend> {
    pub engine: &'e mut Engine<B>,
    pub embedder: &'e Bert<B>,
    pub composer: &'e Composer,
}

/// Users with at most this many embedding values (256 facts of MiniLM's
/// 384) are ranked on the host, by the reference's arithmetic
/// (`inferscale_engine::retrieval`): about 50 µs on one core for 256
/// facts, where a device ranking is two launches and a copy back on the
/// engine's stream — a synchronisation of the engine thread per request,
/// and device memory for every user's embeddings. Most users of a node of
/// thousands hold tens to hundreds of facts; larger ones keep the GEMV.
const HOST_RANK_MAX_VALUES: usize = 256 * 384;

/// How facts' KV is encoded: the `window` units stored before a fact as its
/// context, within the model's `context` tokens, `batch` facts to an
/// engine call (the memory's settings, [`crate::Memory`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Encoding {
    pub(crate) window: usize,
    pub(crate) batch: usize,
    pub(crate) context: usize,
}

/// The process's write sequence: every batch of facts added to any user
/// takes the next number. An import keeps the local units added after it
/// began (they arrived during the copy) and drops older ones the shard
/// lacks (see `Memory::commit_import`).
static WRITES: AtomicU64 = AtomicU64::new(0);

/// The write sequence now: facts added from here on have a higher number.
pub fn write_seq() -> u64 {
    WRITES.load(Ordering::SeqCst)
}

/// A 64-bit digest of a unit's content (id, text, speaker, time, source and
/// the caller's fields); a user's digest is the XOR of its units', so two
/// copies of a user compare in one number, kept current as units come and
/// go. Every stored fact is hashed when its user opens: the fields go in
/// as they are (each with its length), only `metadata` through JSON, and
/// only when there is some.
pub(crate) fn unit_digest(u: &inferscale_types::MemoryUnit) -> u64 {
    let metadata = match u.metadata.is_empty() {
        true => Vec::new(),
        false => serde_json::to_vec(&u.metadata).unwrap_or_default(),
    };
    let fields = [&u.id, &u.speaker, &u.text, &u.time, &u.source_turn, &u.agent_id, &u.run_id].map(|f| f.as_bytes());
    let half = |seed: u32| {
        let mut h = crc32fast::Hasher::new_with_initial(seed);
        for f in fields.iter().chain([&metadata.as_slice()]) {
            h.update(&(f.len() as u64).to_le_bytes());
            h.update(f);
        }
        u64::from(h.finalize())
    };
    (half(0x9e37_79b9) << 32) | half(0x85eb_ca6b)
}

/// Bytes of each KV record's start read when a segment is opened: enough
/// for the head (fact id and tokens) of a typical fact; longer heads take a
/// second read.
const HEAD_PEEK: usize = 1024;

/// A fact's KV: its key in the memory's cache, and where its record is in
/// the user's segment (`None`: not encoded, or dropped — to encode).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FactKv {
    pub key: u64,
    pub at: Option<Frame>,
}

impl FactKv {
    fn new(at: Option<Frame>) -> Self {
        // Keys are unique in the process, so a user's shard can be
        // replaced (an import) without its old keys meeting the new ones.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        FactKv { key: NEXT.fetch_add(1, Ordering::Relaxed), at }
    }
}

pub(crate) struct UserShard<B: Backend> {
    pub(crate) dir: PathBuf,
    pub(crate) facts: Vec<Fact>,
    pub(crate) by_id: HashMap<String, usize>,
    /// Per fact, the write sequence it was added at in this process (0:
    /// loaded when the shard opened).
    pub(crate) added: Vec<u64>,
    /// XOR of the facts' [`unit_digest`]s.
    pub(crate) digest: u64,
    /// Per fact (same order), its KV's key and record.
    pub(crate) kv: Vec<FactKv>,
    pub(crate) log: RecordLog,
    pub(crate) kv_log: RecordLog,
    /// The segment's erased records (`erase.rs`): dead bytes, counted
    /// towards compacting it.
    kv_erased: Vec<Frame>,
    /// The segment's header: the memory's model, window and shape, in the
    /// segment's own storage format (a segment written before the format
    /// changed keeps its own).
    pub(crate) seg: KvHeader,
    /// The facts' embeddings where the backend searches them (device memory
    /// on a GPU), made by the first retrieval after the facts change and
    /// dropped (`None`) whenever they do.
    index: std::sync::Mutex<Option<B::Embeddings>>,
    /// BM25 over the fact lines, made and dropped likewise.
    lexical: std::sync::Mutex<Option<LexicalIndex>>,
}

impl<B: Backend> UserShard<B> {
    /// Opens (or creates) the user directory `dir`: replays its facts and
    /// indexes its KV segment, which must hold KV made as `header` says
    /// (any storage format; a new segment gets `header`'s).
    pub(crate) fn open(dir: &Path, header: &KvHeader, warnings: &mut Vec<String>) -> Result<Self> {
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
        let mut kv: Vec<FactKv> = (0..facts.len()).map(|_| FactKv::new(None)).collect();
        let kv_path = dir.join("kv.log");
        let (mut kv_log, index) = RecordLog::open_frames(&kv_path, HEAD_PEEK)?;
        let mut kv_erased = Vec::new();
        if let Some(r) = &index.reason {
            warnings.push(format!(
                "{}: dropped a corrupt tail of {} bytes ({r}); those facts are re-encoded",
                kv_path.display(),
                index.truncated_bytes
            ));
        }
        let seg = match index.frames.split_first() {
            None => {
                kv_log.append(&[&header.encode()])?;
                header.clone()
            }
            Some(((first, bytes), rest)) => {
                let whole;
                let bytes = match bytes.len() < first.len as usize {
                    true => {
                        whole = kv_log.read(*first)?;
                        &whole
                    }
                    false => bytes,
                };
                let found = KvHeader::decode(bytes, &kv_path)?;
                if !found.same_kv(header) {
                    return Err(MemoryError::KvMismatch {
                        path: kv_path,
                        found: found.describe(),
                        expected: header.describe(),
                        hint: found.mismatch_hint(header),
                    });
                }
                let stale = found.stale();
                if let Some(why) = &stale {
                    // KV is derived data: the facts make it again.
                    warnings.push(format!(
                        "{}: KV not read: {why}; its {} facts' KV is re-encoded from their text",
                        kv_path.display(),
                        rest.len()
                    ));
                    kv_log.rewrite(&[header.encode()])?;
                }
                for (frame, prefix) in rest.iter().filter(|_| stale.is_none()) {
                    if is_erased(prefix) {
                        kv_erased.push(*frame);
                        continue;
                    }
                    let head = match StoredKv::head_len(prefix) {
                        Some(n) if n > prefix.len() && n <= frame.len as usize => kv_log.read_head(*frame, n)?,
                        _ => prefix.clone(),
                    };
                    match StoredKv::identify(&head, frame.len as usize, &found, &kv_path) {
                        Ok((id, tokens)) => {
                            if let Some(&i) = by_id.get(&id)
                                && facts[i].tokens == tokens
                            {
                                kv[i].at = Some(*frame);
                            }
                        }
                        Err(e) => warnings.push(format!("{e}; that fact's KV is re-encoded")),
                    }
                }
                if stale.is_some() { header.clone() } else { found }
            }
        };
        let digest = facts.iter().fold(0, |d, f| d ^ unit_digest(&f.unit));
        Ok(UserShard {
            dir: dir.to_path_buf(),
            added: vec![0; facts.len()],
            digest,
            facts,
            by_id,
            kv,
            log,
            kv_log,
            kv_erased,
            seg,
            index: Default::default(),
            lexical: Default::default(),
        })
    }

    /// Fact `i`'s KV record as stored, for a transfer.
    pub(crate) fn kv_record(&self, i: usize) -> Result<Option<Vec<u8>>> {
        self.kv[i].at.map(|f| self.kv_log.read(f)).transpose()
    }

    /// Every fact's embedding, `[facts, dim]` row-major; an error naming the
    /// first fact of another width.
    fn embedding_rows(&self, user: &str, dim: usize) -> Result<Vec<f32>> {
        self.check_widths(user, dim)?;
        Ok(self.facts.iter().flat_map(|f| f.embedding.iter().copied()).collect())
    }

    /// Every fact's embedding has `dim` values; an error naming the first
    /// that has not.
    fn check_widths(&self, user: &str, dim: usize) -> Result<()> {
        match self.facts.iter().find(|f| f.embedding.len() != dim) {
            Some(f) => Err(MemoryError::Invalid {
                what: "embedding",
                reason: format!("fact {:?} of {user:?} has {} values, the others {dim}", f.unit.id, f.embedding.len()),
            }),
            None => Ok(()),
        }
    }

    /// Drops the search indexes: the facts they were made of have changed.
    pub(crate) fn facts_changed(&mut self) {
        *self.index.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
        *self.lexical.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Appends new facts (their records already durable) without KV.
    pub(crate) fn push_facts(&mut self, facts: Vec<Fact>) {
        let seq = WRITES.fetch_add(1, Ordering::SeqCst) + 1;
        for f in facts {
            self.by_id.insert(f.unit.id.clone(), self.facts.len());
            self.digest ^= unit_digest(&f.unit);
            self.facts.push(f);
            self.kv.push(FactKv::new(None));
            self.added.push(seq);
        }
        self.facts_changed();
    }

    /// Removes fact `idx` (its KV dropped from `cache`; the logs are the
    /// caller's to rewrite).
    pub(crate) fn remove_fact(&mut self, idx: usize, cache: &mut KvCache<B>) {
        cache.remove(self.kv[idx].key);
        let gone = self.facts.remove(idx);
        self.digest ^= unit_digest(&gone.unit);
        self.kv.remove(idx);
        self.added.remove(idx);
        self.facts_changed();
        self.by_id = self.facts.iter().enumerate().map(|(i, f)| (f.unit.id.clone(), i)).collect();
    }

    /// The `k` facts of highest cosine similarity to `query`, best first;
    /// ties go to the earlier fact. Few facts are ranked on the host
    /// ([`HOST_RANK_MAX_VALUES`]), more by the backend from an index of
    /// their embeddings uploaded on first use.
    pub(crate) fn dense_rank(&self, be: &B, user: &str, query: &[f32], k: usize) -> Result<Vec<usize>> {
        let Some(dim) = self.facts.first().map(|f| f.embedding.len()) else { return Ok(Vec::new()) };
        if query.len() != dim {
            return Err(MemoryError::Invalid {
                what: "query",
                reason: format!("an embedding of {} values for facts embedded in {dim}", query.len()),
            });
        }
        if self.facts.len() * dim <= HOST_RANK_MAX_VALUES {
            self.check_widths(user, dim)?;
            let scores: Vec<f32> = self.facts.iter().map(|f| crate::search::score(&f.embedding, query)).collect();
            return Ok(inferscale_engine::retrieval::rank(&scores, k).into_iter().map(|i| i as usize).collect());
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
    pub(crate) fn lexical_rank(&self, text: &str) -> Vec<usize> {
        let mut index = self.lexical.lock().unwrap_or_else(|p| p.into_inner());
        let index = index.get_or_insert_with(|| {
            let docs: Vec<String> =
                (0..self.facts.len()).map(|i| retrieval::lexical_document(&self.facts, i)).collect();
            LexicalIndex::new(&docs.iter().map(String::as_str).collect::<Vec<_>>())
        });
        index.rank(text)
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
    /// segment at once, and kept in `cache` where it fits
    /// ([`Admit::Fill`]). When the segment's format is coarser than the
    /// backend's values, what is cached is the stored KV read back, so a
    /// fact's KV is the same whether it was just encoded or loaded.
    pub(crate) fn encode_missing(
        &mut self,
        user: &str,
        limit: usize,
        how: Encoding,
        enc: &mut Encoders<'_, B>,
        cache: &mut KvCache<B>,
    ) -> Result<usize> {
        let missing: Vec<usize> = (0..self.facts.len()).filter(|&i| self.kv[i].at.is_none()).take(limit).collect();
        self.encode(user, &missing, how, enc, cache)
    }

    /// Whether any fact has no KV.
    pub(crate) fn lacks_kv(&self) -> bool {
        self.kv.iter().any(|k| k.at.is_none())
    }

    /// [`UserShard::encode_missing`] for the facts `idxs` only (those with
    /// no KV).
    pub(crate) fn encode_only(
        &mut self,
        user: &str,
        idxs: &[usize],
        how: Encoding,
        enc: &mut Encoders<'_, B>,
        cache: &mut KvCache<B>,
    ) -> Result<usize> {
        let missing: Vec<usize> =
            idxs.iter().copied().filter(|&i| self.kv.get(i).is_some_and(|k| k.at.is_none())).collect();
        self.encode(user, &missing, how, enc, cache)
    }

    /// Encodes facts `missing` (of `user`, this shard's), appends their
    /// records and caches their KV as theirs (so that a device tier turning
    /// over demotes it: [`KvCache::set_owner`]); returns the tokens encoded.
    fn encode(
        &mut self,
        user: &str,
        missing: &[usize],
        how: Encoding,
        enc: &mut Encoders<'_, B>,
        cache: &mut KvCache<B>,
    ) -> Result<usize> {
        let Encoding { window, batch, context } = how;
        let lossy = self.seg.dtype.bytes_per_value() < enc.engine.backend().kv_bytes_per_value();
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
            let be = enc.engine.backend();
            for ((&i, chunk), context) in group.iter().zip(&chunks).zip(&contexts) {
                let (k, v) = chunk.to_host(be)?;
                let fact = &self.facts[i];
                records.push(
                    StoredKv { fact_id: fact.unit.id.clone(), tokens: fact.tokens.clone(), k, v }.encode(&self.seg)?,
                );
                tokens += context.len() + fact.tokens.len();
            }
            self.settle_kv_tail()?;
            let frames = self.kv_log.append_frames(&records.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
            for (((&i, chunk), frame), record) in group.iter().zip(chunks).zip(frames).zip(&records) {
                self.kv[i].at = Some(frame);
                let source = match lossy {
                    false => Source::Chunk(chunk),
                    true => {
                        let s = StoredKv::decode(record, &self.seg, self.kv_log.path())?;
                        Source::Host { tokens: s.tokens, k: s.k, v: s.v }
                    }
                };
                cache.insert(be, self.kv[i].key, source, Admit::Fill)?;
                cache.set_owner(self.kv[i].key, user, i);
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
    /// (durably) and from `cache`. Returns the facts whose KV went, `idx`
    /// last.
    pub(crate) fn drop_kv_from(&mut self, idx: usize, window: usize, cache: &mut KvCache<B>) -> Result<Vec<usize>> {
        let mut ids = self.derived_from(idx, window);
        ids.push(self.facts[idx].unit.id.clone());
        let drop: Vec<usize> = ids.iter().filter_map(|id| self.by_id.get(id).copied()).collect();
        self.erase_kv(&drop)?;
        for &i in &drop {
            cache.remove(self.kv[i].key);
        }
        Ok(drop)
    }

    /// Removes the facts `ids` (those stored) and every stored KV derived
    /// from them (their windows' later facts, the facts they are the
    /// source turn of): their KV records are erased first, then the fact
    /// log rewritten, so that a crash between leaves the facts with their KV
    /// re-encoded when needed. Returns how many facts went, and whether
    /// other facts lost their KV (to re-encode).
    pub(crate) fn remove_facts(
        &mut self,
        ids: &[String],
        window: usize,
        cache: &mut KvCache<B>,
    ) -> Result<(usize, bool)> {
        let mut idxs: Vec<usize> = ids.iter().filter_map(|id| self.by_id.get(id).copied()).collect();
        idxs.sort_unstable();
        idxs.dedup();
        if idxs.is_empty() {
            return Ok((0, false));
        }
        let mut drop: Vec<usize> = idxs.clone();
        for &i in &idxs {
            drop.extend(self.derived_from(i, window).iter().filter_map(|id| self.by_id.get(id).copied()));
        }
        drop.sort_unstable();
        drop.dedup();
        let cascades = drop.len() > idxs.len();
        self.erase_kv(&drop)?;
        for &i in &drop {
            cache.remove(self.kv[i].key);
        }
        // Durable first: a failed rewrite leaves the facts stored and served.
        let records: Vec<Vec<u8>> = (self.facts.iter().enumerate())
            .filter(|(i, _)| idxs.binary_search(i).is_err())
            .map(|(_, f)| Record::encode_put(f))
            .collect();
        self.log.rewrite(&records)?;
        for &i in idxs.iter().rev() {
            self.remove_fact(i, cache);
        }
        Ok((idxs.len(), cascades))
    }

    /// Undoes an ingest that only appended: removes the facts `ids` and
    /// cuts the fact log back to `facts_len` and the KV log to `kv_len`,
    /// which needs no free space. Where the logs do not read as that
    /// ingest's appends from there (a rewrite moved them), the facts and
    /// their KV are removed by rewriting instead. Returns how many facts
    /// went, and whether facts that stay lost their KV (to re-encode).
    pub(crate) fn cut_back(
        &mut self,
        ids: &[String],
        facts_len: u64,
        kv_len: u64,
        window: usize,
        cache: &mut KvCache<B>,
    ) -> Result<(usize, bool)> {
        let ours =
            |r: &Vec<u8>| matches!(Record::decode(r, self.log.path()), Ok(Record::Put(f)) if ids.contains(&f.unit.id));
        let appended = self.log.records_from(facts_len)?.is_some_and(|rs| rs.iter().all(ours));
        let kv_boundary = kv_len >= 8
            && kv_len <= self.kv_log.len_bytes()
            && (kv_len == self.kv_log.len_bytes() || self.kv_log.records_from(kv_len)?.is_some());
        if !appended || !kv_boundary {
            return self.remove_facts(ids, window, cache);
        }
        let mut idxs: Vec<usize> = ids.iter().filter_map(|id| self.by_id.get(id).copied()).collect();
        idxs.sort_unstable();
        self.kv_log.truncate(kv_len)?;
        self.kv_erased.retain(|f| f.offset < kv_len);
        self.log.truncate(facts_len)?;
        for &i in idxs.iter().rev() {
            self.remove_fact(i, cache);
        }
        // KV appended since (the deferred KV of earlier facts) went too.
        let mut lost = false;
        for k in &mut self.kv {
            if k.at.is_some_and(|f| f.offset >= kv_len) {
                k.at = None;
                lost = true;
            }
        }
        Ok((idxs.len(), lost))
    }

    /// Erases the records of facts `drop` from the segment where they lie
    /// (`erase.rs`: no other record moves or is copied, and no new space is
    /// taken), durably; then compacts the segment if its dead records now
    /// outgrow its live ones. Facts `drop` are left without KV (encoded
    /// again when needed), also when the erasure fails part way.
    fn erase_kv(&mut self, drop: &[usize]) -> Result<()> {
        let frames: Vec<Frame> = drop.iter().filter_map(|&i| self.kv[i].at).collect();
        let erased = self.kv_log.erase(&frames);
        drop.iter().for_each(|&i| self.kv[i].at = None);
        erased?;
        self.kv_erased.extend(frames);
        let dead = self.kv_dead_bytes();
        let live = self.kv_log.len_bytes().saturating_sub(dead);
        if dead > live {
            // The erasure is what the caller asked for and it is durable: a
            // compaction that fails (a full disk) leaves the dead records
            // to the next one.
            if let Err(e) = self.compact_kv() {
                tracing::warn!(path = %self.kv_log.path().display(), "compacting a KV segment failed: {e}");
            }
        }
        Ok(())
    }

    /// Rewrites the segment with its live records only (and without any
    /// record that no longer reads back: its fact is re-encoded when
    /// needed), re-indexing them.
    fn compact_kv(&mut self) -> Result<()> {
        let (owners, frames): (Vec<usize>, Vec<Frame>) =
            (0..self.facts.len()).filter_map(|i| Some((i, self.kv[i].at?))).unzip();
        let (_, kept) = self.kv_log.rewrite_keeping(&[self.seg.encode()], &frames)?;
        self.kv_erased.clear();
        for (i, frame) in owners.into_iter().zip(kept) {
            self.kv[i].at = frame;
        }
        Ok(())
    }

    /// Checks the segment's last record if opening left it unchecked
    /// ([`RecordLog::settle_tail`]), before anything is appended behind it:
    /// a torn one (a crash while it was appended) is cut off and its fact
    /// left without KV, to re-encode. Returns whether a fact lost its KV.
    pub(crate) fn settle_kv_tail(&mut self) -> Result<bool> {
        let Some(torn) = self.kv_log.settle_tail()? else { return Ok(false) };
        tracing::warn!(
            path = %self.kv_log.path().display(),
            offset = torn.offset,
            "the KV segment's last record was torn (a crash while it was appended): cut off, its fact is re-encoded"
        );
        self.kv_erased.retain(|f| *f != torn);
        let mut lost = false;
        for k in self.kv.iter_mut().filter(|k| k.at == Some(torn)) {
            k.at = None;
            lost = true;
        }
        Ok(lost)
    }

    /// Bytes of the segment's erased records (waiting for a compaction).
    fn kv_dead_bytes(&self) -> u64 {
        self.kv_erased.iter().map(|f| (FRAME_BYTES as u64) + u64::from(f.len)).sum()
    }
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
}
