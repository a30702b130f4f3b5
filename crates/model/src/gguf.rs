//! GGUF reader (versions 2 and 3).
//!
//! The file is memory-mapped and parsed with bounds checks on every read, so
//! a truncated or corrupt file yields [`ModelError::Gguf`] naming the byte
//! offset instead of a panic. Counts read from the file are checked against
//! the bytes that remain before anything is allocated for them, which keeps a
//! hostile header from asking for terabytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{ModelError, Result};
use crate::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;

/// A metadata value. Arrays keep their element values; GGUF arrays of arrays
/// are allowed by the format and parsed recursively.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the fastest-varying (row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the tensor data in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Row-major shape, slowest dimension first (the reverse of GGML's order).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and the file is not modified by us while
        // mapped; a concurrent external truncation would be a user error akin to
        // deleting the model mid-load.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let parsed = parse(&mmap, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.offset as usize..(info.offset + info.n_bytes) as usize]
    }

    /// Dequantizes a tensor to f32 in row-major order.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })?;
        let data = crate::quant::dequantize(info.ty, self.tensor_bytes(info), info.n_elements() as usize).map_err(
            |reason| ModelError::Gguf {
                path: self.path.clone(),
                offset: info.offset,
                reason: format!("tensor `{name}`: {reason}"),
            },
        )?;
        Ok((info.shape(), data))
    }
}

#[derive(Debug)]
/// What [`parse`] recovers from the bytes, before they are tied to a mapping.
pub struct Parsed {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

/// Parses a complete GGUF image. Public so the fuzz target and property tests
/// can drive it on arbitrary bytes.
pub fn parse(bytes: &[u8], path: &Path) -> Result<Parsed> {
    let mut r = Reader { bytes, pos: 0, path };
    let magic = r.take(4)?;
    if magic != MAGIC {
        return Err(r.err_at(0, format!("bad magic {magic:02x?}, expected \"GGUF\"")));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(r.err_at(4, format!("unsupported GGUF version {version} (2 and 3 are)")));
    }
    let n_tensors = r.u64()?;
    let n_kv = r.u64()?;
    // Every KV needs at least 12 bytes (key length + type), every tensor info 24.
    r.check_count(n_kv, 12, "metadata count")?;
    r.check_count(n_tensors, 24, "tensor count")?;

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r.value(ty, 0)?;
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return Err(r.err(format!("general.alignment {v:?} is not a power of two"))),
        },
    };

    let mut infos = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let at = r.pos as u64;
        let name = r.string()?;
        let n_dims = r.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err_at(at, format!("tensor `{name}` has {n_dims} dimensions (1..=4 allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64()?);
        }
        let raw_ty = r.u32()?;
        let offset = r.u64()?;
        let ty = GgmlType::from_u32(raw_ty).ok_or_else(|| ModelError::UnsupportedType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            ty: format!("ggml type id {raw_ty}"),
        })?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| r.err_at(at, format!("tensor `{name}` dims {dims:?} overflow")))?;
        let n_bytes = ty.n_bytes(n_elements).ok_or_else(|| {
            r.err_at(at, format!("tensor `{name}`: {n_elements} elements is not a whole number of {ty:?} blocks"))
        })?;
        infos.push((at, name, dims, ty, offset, n_bytes));
    }

    let data_start = align_up(r.pos as u64, alignment);
    let file_len = bytes.len() as u64;
    let mut tensors = BTreeMap::new();
    for (at, name, dims, ty, rel, n_bytes) in infos {
        if rel % alignment != 0 {
            return Err(r.err_at(at, format!("tensor `{name}` offset {rel} is not {alignment}-aligned")));
        }
        let offset = data_start
            .checked_add(rel)
            .filter(|o| o.checked_add(n_bytes).is_some_and(|end| end <= file_len))
            .ok_or_else(|| {
                r.err_at(
                    at,
                    format!("tensor `{name}` data [{rel}+{n_bytes} bytes] runs past the end of the file ({file_len} bytes): truncated?"),
                )
            })?;
        if tensors.contains_key(&name) {
            return Err(r.err_at(at, format!("duplicate tensor `{name}`")));
        }
        tensors.insert(name.clone(), TensorInfo { name, dims, ty, offset, n_bytes });
    }
    Ok(Parsed { version, metadata, tensors })
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Nesting limit for arrays of arrays; real files use one level.
const MAX_ARRAY_DEPTH: usize = 4;

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err_at(&self, offset: u64, reason: String) -> ModelError {
        ModelError::Gguf { path: self.path.to_path_buf(), offset, reason }
    }

    fn err(&self, reason: String) -> ModelError {
        self.err_at(self.pos as u64, reason)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            self.err(format!("need {n} bytes, only {} left: file truncated", self.bytes.len() - self.pos))
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Rejects a count whose minimal encoding cannot fit in the remaining bytes.
    fn check_count(&self, count: u64, min_bytes_each: u64, what: &str) -> Result<()> {
        let left = (self.bytes.len() - self.pos) as u64;
        if count.saturating_mul(min_bytes_each) > left {
            return Err(self.err(format!("{what} {count} cannot fit in the {left} bytes left")));
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String> {
        let at = self.pos as u64;
        let len = self.u64()?;
        self.check_count(len, 1, "string length")?;
        let raw = self.take(len as usize)?;
        String::from_utf8(raw.to_vec()).map_err(|e| self.err_at(at, format!("string is not UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>()?[0]),
            1 => MetaValue::I8(self.array::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.err(format!("bool byte {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}")));
                }
                let elem_ty = self.u32()?;
                let count = self.u64()?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(self.err(format!("unknown array element type {t}"))),
                };
                self.check_count(count, min, "array length")?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            t => return Err(self.err(format!("unknown metadata value type {t}"))),
        })
    }
}

/// Writes GGUF v3 files. Used by tests and the fuzz seed corpus to build small
/// valid files; not a general converter.
pub mod write {
    use super::MetaValue;
    use crate::quant::GgmlType;

    /// One tensor to write: GGML dims (fastest first) and its encoded bytes.
    pub struct TensorOut<'a> {
        pub name: &'a str,
        pub dims: Vec<u64>,
        pub ty: GgmlType,
        pub data: &'a [u8],
    }

    pub fn to_bytes(metadata: &[(&str, MetaValue)], tensors: &[TensorOut<'_>]) -> Vec<u8> {
        const ALIGN: usize = 32;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut out, k);
            put_value(&mut out, v);
        }
        let mut rel = 0usize;
        let mut offsets = Vec::new();
        for t in tensors {
            put_str(&mut out, t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&(t.ty as u32).to_le_bytes());
            out.extend_from_slice(&(rel as u64).to_le_bytes());
            offsets.push(rel);
            rel = (rel + t.data.len()).div_ceil(ALIGN) * ALIGN;
        }
        let start = out.len().div_ceil(ALIGN) * ALIGN;
        out.resize(start, 0);
        for (t, off) in tensors.iter().zip(offsets) {
            out.resize(start + off, 0);
            out.extend_from_slice(t.data);
        }
        out
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &MetaValue) -> u32 {
        match v {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::String(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }

    fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
        out.extend_from_slice(&type_id(v).to_le_bytes());
        put_payload(out, v);
    }

    fn put_payload(out: &mut Vec<u8>, v: &MetaValue) {
        match v {
            MetaValue::U8(x) => out.push(*x),
            MetaValue::I8(x) => out.push(*x as u8),
            MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::Bool(x) => out.push(u8::from(*x)),
            MetaValue::String(s) => put_str(out, s),
            MetaValue::Array(items) => {
                let elem = items.first().map_or(4, type_id);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    put_payload(out, it);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::write::{TensorOut, to_bytes};
    use super::*;

    fn sample() -> Vec<u8> {
        let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        to_bytes(
            &[
                ("general.architecture", MetaValue::String("llama".into())),
                ("llama.block_count", MetaValue::U32(1)),
                (
                    "tokenizer.ggml.tokens",
                    MetaValue::Array(vec![MetaValue::String("a".into()), MetaValue::String("b".into())]),
                ),
            ],
            &[TensorOut { name: "w", dims: vec![3, 2], ty: GgmlType::F32, data: &data }],
        )
    }

    #[test]
    fn roundtrip_small_file() {
        let bytes = sample();
        let p = parse(&bytes, Path::new("x.gguf")).unwrap();
        assert_eq!(p.version, 3);
        assert_eq!(p.metadata["llama.block_count"].as_u64(), Some(1));
        assert_eq!(p.metadata["tokenizer.ggml.tokens"].as_array().unwrap().len(), 2);
        let t = &p.tensors["w"];
        assert_eq!(t.shape(), vec![2, 3]);
        assert_eq!(t.offset % 32, 0);
        let got: Vec<f32> = bytes[t.offset as usize..(t.offset + t.n_bytes) as usize]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample();
        for cut in 0..bytes.len() {
            let err = parse(&bytes[..cut], Path::new("cut.gguf"));
            assert!(err.is_err(), "truncation at {cut} parsed");
            let msg = err.err().unwrap().to_string();
            assert!(msg.contains("cut.gguf"), "{msg}");
        }
    }

    #[test]
    fn bad_magic_and_version() {
        let mut bytes = sample();
        bytes[0] = b'X';
        assert!(parse(&bytes, Path::new("m.gguf")).unwrap_err().to_string().contains("bad magic"));
        let mut bytes = sample();
        bytes[4] = 9;
        assert!(parse(&bytes, Path::new("m.gguf")).unwrap_err().to_string().contains("version 9"));
    }

    #[test]
    fn huge_counts_are_rejected_before_allocating() {
        let mut bytes = sample();
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        let msg = parse(&bytes, Path::new("h.gguf")).unwrap_err().to_string();
        assert!(msg.contains("metadata count"), "{msg}");
    }

    #[test]
    fn unsupported_tensor_type_names_tensor() {
        let mut bytes = sample();
        // The tensor's type id sits 12 bytes before the end of the tensor-info block;
        // find it by searching for the name and skipping name, n_dims and dims.
        let at = bytes.windows(9).position(|w| w == b"\x01\0\0\0\0\0\0\0w").unwrap() + 9;
        let ty_at = at + 4 + 16;
        bytes[ty_at..ty_at + 4].copy_from_slice(&99u32.to_le_bytes());
        let msg = parse(&bytes, Path::new("t.gguf")).unwrap_err().to_string();
        assert!(msg.contains("`w`") && msg.contains("99"), "{msg}");
    }
}
