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
        let mut r = Cursor { bytes, pos: 0, path };
        let fact_id = r.string()?;
        let n = r.u32()? as usize;
        let tokens = (0..r.check(n, 4)?).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
        let layers = r.u32()? as usize;
        if layers != header.layers {
            return Err(r.corrupt(format!("{layers} layers, header says {}", header.layers)));
        }
        let per = n * header.kv_dim;
        r.check(2 * layers * per, 4)?;
        let mut read = || -> Result<HostTensor> {
            let data = (0..per).map(|_| r.u32().map(f32::from_bits)).collect::<Result<_>>()?;
            Ok(HostTensor { shape: vec![n, header.kv_dim], data })
        };
        let k = (0..layers).map(|_| read()).collect::<Result<_>>()?;
        let v = (0..layers).map(|_| read()).collect::<Result<_>>()?;
        Ok(StoredKv { fact_id, tokens, k, v })
    }
}
