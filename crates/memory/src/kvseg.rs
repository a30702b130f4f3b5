//! Persisted pre-RoPE KV of one user's facts (a "segment").
//!
//! KV is derived data — it can always be re-encoded from the facts — but
//! encoding is the expensive part of ingest, so it is kept on disk to make a
//! restart cheap. The segment is a record log (checksummed per record) whose
//! first record names what made the KV: model fingerprint, context window,
//! storage format and shape. KV made under other settings is refused, never
//! injected; a corrupt or missing record only costs re-encoding that fact.
//!
//! A record holds one fact: its id, its tokens, then every layer's K and V
//! in the segment's [`KvFormat`]. The head (id and tokens) comes first and
//! is short, so a segment is indexed by reading record heads only
//! (`RecordLog::open_frames`) and a fact's tensors are read by offset when
//! first needed.

use std::path::Path;

use inferscale_engine::fp8::{self, Fp8Kv, bf16_to_f32, f32_to_bf16};
use inferscale_model::HostTensor;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{MemoryError, Result};
use crate::fact::{Cursor, put_bytes};

/// How a segment stores K and V values.
///
/// `f32` is what the CPU backend computes (E1–E4 stay exact through a
/// restart); `bf16` is what the CUDA backend computes and serves (exact for
/// it, half the bytes); `fp8-e4m3` halves that again: each fact's keys are
/// stored relative to a per-channel offset (their mean over the fact) and
/// K and V are scaled per layer and KV head to the e4m3 range (largest
/// magnitude → 448) and rounded to nearest, so a value keeps 3 mantissa
/// bits of its variation ([`inferscale_engine::fp8`] says why keys need the
/// offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum KvFormat {
    F32,
    Bf16,
    Fp8,
}

impl KvFormat {
    pub const ALL: [KvFormat; 3] = [KvFormat::F32, KvFormat::Bf16, KvFormat::Fp8];

    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8 => "fp8-e4m3",
        }
    }

    /// The format matching a backend that keeps `bytes_per_value` bytes per
    /// K or V element: what it computes, stored without loss.
    pub fn for_backend(bytes_per_value: usize) -> KvFormat {
        match bytes_per_value {
            2 => KvFormat::Bf16,
            _ => KvFormat::F32,
        }
    }

    /// Bytes per stored value (fp8's scales and offsets excluded).
    pub fn bytes_per_value(self) -> usize {
        match self {
            KvFormat::F32 => 4,
            KvFormat::Bf16 => 2,
            KvFormat::Fp8 => 1,
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvFormat {
    type Err = MemoryError;
    fn from_str(s: &str) -> Result<KvFormat> {
        match s {
            "f32" => Ok(KvFormat::F32),
            "bf16" => Ok(KvFormat::Bf16),
            "fp8" | "fp8-e4m3" => Ok(KvFormat::Fp8),
            other => Err(MemoryError::Invalid {
                what: "KV format",
                reason: format!("unknown KV format {other:?}; choose f32, bf16 or fp8"),
            }),
        }
    }
}

impl TryFrom<String> for KvFormat {
    type Error = MemoryError;
    fn try_from(s: String) -> Result<KvFormat> {
        s.parse()
    }
}

impl From<KvFormat> for String {
    fn from(f: KvFormat) -> String {
        f.name().to_string()
    }
}

/// What a segment's KV was made with. Model, window and shape must equal
/// the shard's for the KV to be used ([`KvHeader::same_kv`]); the storage
/// format is the segment's own (a shard reads every format, so segments
/// written before a format change are read as they are).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHeader {
    pub fingerprint: String,
    pub window: usize,
    pub dtype: KvFormat,
    pub layers: usize,
    pub kv_dim: usize,
    /// Width of one KV head, for fp8's per-head scales (0 in segments
    /// written before it was recorded; those are never fp8).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub head_dim: usize,
    /// The record layout of a format that has had more than one: fp8
    /// records are [`fp8::LAYOUT`]; 0 (absent) for the others, and for fp8
    /// segments written before layouts were recorded (layout 1, one scale
    /// per KV head and no key offsets: refused, see [`KvHeader::stale`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub layout: u32,
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

impl KvHeader {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8], path: &Path) -> Result<KvHeader> {
        let h: KvHeader = serde_json::from_slice(bytes).map_err(|e| MemoryError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!("segment header: {e}"),
        })?;
        if h.dtype == KvFormat::Fp8 && (h.head_dim == 0 || !h.kv_dim.is_multiple_of(h.head_dim)) {
            return Err(MemoryError::Corrupt {
                path: path.to_path_buf(),
                offset: 0,
                reason: format!("segment header: fp8 with head width {} for a KV width of {}", h.head_dim, h.kv_dim),
            });
        }
        Ok(h)
    }

    /// Whether KV stored under `self` is the KV `expected` needs: the same
    /// model, prompt tag, window and shape, whatever the storage format.
    pub fn same_kv(&self, expected: &KvHeader) -> bool {
        (&self.fingerprint, self.window, self.layers, self.kv_dim)
            == (&expected.fingerprint, expected.window, expected.layers, expected.kv_dim)
    }

    /// This header with records stored as `format` (in its current layout).
    pub fn with_format(&self, format: KvFormat) -> KvHeader {
        KvHeader { dtype: format, layout: Self::layout_of(format), ..self.clone() }
    }

    /// The record layout `format` is written in now.
    pub fn layout_of(format: KvFormat) -> u32 {
        match format {
            KvFormat::Fp8 => fp8::LAYOUT,
            KvFormat::F32 | KvFormat::Bf16 => 0,
        }
    }

    /// Why records made under this header must not be read, if they must
    /// not: a layout this build no longer writes because it lost what a
    /// model needs. Such a segment's KV is re-encoded from the facts.
    pub fn stale(&self) -> Option<String> {
        (self.layout != Self::layout_of(self.dtype)).then(|| match (self.dtype, self.layout) {
            (KvFormat::Fp8, 0 | 1) => "it is in the first fp8 layout (one scale per KV head, no key offsets), which \
                                    loses keys with offset channels such as Qwen2.5's"
                .to_string(),
            (f, l) => format!("it is {f} in record layout {l}, which this build does not know"),
        })
    }

    /// What to do about a segment made with this header where `expected`
    /// is needed, when the two differ only in the prompt tag (system prompt
    /// or memory turn, see `Prompts::kv_tag`): the KV is sound, made for
    /// another layout. Empty otherwise.
    pub fn mismatch_hint(&self, expected: &KvHeader) -> &'static str {
        let model = crate::compose::Prompts::untagged;
        let same_shape = (self.window, self.layers, self.kv_dim) == (expected.window, expected.layers, expected.kv_dim);
        if same_shape && model(&self.fingerprint) == model(&expected.fingerprint) {
            "; it was made under another system prompt or memory turn: serve it with the --system-prompt and \
             --memory-turn it was made with (memories made before the memory turn could be chosen: --memory-turn \
             user), or remove the users' kv.log files to have their KV re-encoded when next needed (the facts stay)"
        } else {
            ""
        }
    }

    pub fn describe(&self) -> String {
        let layout = if self.layout > 0 { format!(" (layout {})", self.layout) } else { String::new() };
        format!(
            "model {} · window {} · {}{layout} · {}×{}",
            self.fingerprint, self.window, self.dtype, self.layers, self.kv_dim
        )
    }

    /// Bytes of a record's tensors for `tokens` tokens.
    pub fn tensor_bytes(&self, tokens: usize) -> usize {
        let values = 2 * self.layers * tokens * self.kv_dim;
        match self.dtype {
            KvFormat::Fp8 => Fp8Kv::body_len(self.layers, tokens, self.kv_dim, self.kv_heads()),
            f => values * f.bytes_per_value(),
        }
    }

    fn kv_heads(&self) -> usize {
        self.kv_dim / self.head_dim.max(1)
    }
}

/// One fact's KV: per layer `[tokens, kv_dim]` K and V, as f32 in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredKv {
    pub fact_id: String,
    pub tokens: Vec<u32>,
    pub k: Vec<HostTensor>,
    pub v: Vec<HostTensor>,
}

impl StoredKv {
    /// The record of this KV in `header`'s format (an error only for
    /// tensors of unequal shapes, which fp8 cannot lay out).
    pub fn encode(&self, header: &KvHeader) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(64 + 4 * self.tokens.len() + header.tensor_bytes(self.tokens.len()));
        put_bytes(&mut out, self.fact_id.as_bytes());
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        self.tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
        out.extend_from_slice(&(self.k.len() as u32).to_le_bytes());
        // Tensors side by side: a fact of an 8B model is ~8M values, and
        // its record is made on the thread that drives the device.
        let tensors: Vec<&HostTensor> = self.k.iter().chain(&self.v).collect();
        let values: usize = tensors.iter().map(|t| t.data.len()).sum();
        let start = out.len();
        match header.dtype {
            KvFormat::F32 => {
                out.resize(start + 4 * values, 0);
                fill(&mut out[start..], &tensors, 4, |_, t, o| {
                    t.data.iter().zip(o.chunks_exact_mut(4)).for_each(|(x, o)| o.copy_from_slice(&x.to_le_bytes()))
                });
            }
            KvFormat::Bf16 => {
                out.resize(start + 2 * values, 0);
                fill(&mut out[start..], &tensors, 2, |_, t, o| {
                    let pairs = t.data.iter().zip(o.chunks_exact_mut(2));
                    pairs.for_each(|(&x, o)| o.copy_from_slice(&f32_to_bf16(x).to_le_bytes()))
                });
            }
            KvFormat::Fp8 => {
                let body = fp8::encode(&self.k, &self.v, header.head_dim.max(1))
                    .map_err(|e| MemoryError::Invalid { what: "KV to store", reason: e.to_string() })?;
                out.extend_from_slice(&body);
            }
        }
        Ok(out)
    }

    /// Decodes a record written under `header`.
    pub fn decode(bytes: &[u8], header: &KvHeader, path: &Path) -> Result<StoredKv> {
        let (fact_id, tokens, at) = Self::head(bytes, bytes.len(), header, path)?;
        let (n, dim) = (tokens.len(), header.kv_dim);
        let per = n * dim;
        let body = &bytes[at..];
        let tensor = |data: Vec<f32>| HostTensor { shape: vec![n, dim], data };
        let mut tensors: Vec<HostTensor> = match header.dtype {
            KvFormat::F32 => body
                .par_chunks_exact(per * 4)
                .map(|b| tensor(b.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect()))
                .collect(),
            KvFormat::Bf16 => body
                .par_chunks_exact(per * 2)
                .map(|b| tensor(b.chunks_exact(2).map(|x| bf16_to_f32(u16::from_le_bytes([x[0], x[1]]))).collect()))
                .collect(),
            KvFormat::Fp8 => fp8_view(header, n, body, path)?.decode().map_err(|e| MemoryError::Corrupt {
                path: path.to_path_buf(),
                offset: 0,
                reason: e.to_string(),
            })?,
        };
        let v = tensors.split_off(header.layers);
        Ok(StoredKv { fact_id, tokens, k: tensors, v })
    }

    /// An fp8 record as stored, for a backend that keeps fp8 in its host
    /// tier: its fact id, tokens and tensors (codes and scales, not
    /// decoded), after the same checks as [`StoredKv::decode`].
    pub fn fp8_parts<'a>(bytes: &'a [u8], header: &KvHeader, path: &Path) -> Result<(String, Vec<u32>, Fp8Kv<'a>)> {
        if header.dtype != KvFormat::Fp8 {
            return Err(MemoryError::Invalid { what: "KV record", reason: format!("{} is not fp8", header.dtype) });
        }
        let (fact_id, tokens, at) = Self::head(bytes, bytes.len(), header, path)?;
        let kv = fp8_view(header, tokens.len(), &bytes[at..], path)?;
        Ok((fact_id, tokens, kv))
    }

    /// Checks a record written under `header` — framing, shape, exact
    /// length — without materialising its tensors; returns its fact id and
    /// tokens. What a receiver of a shard runs on every record it stages.
    pub fn check(bytes: &[u8], header: &KvHeader, path: &Path) -> Result<(String, Vec<u32>)> {
        let (fact_id, tokens, _) = Self::head(bytes, bytes.len(), header, path)?;
        Ok((fact_id, tokens))
    }

    /// How many bytes of a record's start hold its head (fact id, tokens,
    /// layer count), from the first bytes of it; `None` when `prefix` is
    /// too short to tell.
    pub fn head_len(prefix: &[u8]) -> Option<usize> {
        let word = |at: usize| prefix.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
        let id = word(0)?;
        let n = word(4 + id)?;
        Some((8 + id).saturating_add(n.saturating_mul(4)).saturating_add(4))
    }

    /// The fact id and tokens of a record of `len` bytes written under
    /// `header`, from its head (at least [`StoredKv::head_len`] bytes),
    /// checking that the rest has exactly the length its tensors need.
    pub fn identify(head: &[u8], len: usize, header: &KvHeader, path: &Path) -> Result<(String, Vec<u32>)> {
        let (fact_id, tokens, _) = Self::head(head, len, header, path)?;
        Ok((fact_id, tokens))
    }

    /// Parses the head from `bytes` (a prefix of a record of `len` bytes)
    /// and checks that exactly the tensors `header` implies follow; returns
    /// where they start.
    fn head(bytes: &[u8], len: usize, header: &KvHeader, path: &Path) -> Result<(String, Vec<u32>, usize)> {
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
        let want = header.tensor_bytes(n);
        if len.checked_sub(r.pos) != Some(want) {
            return Err(r.corrupt(format!("{} bytes of tensors, {want} expected", len as i64 - r.pos as i64)));
        }
        Ok((fact_id, tokens, r.pos))
    }
}

/// Every intact record of the KV segment at `path`, decoded, with its
/// header (records that fail their checks are left out): for tools that
/// study stored KV (`inferscale eval kv-error`), not for serving, which
/// reads records by offset when needed.
pub fn read_segment(path: &Path) -> Result<(KvHeader, Vec<StoredKv>)> {
    let records = crate::log::read_all(path)?;
    let Some((first, rest)) = records.split_first() else {
        return Err(MemoryError::Corrupt { path: path.to_path_buf(), offset: 0, reason: "an empty KV segment".into() });
    };
    let header = KvHeader::decode(first, path)?;
    if let Some(why) = header.stale() {
        return Err(MemoryError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!("KV not read: {why}"),
        });
    }
    Ok((header.clone(), rest.iter().filter_map(|r| StoredKv::decode(r, &header, path).ok()).collect()))
}

/// The parts of an fp8 record of `tokens` tokens made under `header`, from
/// `body` (the record past its head, its length already checked).
fn fp8_view<'a>(header: &KvHeader, tokens: usize, body: &'a [u8], path: &Path) -> Result<Fp8Kv<'a>> {
    if let Some(why) = header.stale() {
        return Err(MemoryError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!("KV not read: {why}"),
        });
    }
    Fp8Kv::from_body(body, header.layers, tokens, header.kv_dim, header.kv_heads()).map_err(|e| MemoryError::Corrupt {
        path: path.to_path_buf(),
        offset: 0,
        reason: e.to_string(),
    })
}

/// Runs `f` on each tensor (with its index) and its part of `out`, at
/// `width` bytes a value, tensors in parallel.
fn fill(out: &mut [u8], tensors: &[&HostTensor], width: usize, f: impl Fn(usize, &HostTensor, &mut [u8]) + Sync) {
    let mut parts = Vec::with_capacity(tensors.len());
    let mut rest = out;
    for t in tensors {
        let (part, tail) = rest.split_at_mut(t.data.len() * width);
        parts.push(part);
        rest = tail;
    }
    parts.into_par_iter().enumerate().for_each(|(i, o)| f(i, tensors[i], o));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(dtype: KvFormat) -> KvHeader {
        let layout = KvHeader::layout_of(dtype);
        KvHeader { fingerprint: "m".into(), window: 0, dtype, layers: 2, kv_dim: 4, head_dim: 2, layout }
    }

    fn sample() -> StoredKv {
        let t = |x: f32| HostTensor { shape: vec![2, 4], data: (0..8).map(|i| (x + i as f32) * 0.37 - 1.0).collect() };
        StoredKv { fact_id: "D1:1".into(), tokens: vec![7, 8], k: vec![t(0.0), t(10.0)], v: vec![t(20.0), t(-3.0)] }
    }

    #[test]
    fn every_format_round_trips_within_its_precision_and_refuses_any_other_length() {
        let kv = sample();
        let p = Path::new("x");
        for (format, rel) in [(KvFormat::F32, 0.0), (KvFormat::Bf16, 1.0 / 256.0), (KvFormat::Fp8, 1.0 / 16.0)] {
            let h = header(format);
            let bytes = kv.encode(&h).unwrap();
            assert_eq!(bytes.len(), 4 + 4 + 4 + 8 + 4 + h.tensor_bytes(2), "{format}");
            let back = StoredKv::decode(&bytes, &h, p).unwrap();
            assert_eq!((&back.fact_id, &back.tokens), (&kv.fact_id, &kv.tokens));
            for (a, b) in kv.k.iter().chain(&kv.v).zip(back.k.iter().chain(&back.v)) {
                // fp8: relative to the head's largest value (its scale).
                let amax = a.data.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in a.data.iter().zip(&b.data) {
                    let bound = if format == KvFormat::Fp8 { rel * amax } else { rel * x.abs() };
                    assert!((x - y).abs() <= bound, "{format}: {x} came back as {y}");
                }
            }
            assert_eq!(StoredKv::check(&bytes, &h, p).unwrap(), ("D1:1".to_string(), vec![7, 8]));
            let head = StoredKv::head_len(&bytes[..12]).unwrap();
            assert_eq!(head, 4 + 4 + 4 + 8 + 4);
            assert!(StoredKv::head_len(&bytes[..7]).is_none());
            assert_eq!(StoredKv::identify(&bytes[..head], bytes.len(), &h, p).unwrap().1, vec![7, 8]);
            let mut longer = bytes.clone();
            longer.push(0);
            for bad in [&bytes[..bytes.len() - 1], &longer[..]] {
                assert!(StoredKv::check(bad, &h, p).is_err(), "{format}");
                assert!(StoredKv::decode(bad, &h, p).is_err(), "{format}");
            }
            assert!(StoredKv::check(&bytes, &KvHeader { layers: 3, ..h }, p).is_err());
        }
        // f32 is exact, and the f32 record layout is the one segments had
        // before formats existed (old segments are read as they are).
        let h = header(KvFormat::F32);
        assert_eq!(StoredKv::decode(&kv.encode(&h).unwrap(), &h, p).unwrap(), kv);
    }

    #[test]
    fn headers_decode_old_segments_and_compare_the_kv_not_the_format() {
        let old = br#"{"fingerprint":"m","window":0,"dtype":"f32","layers":2,"kv_dim":4}"#;
        let h = KvHeader::decode(old, Path::new("x")).unwrap();
        assert_eq!((h.dtype, h.head_dim), (KvFormat::F32, 0));
        assert!(h.same_kv(&header(KvFormat::Bf16)));
        assert!(!h.same_kv(&KvHeader { window: 1, ..header(KvFormat::F32) }));
        let back = KvHeader::decode(&header(KvFormat::Fp8).encode(), Path::new("x")).unwrap();
        assert_eq!(back, header(KvFormat::Fp8));
        assert!(
            KvHeader::decode(br#"{"fingerprint":"m","window":0,"dtype":"f16","layers":2,"kv_dim":4}"#, Path::new("x"))
                .is_err()
        );
        let fp8_no_heads = br#"{"fingerprint":"m","window":0,"dtype":"fp8-e4m3","layers":2,"kv_dim":4}"#;
        assert!(KvHeader::decode(fp8_no_heads, Path::new("x")).is_err());
        assert_eq!("fp8".parse::<KvFormat>().unwrap(), KvFormat::Fp8);
        assert!("int4".parse::<KvFormat>().unwrap_err().to_string().contains("f32, bf16 or fp8"));
        assert!([KvFormat::F32, KvFormat::Bf16, KvFormat::Fp8].iter().all(|&f| header(f).stale().is_none()));
    }

    #[test]
    fn fp8_segments_of_the_first_layout_are_stale_and_their_records_never_decode() {
        // Written before layouts were recorded: per-head scales, no offsets.
        let first = br#"{"fingerprint":"m","window":0,"dtype":"fp8-e4m3","layers":2,"kv_dim":4,"head_dim":2}"#;
        let h = KvHeader::decode(first, Path::new("x")).unwrap();
        assert!(h.same_kv(&header(KvFormat::Fp8)), "the KV it holds is for this model: only its layout is old");
        assert!(h.stale().unwrap().contains("first fp8 layout"), "{:?}", h.stale());
        assert!(h.describe().contains("fp8-e4m3 ·"), "{}", h.describe());
        // A record of that layout (2·2·2·4 scale bytes, then codes) is not
        // read as the current layout, whatever its bytes.
        let mut record = Vec::new();
        put_bytes(&mut record, b"D1:1");
        record.extend_from_slice(&1u32.to_le_bytes());
        record.extend_from_slice(&7u32.to_le_bytes());
        record.extend_from_slice(&2u32.to_le_bytes());
        record.extend(std::iter::repeat_n(0x38, 2 * 2 * 2 * 4 + 4 * 4));
        let err = StoredKv::decode(&record, &h, Path::new("x")).unwrap_err().to_string();
        assert!(err.contains("first fp8 layout") || err.contains("bytes of tensors"), "{err}");
        assert!(StoredKv::fp8_parts(&record, &h, Path::new("x")).is_err());
        let future = KvHeader { layout: 9, ..header(KvFormat::Fp8) };
        assert!(future.stale().unwrap().contains("does not know"));
    }
}
