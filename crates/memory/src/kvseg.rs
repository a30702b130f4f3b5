//! Persisted pre-RoPE KV of one user's facts (a "segment").
//!
//! KV is derived data — it can always be re-encoded from the facts — but
//! encoding is the expensive part of ingest, so it is kept on disk to make a
//! restart cheap. The segment is a record log (checksummed per record) whose
//! first record names what made the KV: model fingerprint, context window,
//! dtype and shape. KV made under other settings is refused, never injected;
//! a corrupt or missing record only costs re-encoding that fact.

use std::path::Path;

use inferscale_model::HostTensor;
use serde::{Deserialize, Serialize};

use crate::error::{MemoryError, Result};
use crate::fact::{Cursor, put_bytes};

/// What a segment's KV was made with; must equal the shard's to be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHeader {
    pub fingerprint: String,
    pub window: usize,
    pub dtype: String,
    pub layers: usize,
    pub kv_dim: usize,
}

impl KvHeader {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8], path: &Path) -> Result<KvHeader> {
        serde_json::from_slice(bytes).map_err(|e| MemoryError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!("segment header: {e}"),
        })
    }

    /// What to do about a segment made with this header where `expected`
    /// is needed, when the two differ only in the prompt tag (system prompt
    /// or memory turn, see `Prompts::kv_tag`): the KV is sound, made for
    /// another layout. Empty otherwise.
    pub fn mismatch_hint(&self, expected: &KvHeader) -> &'static str {
        let model = crate::compose::Prompts::untagged;
        let same_shape = (self.window, &self.dtype, self.layers, self.kv_dim)
            == (expected.window, &expected.dtype, expected.layers, expected.kv_dim);
        if same_shape && model(&self.fingerprint) == model(&expected.fingerprint) {
            "; it was made under another system prompt or memory turn: serve it with the --system-prompt and \
             --memory-turn it was made with (memories made before the memory turn could be chosen: --memory-turn \
             user), or remove the users' kv.log files to have their KV re-encoded when next needed (the facts stay)"
        } else {
            ""
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "model {} · window {} · {} · {}×{}",
            self.fingerprint, self.window, self.dtype, self.layers, self.kv_dim
        )
    }
}

/// One fact's KV as stored: per layer `[tokens, kv_dim]` K and V in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredKv {
    pub fact_id: String,
    pub tokens: Vec<u32>,
    pub k: Vec<HostTensor>,
    pub v: Vec<HostTensor>,
}

impl StoredKv {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_bytes(&mut out, self.fact_id.as_bytes());
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        self.tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
        out.extend_from_slice(&(self.k.len() as u32).to_le_bytes());
        for t in self.k.iter().chain(&self.v) {
            t.data.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        out
    }

    /// Decodes a record written under `header`.
    pub fn decode(bytes: &[u8], header: &KvHeader, path: &Path) -> Result<StoredKv> {
        let (fact_id, tokens, at) = Self::head(bytes, header, path)?;
        let per = tokens.len() * header.kv_dim;
        let mut tensors = bytes[at..]
            .chunks_exact(per * 4)
            .map(|b| HostTensor {
                shape: vec![tokens.len(), header.kv_dim],
                data: b.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect(),
            })
            .collect::<Vec<_>>();
        let v = tensors.split_off(header.layers);
        Ok(StoredKv { fact_id, tokens, k: tensors, v })
    }

    /// Checks a record written under `header` — framing, shape, exact
    /// length — without materialising its tensors; returns its fact id and
    /// tokens. What a receiver of a shard runs on every record it stages.
    pub fn check(bytes: &[u8], header: &KvHeader, path: &Path) -> Result<(String, Vec<u32>)> {
        let (fact_id, tokens, _) = Self::head(bytes, header, path)?;
        Ok((fact_id, tokens))
    }

    /// Parses everything before the tensors and checks that exactly
    /// `2 · layers · tokens · kv_dim` f32 follow; returns where they start.
    fn head(bytes: &[u8], header: &KvHeader, path: &Path) -> Result<(String, Vec<u32>, usize)> {
        let mut r = Cursor { bytes, pos: 0, path };
        let fact_id = r.string()?;
        let n = r.u32()? as usize;
        let tokens = (0..r.check(n, 4)?).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
        let layers = r.u32()? as usize;
        if layers != header.layers {
            return Err(r.corrupt(format!("{layers} layers, header says {}", header.layers)));
        }
        if n == 0 {
            return Err(r.corrupt("a KV record of no tokens".into()));
        }
        let floats = 2 * layers * n * header.kv_dim;
        r.check(floats, 4)?;
        if bytes.len() - r.pos != floats * 4 {
            return Err(r.corrupt(format!("{} bytes past the tensors", bytes.len() - r.pos - floats * 4)));
        }
        Ok((fact_id, tokens, r.pos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_and_decode_agree_and_refuse_any_other_length() {
        let header = KvHeader { fingerprint: "m".into(), window: 0, dtype: "f32".into(), layers: 2, kv_dim: 3 };
        let t = |x: f32| HostTensor { shape: vec![2, 3], data: (0..6).map(|i| x + i as f32).collect() };
        let kv = StoredKv {
            fact_id: "D1:1".into(),
            tokens: vec![7, 8],
            k: vec![t(0.0), t(10.0)],
            v: vec![t(20.0), t(30.0)],
        };
        let bytes = kv.encode();
        let p = Path::new("x");
        assert_eq!(StoredKv::decode(&bytes, &header, p).unwrap(), kv);
        assert_eq!(StoredKv::check(&bytes, &header, p).unwrap(), ("D1:1".to_string(), vec![7, 8]));
        let mut longer = bytes.clone();
        longer.push(0);
        for bad in [&bytes[..bytes.len() - 1], &longer[..]] {
            assert!(StoredKv::check(bad, &header, p).is_err());
            assert!(StoredKv::decode(bad, &header, p).is_err());
        }
        let other = KvHeader { layers: 3, ..header };
        assert!(StoredKv::check(&bytes, &other, p).is_err());
    }
}
