//! Changing what a user has stored: one unit updated in place, one unit
//! forgotten, or the whole user — each with the KV derived from the old
//! text dropped first, so that no stored tensor outlives the text it was
//! made of (docs/design.md §2).

use inferscale_engine::Backend;

use crate::compose::Composer;
use crate::error::{MemoryError, Result, io};
use crate::fact::{Event, Fact, Record};
use crate::log::sync_dir;
use crate::shard::{Memory, check_length, shard_mut, validate};
use crate::user::Encoders;

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

impl<B: Backend> Memory<B> {
    /// Forgets one fact of `user` (`Some(id)`), or all of them.
    pub fn forget(&mut self, user: &str, fact: Option<&str>) -> Result<()> {
        match fact {
            Some(id) => self.forget_fact(user, id),
            None => self.forget_user(user),
        }
    }

    /// Removes `user` from memory and from disk — a damaged user's files
    /// too (deleting needs nothing of them read).
    pub fn forget_user(&mut self, user: &str) -> Result<()> {
        // A user not read yet that proves unreadable is damaged: its files go too.
        let _ = self.users.open_now(user);
        self.absorb_opened();
        let dir = match (self.take_user(user), self.damaged.remove(user)) {
            (Some(shard), _) => shard.dir.clone(),
            (None, Some(_)) => self.user_dir(user),
            (None, None) => return Err(MemoryError::UnknownUser(user.to_string())),
        };
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        sync_dir(&self.dir.join("users"))
    }

    /// Changes one unit of `user` in place: a new text gets new tokens, a
    /// new embedding and new KV, encoded in the unit's place (the same
    /// context window; with `encode` false, when first needed), new
    /// metadata replaces the old; the change is added to the unit's history.
    /// The old KV is dropped (erased from the KV log) before the fact log is
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
        let how = self.encoding();
        let idx = self.index_for_rewrite(user, id)?;
        let shard = shard_mut(&mut self.users, &self.damaged, user)?;
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
        let digest = crate::user::unit_digest(&old.unit) ^ crate::user::unit_digest(&unit);
        let fact = Fact { unit, tokens, embedding, history };
        // The KV made from the old text goes first (a crash then leaves the
        // old text with its KV re-encoded), to be made again from the new.
        let dropped = match retext {
            true => shard.drop_kv_from(idx, self.spec.window, &mut self.cache)?,
            false => Vec::new(),
        };
        // Durable first: a failed rewrite leaves the unit as it was, in
        // memory as on disk.
        let records: Vec<Vec<u8>> =
            shard.facts.iter().enumerate().map(|(i, f)| Record::encode_put(if i == idx { &fact } else { f })).collect();
        shard.log.rewrite(&records)?;
        shard.facts[idx] = fact;
        shard.digest ^= digest;
        shard.facts_changed();
        let mut report = UpdateReport { changed: true, encoded_tokens: 0 };
        if retext {
            // The update is durable: KV that cannot be made now (a full
            // disk, say) is made later, and the update stands.
            // The KV this update dropped only: facts that lacked KV before
            // it are the background's (see `Memory::ingest`).
            match encode.then(|| shard.encode_only(user, &dropped, how, enc, &mut self.cache)) {
                Some(Ok(tokens)) => report.encoded_tokens = tokens,
                Some(Err(e)) => {
                    tracing::warn!(user, error = %e, "encoding an updated unit's KV failed; it is encoded later");
                }
                None => {}
            }
            if shard.lacks_kv() {
                self.pending.insert(user.to_string());
            }
        }
        Ok(report)
    }

    /// What happened to one unit of `user`, oldest first.
    pub fn history(&self, user: &str, id: &str) -> Result<&[Event]> {
        let idx = self.stored_index(user, id)?;
        Ok(&self.user(user)?.facts[idx].history)
    }

    /// Where `user`'s unit `id` stands ([`Memory::fact_index`]); an
    /// unknown unit is an error.
    fn stored_index(&self, user: &str, id: &str) -> Result<usize> {
        self.fact_index(user, id)?
            .ok_or_else(|| MemoryError::UnknownFact { user: user.to_string(), id: id.to_string() })
    }

    /// [`Memory::stored_index`] for a change that rewrites the user's logs:
    /// an ingest under way is rolled back first (it rolls back by id, which a
    /// rewrite would lose), and the unit looked up again after it.
    fn index_for_rewrite(&mut self, user: &str, id: &str) -> Result<usize> {
        self.stored_index(user, id)?;
        self.before_rewrite(user)?;
        self.stored_index(user, id)
    }

    /// Removes one fact of `user` from memory and from disk (its KV erased
    /// from the KV log, the fact log rewritten without it), and with it
    /// every stored tensor derived from its text: the KV of the facts whose
    /// context window held it (and of those it was the source turn of) is
    /// erased too and re-encoded from the remaining units when next needed,
    /// or in idle time ([`Memory::encode_pending`]) — the KV an ingest of
    /// the remaining units would have made. The KV is erased first: a
    /// crash before the fact log is rewritten leaves the fact stored (the
    /// forget was not acknowledged) with that KV re-encoded when needed,
    /// never KV derived from a forgotten unit.
    pub fn forget_fact(&mut self, user: &str, id: &str) -> Result<()> {
        let window = self.spec.window;
        let idx = self.index_for_rewrite(user, id)?;
        let shard = shard_mut(&mut self.users, &self.damaged, user)?;
        let cascades = shard.drop_kv_from(idx, window, &mut self.cache)?.len() > 1;
        // Durable first: a failed rewrite leaves the unit stored and served.
        let records: Vec<Vec<u8>> =
            shard.facts.iter().enumerate().filter(|&(i, _)| i != idx).map(|(_, f)| Record::encode_put(f)).collect();
        shard.log.rewrite(&records)?;
        shard.remove_fact(idx, &mut self.cache);
        if cascades {
            self.pending.insert(user.to_string());
        }
        Ok(())
    }
}
