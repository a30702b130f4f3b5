//! fp8-e4m3, the compact KV format: the codec (OCP e4m3 "fn": no
//! infinities; 0x7f and 0xff are NaN) and one fact's KV as an fp8 segment
//! record stores it ([`encode`], [`Fp8Kv`]), which a backend may keep as it
//! is in its tiers and dequantize while injecting
//! ([`crate::Backend::host_tier_upload_fp8`]).
//!
//! Why keys carry offsets: pre-RoPE keys of some models have a few
//! channels far from zero in every token — Qwen2.5's layer-0 keys hold
//! channels near −355 that vary by ±1.2 from token to token (the k_proj
//! bias), beside channels of magnitude ~1. One scale per KV head sized for
//! −355 rounds those channels in steps of ~25, ten times what they vary:
//! what distinguishes one token's key from another's there is replaced by
//! noise, and answers from such KV are wrecked (docs/design.md, "KV
//! formats", has the per-layer table). Each fact's keys are therefore
//! stored as a per-channel offset (the channel's mean over the fact's
//! tokens, as bf16) plus a residual quantized with a scale per KV head; the
//! residual of an offset channel is as small as its variation, so it keeps
//! ~3 significant bits like every other channel. Values have no such
//! channels (measured: removing their means changes their error by a
//! tenth) and keep a scale per KV head alone.

use inferscale_model::HostTensor;
use rayon::prelude::*;

use crate::error::{EngineError, Result};

/// e4m3's largest finite magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The layout of fp8 records written now (a segment header records it):
/// 2 is per-channel key offsets with per-head scales. Layout 1 (per-head
/// scales alone, no offsets) lost keys with offset channels; its records
/// are refused and their KV re-encoded.
pub const LAYOUT: u32 = 2;

/// The fp8 scale of each KV head of a `[rows, dim]` tensor: its largest
/// magnitude over 448, 1 for a head of zeros.
pub fn head_scales(data: &[f32], dim: usize, head_dim: usize) -> Vec<f32> {
    let mut amax = vec![0f32; dim / head_dim];
    for row in data.chunks_exact(dim) {
        for (i, x) in row.iter().enumerate() {
            let m = &mut amax[i / head_dim];
            *m = m.max(x.abs());
        }
    }
    amax.into_iter().map(scale_for).collect()
}

/// The e4m3 scale of values whose largest magnitude is `amax`: it maps to
/// 448; 1 where `amax` is 0 or not finite.
pub fn scale_for(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() { amax / E4M3_MAX } else { 1.0 }
}

/// Each column's mean over the rows of a `[rows, dim]` tensor (summed in
/// f64).
pub fn channel_means(data: &[f32], dim: usize) -> Vec<f32> {
    let rows = (data.len() / dim.max(1)).max(1) as f64;
    let mut sum = vec![0f64; dim];
    for row in data.chunks_exact(dim) {
        sum.iter_mut().zip(row).for_each(|(s, &x)| *s += x as f64);
    }
    sum.into_iter().map(|s| (s / rows) as f32).collect()
}

/// [`channel_means`] rounded to bf16 (the offset a key channel is stored
/// relative to; 0 where the mean is not finite).
pub fn channel_offsets(data: &[f32], dim: usize) -> Vec<u16> {
    channel_means(data, dim).into_iter().map(|m| f32_to_bf16(if m.is_finite() { m } else { 0.0 })).collect()
}

/// bf16 by rounding to nearest, ties to even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// OCP e4m3 ("fn": no infinities, 0x7f/0xff are NaN), rounding to nearest,
/// ties to even, saturating at ±448.
///
/// On the bits, as [`f32_to_bf16`] rounds: every cached token's K and V go
/// through it (an fp8 paged cache), where a float round per value (a libm
/// call without SSE4.1) made injection ten times slower than the f32 copy.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & 0x7fff_ffff;
    // Below 2⁻⁶ the format is subnormal: multiples of 2⁻⁹ (code = multiple),
    // rounded by the float adder (2²³ leaves no fraction bits; ties to even).
    let subnormal = ((f32::from_bits(a) * 512.0 + 8_388_608.0) - 8_388_608.0) as i32 as u32;
    // Above, keep three of the 23 mantissa bits, rounding the 20 dropped to
    // nearest even (a carry moves into the exponent, as it should), rebias
    // the exponent from 127 to 7, and saturate (±448, infinities included).
    let normal = ((a + 0x7_ffff + ((a >> 20) & 1)) >> 20).wrapping_sub((127 - 7) << 3).min(0x7e);
    // Both are computed and one is picked, without branches, so that a loop
    // over a row compiles to vector instructions.
    let code = if a < (1.0f32 / 64.0).to_bits() { subnormal } else { normal };
    let signed = ((bits >> 24) & 0x80) | code;
    if a > 0x7f80_0000 { 0x7f } else { signed as u8 }
}

/// Every e4m3 code's value: decoding a record is a lookup per value.
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|c| e4m3_to_f32(c as u8)))
}

pub fn e4m3_to_f32(c: u8) -> f32 {
    let (exp, m) = (((c >> 3) & 0xf) as i32, (c & 7) as f32);
    let a = match (exp, c & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => m * 2f32.powi(-9),
        _ => (1.0 + m / 8.0) * 2f32.powi(exp - 7),
    };
    if c & 0x80 != 0 { -a } else { a }
}

/// One fact's KV as an fp8 segment record holds it ([`LAYOUT`] 2), in
/// three parts:
/// - `scales`: per tensor (K of every layer, then V of every layer),
///   `heads` little-endian f32 scales;
/// - `offsets`: per layer, `cols` little-endian bf16 key offsets;
/// - `codes`: every tensor's `[rows, cols]` e4m3 codes, in the same order.
///
/// A key is `code · its head's scale + its channel's offset`; a value is
/// `code · its head's scale` (multiplied, then added: two roundings, which
/// every decoder — host and kernel — makes alike).
#[derive(Clone, Copy)]
pub struct Fp8Kv<'a> {
    pub rows: usize,
    pub cols: usize,
    pub heads: usize,
    pub layers: usize,
    pub scales: &'a [u8],
    pub offsets: &'a [u8],
    pub codes: &'a [u8],
}

/// One tensor of an [`Fp8Kv`]: its codes, its heads' scales and, for a
/// key, its channels' offsets.
#[derive(Clone, Copy)]
pub struct Fp8Tensor<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [u8],
    pub offsets: Option<&'a [u8]>,
}

impl<'a> Fp8Kv<'a> {
    /// Bytes of the scales and offsets before a record's codes.
    pub fn params_len(layers: usize, cols: usize, heads: usize) -> usize {
        2 * layers * heads * 4 + layers * cols * 2
    }

    /// Bytes of a record body of `rows` tokens.
    pub fn body_len(layers: usize, rows: usize, cols: usize, heads: usize) -> usize {
        Self::params_len(layers, cols, heads) + 2 * layers * rows * cols
    }

    /// The parts of a record body (its length checked).
    pub fn from_body(body: &'a [u8], layers: usize, rows: usize, cols: usize, heads: usize) -> Result<Self> {
        if body.len() != Self::body_len(layers, rows, cols, heads) {
            return Err(EngineError::Shape(format!(
                "fp8 KV of {layers} layers [{rows}, {cols}] with {heads} heads: {} bytes, {} expected",
                body.len(),
                Self::body_len(layers, rows, cols, heads)
            )));
        }
        let (scales, rest) = body.split_at(2 * layers * heads * 4);
        let (offsets, codes) = rest.split_at(layers * cols * 2);
        let kv = Fp8Kv { rows, cols, heads, layers, scales, offsets, codes };
        kv.check()?;
        Ok(kv)
    }

    /// Tensors (K of every layer, then V).
    pub fn tensors(&self) -> usize {
        2 * self.layers
    }

    /// Whether the byte lengths agree with the shape.
    pub fn check(&self) -> Result<()> {
        let ok = self.heads > 0
            && self.cols.is_multiple_of(self.heads)
            && self.scales.len() == 4 * self.tensors() * self.heads
            && self.offsets.len() == 2 * self.layers * self.cols
            && self.codes.len() == self.tensors() * self.rows * self.cols;
        match ok {
            true => Ok(()),
            false => Err(EngineError::Shape(format!(
                "fp8 KV of {} layers [{}, {}] with {} heads: {} scale, {} offset and {} code bytes",
                self.layers,
                self.rows,
                self.cols,
                self.heads,
                self.scales.len(),
                self.offsets.len(),
                self.codes.len()
            ))),
        }
    }

    /// Tensor `i` (K of layer i below `layers`, else V of layer
    /// i − `layers`).
    pub fn tensor(&self, i: usize) -> Fp8Tensor<'a> {
        let per = self.rows * self.cols;
        let key = i < self.layers;
        Fp8Tensor {
            codes: &self.codes[i * per..(i + 1) * per],
            scales: &self.scales[4 * i * self.heads..4 * (i + 1) * self.heads],
            offsets: key.then(|| &self.offsets[2 * i * self.cols..2 * (i + 1) * self.cols]),
        }
    }

    /// Every tensor decoded to f32 (a lookup, a multiply and for keys an
    /// add per value), tensors in parallel.
    pub fn decode(&self) -> Result<Vec<HostTensor>> {
        self.check()?;
        let (cols, heads) = (self.cols, self.heads);
        Ok((0..self.tensors()).into_par_iter().map(|i| self.tensor(i).decode(cols, heads)).collect())
    }
}

impl Fp8Tensor<'_> {
    /// The values as f32, `cols` to a row.
    pub fn decode(&self, cols: usize, heads: usize) -> HostTensor {
        let (lut, head_dim) = (e4m3_table(), cols / heads.max(1));
        let scales: Vec<f32> =
            self.scales.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect();
        let offsets: Vec<f32> = match self.offsets {
            Some(o) => o.chunks_exact(2).map(|x| bf16_to_f32(u16::from_le_bytes([x[0], x[1]]))).collect(),
            None => vec![0.0; cols],
        };
        let data = self
            .codes
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let col = i % cols;
                lut[c as usize] * scales[col / head_dim] + offsets[col]
            })
            .collect();
        HostTensor { shape: vec![self.codes.len() / cols.max(1), cols], data }
    }
}

/// The fp8 record body ([`Fp8Kv`]) of one fact's K and V (per layer
/// `[rows, cols]`, `head_dim` columns a KV head), tensors in parallel.
pub fn encode(k: &[HostTensor], v: &[HostTensor], head_dim: usize) -> Result<Vec<u8>> {
    let tensors: Vec<&HostTensor> = k.iter().chain(v).collect();
    let (layers, first) = (k.len(), tensors.first().map(|t| crate::shape::matrix_dims(t)).transpose()?);
    let (rows, cols) = first.unwrap_or((0, 0));
    let fits = |t: &&HostTensor| crate::shape::matrix_dims(t).is_ok_and(|d| d == (rows, cols));
    if v.len() != layers || !tensors.iter().all(fits) || head_dim == 0 || !cols.is_multiple_of(head_dim) {
        return Err(EngineError::Shape(format!(
            "fp8 encode: {} K and {} V tensors of [{rows}, {cols}], head width {head_dim}",
            k.len(),
            v.len()
        )));
    }
    let heads = cols / head_dim;
    // Per tensor: its offsets (keys only), its residuals' head scales, codes.
    let parts: Vec<(Vec<u16>, Vec<f32>, Vec<u8>)> = tensors
        .par_iter()
        .enumerate()
        .map(|(i, t)| {
            let offsets = if i < layers { channel_offsets(&t.data, cols) } else { Vec::new() };
            let off = |col: usize| offsets.get(col).map_or(0.0, |&o| bf16_to_f32(o));
            let residual: Vec<f32> = t.data.iter().enumerate().map(|(j, &x)| x - off(j % cols)).collect();
            let scales = head_scales(&residual, cols, head_dim);
            let codes = residual.iter().enumerate().map(|(j, &r)| f32_to_e4m3(r / scales[(j % cols) / head_dim]));
            let codes = codes.collect();
            (offsets, scales, codes)
        })
        .collect();
    let mut out = Vec::with_capacity(Fp8Kv::body_len(layers, rows, cols, heads));
    parts.iter().flat_map(|p| &p.1).for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
    parts.iter().flat_map(|p| &p.0).for_each(|o| out.extend_from_slice(&o.to_le_bytes()));
    parts.iter().for_each(|p| out.extend_from_slice(&p.2));
    Ok(out)
}

/// `t` (`[rows, cols]`) rounded as the first fp8 layout stored it — one
/// scale per KV head of `head_dim` columns, no offsets — and decoded.
/// Nothing stores it any more: it is kept to measure against (the gate's
/// tests and `inferscale eval kv-error` show what it lost).
pub fn first_layout_round_trip(t: &HostTensor, head_dim: usize) -> Result<HostTensor> {
    let (_, cols) = crate::shape::matrix_dims(t)?;
    if head_dim == 0 || !cols.is_multiple_of(head_dim) {
        return Err(EngineError::Shape(format!("{cols} columns in heads of {head_dim}")));
    }
    let scales = head_scales(&t.data, cols, head_dim);
    let data = t.data.iter().enumerate().map(|(i, &x)| {
        let s = scales[(i % cols) / head_dim];
        e4m3_to_f32(f32_to_e4m3(x / s)) * s
    });
    Ok(HostTensor { shape: t.shape.clone(), data: data.collect() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition [`f32_to_e4m3`] computes on the bits: the value scaled
    /// to [8, 16) and rounded as a float.
    fn e4m3_by_definition(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        if a >= E4M3_MAX {
            return sign | 0x7e;
        }
        if a < 1.0 / 64.0 {
            return sign | (a * 512.0).round_ties_even() as u8;
        }
        let mut e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        let scale = f32::from_bits(((127 + 3 - e) as u32) << 23);
        let mut m = (a * scale).round_ties_even() as u32;
        if m == 16 {
            m = 8;
            e += 1;
        }
        sign | ((((e + 7) as u32) << 3) | (m - 8)).min(0x7e) as u8
    }

    /// Every code's neighbourhood (its value, the midpoints to the next
    /// code and a few ulps either side of them) and a stride through all
    /// 2³² bit patterns: the same code as the definition.
    #[test]
    fn e4m3_rounding_on_the_bits_is_the_definition() {
        let check = |x: f32| assert_eq!(f32_to_e4m3(x), e4m3_by_definition(x), "{x:e} ({:#010x})", x.to_bits());
        for c in 0u8..0x7f {
            let (lo, hi) = (e4m3_to_f32(c), e4m3_to_f32(c + 1));
            for v in [lo, (lo + hi) / 2.0] {
                for d in -3i32..=3 {
                    let x = f32::from_bits((v.to_bits() as i32 + d).max(0) as u32);
                    check(x);
                    check(-x);
                }
            }
        }
        for x in [0.0, -0.0, 448.0, 464.0, 1e30, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE] {
            check(x);
        }
        for bits in (0..=u32::MAX).step_by(101) {
            check(f32::from_bits(bits));
        }
    }

    #[test]
    fn e4m3_codes_decode_to_themselves_and_round_to_nearest() {
        // Every finite code is its own encoding (both zeros included).
        for c in 0u8..=255 {
            if c & 0x7f == 0x7f {
                assert!(e4m3_to_f32(c).is_nan());
                continue;
            }
            let x = e4m3_to_f32(c);
            let back = f32_to_e4m3(x);
            assert_eq!(e4m3_to_f32(back), x, "code {c:#04x} = {x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9), "smallest subnormal");
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6), "smallest normal");
        assert_eq!(f32_to_e4m3(1e9), 0x7e, "saturates");
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        // Between 1 (0x38) and 1.125 (0x39): 1.0625 is a tie, to even (1).
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        assert_eq!(f32_to_e4m3(15.5), 0x58, "a tie between 15 and 16 rounds up into the next binade");
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00, "a tie below the smallest subnormal goes to zero");
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_is_exact_on_bf16_values() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 3.140625, 1e-30, 6.0e4, f32::MAX / 2.0] {
            let y = bf16_to_f32(f32_to_bf16(x));
            assert_eq!(bf16_to_f32(f32_to_bf16(y)), y, "idempotent on {x}");
            assert!((x - y).abs() <= x.abs() / 256.0, "{x} → {y}");
        }
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties go to the even (1).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 2f32.powi(-8))), 1.0);
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn a_record_decodes_keys_with_their_offsets_and_values_without() {
        // One layer, [1, 4], two heads: K scales (2, 0.5), V scales (1, 4);
        // K offsets (10, 0, -1, 0.5); a value has none.
        let scales: Vec<u8> = [2f32, 0.5, 1.0, 4.0].iter().flat_map(|s| s.to_le_bytes()).collect();
        let offsets: Vec<u8> = [10f32, 0.0, -1.0, 0.5].iter().flat_map(|&o| f32_to_bf16(o).to_le_bytes()).collect();
        let codes = [0x38, 0xb8, 0x40, 0x00, 0x38, 0x38, 0x38, 0x7e];
        let kv = Fp8Kv { rows: 1, cols: 4, heads: 2, layers: 1, scales: &scales, offsets: &offsets, codes: &codes };
        let t = kv.decode().unwrap();
        assert_eq!(t[0].data, [12.0, -2.0, 0.0, 0.5]);
        assert_eq!(t[1].data, [1.0, 1.0, 4.0, 1792.0]);
        let short = Fp8Kv { codes: &codes[..7], ..kv };
        assert!(short.decode().is_err());
        let body: Vec<u8> = [&scales[..], &offsets, &codes].concat();
        assert_eq!(Fp8Kv::from_body(&body, 1, 1, 4, 2).unwrap().decode().unwrap(), t);
        assert!(Fp8Kv::from_body(&body[1..], 1, 1, 4, 2).is_err());
    }

    /// Keys of two heads whose channel 1 sits near −355 and varies by ±1
    /// (as Qwen2.5's layer-0 keys do), beside channels of magnitude ~1.
    fn offset_keys(rows: usize) -> HostTensor {
        let data = (0..rows * 8)
            .map(|i| {
                let (r, c) = ((i / 8) as f32, i % 8);
                let wave = ((r * 0.7 + c as f32 * 1.3).sin() + (r * 0.31).cos()) * 0.6;
                if c == 1 { -355.0 + wave } else { wave }
            })
            .collect();
        HostTensor { shape: vec![rows, 8], data }
    }

    #[test]
    fn an_offset_channel_keeps_its_variation_through_the_codec() {
        let (k, v) = (offset_keys(40), HostTensor { shape: vec![40, 8], data: offset_keys(40).data });
        let body = encode(std::slice::from_ref(&k), std::slice::from_ref(&v), 4).unwrap();
        let back = Fp8Kv::from_body(&body, 1, 40, 8, 2).unwrap().decode().unwrap();
        // What matters for attention is a key channel's variation from token
        // to token: the error there against the channel's own spread.
        let column = |t: &HostTensor, c: usize| t.data.iter().skip(c).step_by(8).copied().collect::<Vec<f32>>();
        let (x, y) = (column(&k, 1), column(&back[0], 1));
        let mean = x.iter().sum::<f32>() / x.len() as f32;
        let spread = x.iter().map(|a| (a - mean).powi(2)).sum::<f32>().sqrt();
        let err = x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
        assert!(err / spread < 0.1, "key offset channel: error {err} against a spread of {spread}");
        // Values are stored without offsets: the same channel's error is a
        // share of its magnitude (−355 in steps of 32·355/448 ≈ 25), several
        // times its spread — why keys carry offsets and values need not.
        let (x, y) = (column(&v, 1), column(&back[1], 1));
        let verr = x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
        assert!(verr / spread > 1.0, "value channel: error {verr} against {spread}");
        // Every other key channel is within e4m3's relative step of its head's range.
        for c in [0, 2, 3, 4, 5, 6, 7] {
            let (x, y) = (column(&k, c), column(&back[0], c));
            let amax = x.iter().fold(0f32, |m, a| m.max(a.abs()));
            assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= amax / 16.0 + 0.02), "channel {c}");
        }
    }

    #[test]
    fn encode_refuses_tensors_of_unequal_shapes() {
        let (a, b) = (offset_keys(3), offset_keys(4));
        assert!(encode(std::slice::from_ref(&a), std::slice::from_ref(&b), 4).is_err());
        assert!(encode(std::slice::from_ref(&a), &[], 4).is_err());
        assert!(encode(std::slice::from_ref(&a), std::slice::from_ref(&a), 3).is_err());
    }
}
