//! fp8-e4m3, the compact KV format: the codec (OCP e4m3 "fn": no
//! infinities; 0x7f and 0xff are NaN) and one fact's KV as an fp8 segment
//! record stores it, which a backend may keep as it is in its host tier
//! and dequantize while injecting ([`crate::Backend::host_tier_upload_fp8`]).

use inferscale_model::HostTensor;
use rayon::prelude::*;

use crate::error::{EngineError, Result};

/// e4m3's largest finite magnitude.
pub const E4M3_MAX: f32 = 448.0;

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
    amax.into_iter().map(|a| if a > 0.0 && a.is_finite() { a / E4M3_MAX } else { 1.0 }).collect()
}

/// OCP e4m3 ("fn": no infinities, 0x7f/0xff are NaN), rounding to nearest,
/// ties to even, saturating at ±448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Below 2⁻⁶ the format is subnormal: multiples of 2⁻⁹ (code = multiple).
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    // a · 2^(3-e) is in [8, 16): the implicit one and three mantissa bits
    // (the power of two built from its bits: exact, and no `powi` per value).
    let scale = f32::from_bits(((127 + 3 - e) as u32) << 23);
    let mut m = (a * scale).round_ties_even() as u32;
    if m == 16 {
        m = 8;
        e += 1;
    }
    let code = (((e + 7) as u32) << 3) | (m - 8);
    sign | code.min(0x7e) as u8
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

/// One fact's KV as an fp8 segment record holds it: `tensors` tensors (K of
/// every layer, then V) of `[rows, cols]` e4m3 codes, one after another in
/// `codes`, and `heads` scales (little-endian f32) per tensor in `scales`,
/// in the same order: value = code · the scale of its KV head.
pub struct Fp8Kv<'a> {
    pub rows: usize,
    pub cols: usize,
    pub heads: usize,
    pub tensors: usize,
    pub scales: &'a [u8],
    pub codes: &'a [u8],
}

impl Fp8Kv<'_> {
    /// Whether the byte lengths agree with the shape.
    pub fn check(&self) -> Result<()> {
        let ok = self.heads > 0
            && self.cols.is_multiple_of(self.heads)
            && self.scales.len() == 4 * self.tensors * self.heads
            && self.codes.len() == self.tensors * self.rows * self.cols;
        match ok {
            true => Ok(()),
            false => Err(EngineError::Shape(format!(
                "fp8 KV of {} tensors [{}, {}] with {} heads: {} scale and {} code bytes",
                self.tensors,
                self.rows,
                self.cols,
                self.heads,
                self.scales.len(),
                self.codes.len()
            ))),
        }
    }

    /// Every tensor decoded to f32 (a lookup and a multiply per value),
    /// tensors in parallel.
    pub fn decode(&self) -> Result<Vec<HostTensor>> {
        self.check()?;
        let (per, head_dim, lut) = (self.rows * self.cols, self.cols / self.heads, e4m3_table());
        let scales: Vec<f32> =
            self.scales.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect();
        let cols = self.cols;
        Ok(self
            .codes
            .par_chunks_exact(per.max(1))
            .zip(scales.par_chunks_exact(self.heads))
            .map(|(c, s)| HostTensor {
                shape: vec![self.rows, cols],
                data: c.iter().enumerate().map(|(i, &c)| lut[c as usize] * s[(i % cols) / head_dim]).collect(),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_record_decodes_to_codes_times_their_head_scale() {
        // Two tensors [1, 4] of two heads: scales (2, 0.5) and (1, 4).
        let scales: Vec<u8> = [2f32, 0.5, 1.0, 4.0].iter().flat_map(|s| s.to_le_bytes()).collect();
        let codes = [0x38, 0xb8, 0x40, 0x00, 0x38, 0x38, 0x38, 0x7e];
        let kv = Fp8Kv { rows: 1, cols: 4, heads: 2, tensors: 2, scales: &scales, codes: &codes };
        let t = kv.decode().unwrap();
        assert_eq!(t[0].data, [2.0, -2.0, 1.0, 0.0]);
        assert_eq!(t[1].data, [1.0, 1.0, 4.0, 1792.0]);
        let short = Fp8Kv { codes: &codes[..7], ..kv };
        assert!(short.decode().is_err());
    }
}
