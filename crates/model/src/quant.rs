//! GGML tensor types and their dequantization to f32.
//!
//! Block layouts follow ggml's `ggml-common.h`. Each function consumes whole
//! blocks; the caller has already checked that the byte length matches the
//! element count (see [`GgmlType::n_bytes`]).

use half::{bf16, f16};

/// The GGML tensor types this reader knows. Types it can parse but not
/// dequantize are reported by [`dequantize`] with their name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    BF16 = 30,
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match v {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            30 => BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    pub fn block(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
        }
    }

    /// Bytes taken by `n` elements, or `None` if `n` is not a whole number of blocks.
    pub fn n_bytes(self, n: u64) -> Option<u64> {
        let (elems, bytes) = self.block();
        if !n.is_multiple_of(elems) {
            return None;
        }
        (n / elems).checked_mul(bytes)
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `n` elements of type `ty` from `bytes` into a new f32 vector.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let need = ty.n_bytes(n as u64).ok_or_else(|| format!("{n} elements is not a whole number of {ty:?} blocks"))?;
    if need != bytes.len() as u64 {
        return Err(format!("{ty:?}: {n} elements need {need} bytes, got {}", bytes.len()));
    }
    let mut out = vec![0f32; n];
    let (block_elems, block_bytes) = ty.block();
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    let blocks = bytes.chunks_exact(block_bytes).zip(out.chunks_exact_mut(block_elems));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = f16_at(b, 0)),
        GgmlType::BF16 => blocks.for_each(|(b, y)| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
        other => return Err(format!("dequantization of {other:?} is not supported")),
    }
    Ok(out)
}

/// Q4_0: f16 scale d, 16 bytes of nibbles; low nibbles are elements 0..16,
/// high nibbles 16..32; x = (q - 8) · d.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: f16 scale d, f16 minimum m, 16 bytes of nibbles; x = q · d + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = (q & 0x0f) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// Fifth bits of the Q5 formats: bit j of `qh` belongs to element j.
fn q5_high(qh: u32, j: usize) -> (u8, u8) {
    (((qh >> j) << 4 & 0x10) as u8, ((qh >> (j + 12)) & 0x10) as u8)
}

/// Q5_0: f16 d, u32 high bits, 16 bytes of nibbles; x = (q - 16) · d.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let (h0, h1) = q5_high(qh, j);
        y[j] = (((q & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((q >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// Q5_1: f16 d, f16 m, u32 high bits, 16 bytes of nibbles; x = q · d + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let (h0, h1) = q5_high(qh, j);
        y[j] = ((q & 0x0f) | h0) as f32 * d + m;
        y[j + 16] = ((q >> 4) | h1) as f32 * d + m;
    }
}

/// Q8_0: f16 d, 32 signed bytes; x = q · d.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = (q as i8) as f32 * d;
    }
}

/// The 6-bit (scale, min) pair `j` of a Q4_K/Q5_K super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q4_K: 256 elements as 8 sub-blocks of 32 with 6-bit scales and mins.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * j..32 * j + 32];
        let out = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0x0f) as f32 - m1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q6_K: 256 elements, 4 low bits in `ql`, 2 high bits in `qh`, 16 signed
/// 8-bit scales, one f16 super-scale at the end.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
        let out = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16) as u8;
        }
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_block_layout() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16 {
            b[4 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let y = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 2.0 - 1.0);
            assert_eq!(y[j + 16], (15 - j) as f32 * 2.0 - 1.0);
        }
    }

    #[test]
    fn length_mismatch_is_an_error() {
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 17], 32).is_err());
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 18], 31).is_err());
        let e = dequantize(GgmlType::Q2K, &[0u8; 84], 256).unwrap_err();
        assert!(e.contains("Q2K"), "{e}");
    }
}
