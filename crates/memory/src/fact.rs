//! Facts and their on-disk records.
//!
//! A fact is a stored memory unit (one conversation turn, or a
//! caller-supplied fact with its source turn) with what storing it derived:
//! the exact tokens it occupies in a prompt and its sentence embedding. Records are a small length-prefixed binary form;
//! the log around them (log.rs) supplies framing and checksums, and the
//! decoder still checks every length so a bad record is an error, not a panic.

use std::path::Path;

use inferscale_types::MemoryUnit;

use crate::error::{MemoryError, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Fact {
    /// What the caller stored, as it was given.
    pub unit: MemoryUnit,
    /// The fact line's tokens, as injected or pasted into prompts.
    pub tokens: Vec<u32>,
    pub embedding: Vec<f32>,
}

/// One entry of a user's fact log.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Put(Fact),
    /// Tombstone; the log is rewritten without the fact right after.
    Forget(String),
}

const PUT: u8 = 1;
const FORGET: u8 = 2;
/// A put whose unit has metadata: [`PUT`]'s fields, then the metadata as
/// JSON text. A unit without metadata is still written as [`PUT`], so logs
/// without metadata read as they always did.
const PUT_META: u8 = 3;

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Record::Put(f) => {
                let u = &f.unit;
                out.push(if u.metadata.is_empty() { PUT } else { PUT_META });
                for s in [&u.id, &u.speaker, &u.text, &u.time, &u.source_turn] {
                    put_bytes(&mut out, s.as_bytes());
                }
                out.extend_from_slice(&(f.tokens.len() as u32).to_le_bytes());
                f.tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
                out.extend_from_slice(&(f.embedding.len() as u32).to_le_bytes());
                f.embedding.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                if !u.metadata.is_empty() {
                    let json = serde_json::Value::Object(u.metadata.clone()).to_string();
                    put_bytes(&mut out, json.as_bytes());
                }
            }
            Record::Forget(id) => {
                out.push(FORGET);
                put_bytes(&mut out, id.as_bytes());
            }
        }
        out
    }

    pub fn decode(bytes: &[u8], path: &Path) -> Result<Record> {
        let mut r = Cursor { bytes, pos: 0, path };
        match r.u8()? {
            tag @ (PUT | PUT_META) => {
                let id = r.string()?;
                let speaker = r.string()?;
                let text = r.string()?;
                let time = r.string()?;
                let source_turn = r.string()?;
                let n = r.u32()? as usize;
                let tokens = (0..r.check(n, 4)?).map(|_| r.u32()).collect::<Result<_>>()?;
                let n = r.u32()? as usize;
                let embedding = (0..r.check(n, 4)?).map(|_| r.u32().map(f32::from_bits)).collect::<Result<_>>()?;
                let metadata = match tag {
                    PUT_META => {
                        let json = r.string()?;
                        serde_json::from_str(&json)
                            .map_err(|e| r.corrupt(format!("metadata is not a JSON object: {e}")))?
                    }
                    _ => serde_json::Map::new(),
                };
                let unit = MemoryUnit { id, speaker, text, time, source_turn, metadata };
                Ok(Record::Put(Fact { unit, tokens, embedding }))
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
                metadata: Default::default(),
            },
            tokens: vec![1, 2, 49151],
            embedding: vec![0.5, -0.25, f32::MIN_POSITIVE],
        };
        let mut with_meta = f.clone();
        with_meta.unit.metadata.insert("topic".into(), "health".into());
        with_meta.unit.metadata.insert("n".into(), 3.into());
        // A unit without metadata keeps the original record form.
        assert_eq!(Record::Put(f.clone()).encode()[0], PUT);
        assert_eq!(Record::Put(with_meta.clone()).encode()[0], PUT_META);
        for rec in [Record::Put(f), Record::Put(with_meta), Record::Forget("D1:3".into())] {
            let b = rec.encode();
            assert_eq!(Record::decode(&b, Path::new("x")).unwrap(), rec);
            for cut in 0..b.len() {
                assert!(Record::decode(&b[..cut], Path::new("x")).is_err(), "cut at {cut}");
            }
        }
    }
}
