//! Facts and their on-disk records.
//!
//! A fact is a stored memory unit (one conversation turn, or a
//! caller-supplied fact with its source turn) with what storing it derived:
//! the exact tokens it occupies in a prompt and its sentence embedding. Records are a small length-prefixed binary form;
//! the log around them (log.rs) supplies framing and checksums, and the
//! decoder still checks every length so a bad record is an error, not a panic.

use std::path::Path;

use inferscale_types::{MemoryUnit, StoredUnit};

use crate::error::{MemoryError, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Fact {
    /// What the caller stored, as it was given (or last updated to).
    pub unit: MemoryUnit,
    /// The fact line's tokens, as injected or pasted into prompts.
    pub tokens: Vec<u32>,
    pub embedding: Vec<f32>,
    /// What happened to the unit, oldest first (empty for units stored
    /// before history was kept). It lives in the fact's record, so it moves
    /// with the fact between workers and is forgotten with it.
    pub history: Vec<Event>,
}

impl Fact {
    /// The unit with when it was stored and last changed (its history's
    /// first and last events; 0 for a unit stored before history was kept).
    pub fn stored(&self) -> StoredUnit {
        StoredUnit {
            unit: self.unit.clone(),
            created_ms: self.history.first().map_or(0, |e| e.at_ms),
            updated_ms: self.history.last().map_or(0, |e| e.at_ms),
        }
    }
}

/// One change to a unit: its text and metadata before and after.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Event {
    pub kind: EventKind,
    /// Milliseconds since the Unix epoch, by the storing worker's clock.
    pub at_ms: u64,
    /// The text before the change (`None` for an add).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_text: Option<String>,
    pub new_text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_metadata: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub new_metadata: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum EventKind {
    Add,
    Update,
}

impl Event {
    /// The unit `u` stored now.
    pub fn added(u: &MemoryUnit) -> Event {
        Event {
            kind: EventKind::Add,
            at_ms: now_ms(),
            old_text: None,
            new_text: u.text.clone(),
            old_metadata: None,
            new_metadata: u.metadata.clone(),
        }
    }

    /// `old` changed into `new` now.
    pub fn updated(old: &MemoryUnit, new: &MemoryUnit) -> Event {
        Event {
            kind: EventKind::Update,
            at_ms: now_ms(),
            old_text: Some(old.text.clone()),
            new_text: new.text.clone(),
            old_metadata: Some(old.metadata.clone()),
            new_metadata: new.metadata.clone(),
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// What a record keeps beyond the original fields, as JSON.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Extension {
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    metadata: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    history: Vec<Event>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    agent_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    run_id: String,
}

/// One entry of a user's fact log.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Put(Box<Fact>),
    /// Tombstone; the log is rewritten without the fact right after.
    Forget(String),
}

const PUT: u8 = 1;
const FORGET: u8 = 2;
/// A put with what the original form lacks (metadata, history): [`PUT`]'s
/// fields, then an [`Extension`] as JSON text. A fact with neither is still
/// written as [`PUT`], so older logs read as they always did.
const PUT_EXT: u8 = 3;

impl Record {
    /// Any record's bytes (the store writes puts only, [`Record::encode_put`];
    /// tombstones are read from older logs).
    #[cfg(test)]
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Record::Put(f) => Record::encode_put(f),
            Record::Forget(id) => {
                let mut out = vec![FORGET];
                put_bytes(&mut out, id.as_bytes());
                out
            }
        }
    }

    /// The put record of `f` (without copying the fact into a `Record`).
    pub fn encode_put(f: &Fact) -> Vec<u8> {
        let mut out = Vec::new();
        let u = &f.unit;
        let plain = u.metadata.is_empty() && f.history.is_empty() && u.agent_id.is_empty() && u.run_id.is_empty();
        out.push(if plain { PUT } else { PUT_EXT });
        for s in [&u.id, &u.speaker, &u.text, &u.time, &u.source_turn] {
            put_bytes(&mut out, s.as_bytes());
        }
        out.extend_from_slice(&(f.tokens.len() as u32).to_le_bytes());
        f.tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
        out.extend_from_slice(&(f.embedding.len() as u32).to_le_bytes());
        f.embedding.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        if !plain {
            let ext = Extension {
                metadata: u.metadata.clone(),
                history: f.history.clone(),
                agent_id: u.agent_id.clone(),
                run_id: u.run_id.clone(),
            };
            let json = serde_json::to_string(&ext).unwrap_or_default();
            put_bytes(&mut out, json.as_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8], path: &Path) -> Result<Record> {
        let mut r = Cursor { bytes, pos: 0, path };
        match r.u8()? {
            tag @ (PUT | PUT_EXT) => {
                let id = r.string()?;
                let speaker = r.string()?;
                let text = r.string()?;
                let time = r.string()?;
                let source_turn = r.string()?;
                let n = r.u32()? as usize;
                let tokens = (0..r.check(n, 4)?).map(|_| r.u32()).collect::<Result<_>>()?;
                let n = r.u32()? as usize;
                let embedding = (0..r.check(n, 4)?).map(|_| r.u32().map(f32::from_bits)).collect::<Result<_>>()?;
                let ext: Extension = match tag {
                    PUT_EXT => {
                        let json = r.string()?;
                        serde_json::from_str(&json).map_err(|e| r.corrupt(format!("record extension: {e}")))?
                    }
                    _ => Extension::default(),
                };
                let unit = MemoryUnit {
                    id,
                    speaker,
                    text,
                    time,
                    source_turn,
                    metadata: ext.metadata,
                    agent_id: ext.agent_id,
                    run_id: ext.run_id,
                };
                Ok(Record::Put(Box::new(Fact { unit, tokens, embedding, history: ext.history })))
            }
            FORGET => Ok(Record::Forget(r.string()?)),
            t => Err(r.corrupt(format!("unknown record tag {t}"))),
        }
    }
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// Bounds-checked reads over one record.
pub(crate) struct Cursor<'a> {
    pub bytes: &'a [u8],
    pub pos: usize,
    pub path: &'a Path,
}

impl Cursor<'_> {
    pub fn corrupt(&self, reason: String) -> MemoryError {
        MemoryError::Corrupt { path: self.path.to_path_buf(), offset: self.pos as u64, reason }
    }

    /// Checks that `n` items of `size` bytes fit in what is left.
    pub fn check(&self, n: usize, size: usize) -> Result<usize> {
        if n.saturating_mul(size) > self.bytes.len() - self.pos {
            return Err(self.corrupt(format!("{n} items overrun the record")));
        }
        Ok(n)
    }

    pub fn take(&mut self, n: usize) -> Result<&[u8]> {
        self.check(n, 1)?;
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn string(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        let b = self.take(n)?.to_vec();
        String::from_utf8(b).map_err(|e| self.corrupt(format!("string is not UTF-8: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_truncations_are_errors() {
        let f = Fact {
            unit: MemoryUnit {
                id: "D1:3".into(),
                speaker: "Caroline".into(),
                text: "I went to a support group — it was powerful.".into(),
                time: "1:56 pm on 8 May, 2023".into(),
                source_turn: String::new(),
                ..Default::default()
            },
            tokens: vec![1, 2, 49151],
            embedding: vec![0.5, -0.25, f32::MIN_POSITIVE],
            history: Vec::new(),
        };
        let mut with_meta = f.clone();
        with_meta.unit.metadata.insert("topic".into(), "health".into());
        with_meta.unit.metadata.insert("n".into(), 3.into());
        with_meta.unit.agent_id = "coach".into();
        let mut with_history = with_meta.clone();
        let mut before = f.unit.clone();
        before.text = "I went to a support group.".into();
        with_history.history = vec![Event::added(&before), Event::updated(&before, &with_meta.unit)];
        // A fact without metadata or history keeps the original record form.
        assert_eq!(Record::encode_put(&f)[0], PUT);
        assert_eq!(Record::encode_put(&with_meta)[0], PUT_EXT);
        let puts = [f, with_meta, with_history].map(|f| Record::Put(Box::new(f)));
        for rec in puts.into_iter().chain([Record::Forget("D1:3".into())]) {
            let b = rec.encode();
            assert_eq!(Record::decode(&b, Path::new("x")).unwrap(), rec);
            for cut in 0..b.len() {
                assert!(Record::decode(&b[..cut], Path::new("x")).is_err(), "cut at {cut}");
            }
        }
    }
}
