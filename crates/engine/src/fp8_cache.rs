//! The row format of an fp8 paged KV cache (docs/design.md §2.2), shared by
//! the backends that will hold one: the arithmetic and its invariants here,
//! beside their tests, so that the CPU store and the device kernels compute
//! the same thing.
//!
//! The cache holds keys after RoPE, and a key of Qwen2.5 has channels far
//! from zero in every token (its k_proj bias): rounded as they are, those
//! channels swamp everything that tells one token from another, and the
//! model's answers change (§2.2's table: 8–10 % kept). Each layer therefore
//! has one offset per KV channel `o` — the channel means, before RoPE, of a
//! calibration write of at least [`CALIBRATION_TOKENS`] tokens — and a key
//! at position `p` is stored as the e4m3 codes of `R(p)·k − R(p)·o` with one
//! scale per (token, KV head) (§2.2: 78–85 % of answers kept, as rounding
//! before RoPE keeps). Attention reads `code · scale` and adds `q · R(p)·o`
//! to the score, which [`OffsetScore`] gives from two coefficients per RoPE
//! pair computed once per query row. Values have no offset channels and are
//! rows of codes with a scale alone.

use inferscale_model::ModelFiles;

use crate::error::{EngineError, Result};
use crate::fp8::{channel_means, e4m3_table, f32_to_e4m3, scale_for};

/// Fewest tokens of the write a layer's key offsets are calibrated on.
pub const CALIBRATION_TOKENS: usize = 16;

/// The text an fp8 cache's key offsets are calibrated on, once per engine:
/// ordinary conversational English of the kind a memory holds (names,
/// times, places, numbers). What the offsets must capture — channels a
/// model's k_proj bias holds far from zero in every token — does not depend
/// on the text; the rest of each mean only centres what is rounded.
pub const CALIBRATION_TEXT: &str = "Last spring I adopted a grey cat and named her Pepper. On Saturday \
    morning we walked to the market, bought apples, bread and two kinds of cheese, and talked about my \
    plan to study nursing in Lisbon this autumn. My brother called at 7 pm to say that his flight to Denver \
    was delayed by two hours, so we moved dinner to Sunday. What do you remember about my week?";

/// The tokens of [`CALIBRATION_TEXT`], or — for model files without a
/// tokenizer (random-weight shapes) — 64 token ids spread over the
/// vocabulary.
pub fn calibration_tokens(files: &ModelFiles) -> Result<Vec<u32>> {
    let tokens = match &files.tokenizer {
        Some(t) => t.encode(CALIBRATION_TEXT, false)?,
        None => {
            let vocab = files.config.vocab_size.max(1) as u64;
            (0..64u64).map(|i| ((i * 7919 + 11) % vocab) as u32).collect()
        }
    };
    if tokens.len() < CALIBRATION_TOKENS {
        return Err(EngineError::Shape(format!(
            "fp8 KV cache: the calibration text is {} tokens, fewer than {CALIBRATION_TOKENS}",
            tokens.len()
        )));
    }
    Ok(tokens)
}

/// A layer's key offsets: each KV channel's mean over `keys` (`[rows,
/// kv_dim]`, before RoPE), or `None` when they are fewer than
/// [`CALIBRATION_TOKENS`] rows (or any mean is not finite).
pub fn key_offsets(keys: &[f32], kv_dim: usize) -> Option<Vec<f32>> {
    if keys.len() / kv_dim.max(1) < CALIBRATION_TOKENS {
        return None;
    }
    let means = channel_means(keys, kv_dim);
    means.iter().all(|m| m.is_finite()).then_some(means)
}

/// `row` as e4m3 codes with one scale (its largest magnitude over 448; 1
/// for a row of zeros): returns the scale. Rows of a multiple of 16 values
/// are encoded sixteen at a time where the CPU has AVX-512 — the same codes.
pub fn encode_row(row: &[f32], codes: &mut [u8]) -> f32 {
    let scale = scale_for(row.iter().fold(0f32, |m, x| m.max(x.abs())));
    #[cfg(target_arch = "x86_64")]
    if row.len() == codes.len() && row.len().is_multiple_of(16) && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected; equal lengths, a multiple of 16.
        unsafe { avx512::encode(row, scale, codes) };
        return scale;
    }
    codes.iter_mut().zip(row).for_each(|(c, &x)| *c = f32_to_e4m3(x / scale));
    scale
}

/// `codes · scale`, plus `add` element by element where given, into `out`
/// (the same products and sums sixteen at a time where the CPU has AVX-512).
pub fn decode_row_adding(codes: &[u8], scale: f32, add: Option<&[f32]>, out: &mut [f32]) {
    let table = e4m3_table();
    let n = out.len();
    #[cfg(target_arch = "x86_64")]
    if codes.len() == n
        && add.is_none_or(|a| a.len() == n)
        && n.is_multiple_of(16)
        && std::is_x86_feature_detected!("avx512f")
    {
        // SAFETY: AVX-512F detected; equal lengths, a multiple of 16.
        unsafe { avx512::decode(table, codes, scale, add, out) };
        return;
    }
    match add {
        Some(add) => out.iter_mut().zip(codes).zip(add).for_each(|((x, &c), &r)| *x = table[c as usize] * scale + r),
        None => out.iter_mut().zip(codes).for_each(|(x, &c)| *x = table[c as usize] * scale),
    }
}

/// A key head after RoPE (`rotated`, at some position p) as codes of its
/// difference from the offset rotated to the same position
/// (`rotated_offset` = R(p)·o; zeros round the key as it is), computed in
/// `residual` (scratch of the row's length): returns the scale.
pub fn encode_key_row(rotated: &[f32], rotated_offset: &[f32], residual: &mut [f32], codes: &mut [u8]) -> f32 {
    residual.iter_mut().zip(rotated).zip(rotated_offset).for_each(|((r, &k), &o)| *r = k - o);
    encode_row(residual, codes)
}

/// `codes · scale` into `out`.
pub fn decode_row(codes: &[u8], scale: f32, out: &mut [f32]) {
    decode_row_adding(codes, scale, None, out);
}

/// The row arithmetic sixteen values at a time.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `row` as the codes of `x / scale`: [`super::f32_to_e4m3`]'s
    /// arithmetic on the bits, lane by lane, so the codes are the scalar
    /// loop's (a test compares them).
    ///
    /// # Safety
    /// AVX-512F must be available and `row.len() == codes.len()` a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn encode(row: &[f32], scale: f32, codes: &mut [u8]) {
        let s = _mm512_set1_ps(scale);
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        let (m512, magic) = (_mm512_set1_ps(512.0), _mm512_set1_ps(8_388_608.0));
        let (half, one) = (_mm512_set1_epi32(0x7_ffff), _mm512_set1_epi32(1));
        let (bias, max_code) = (_mm512_set1_epi32((127 - 7) << 3), _mm512_set1_epi32(0x7e));
        let (min_normal, nan) = (_mm512_set1_epi32((1.0f32 / 64.0).to_bits() as i32), _mm512_set1_epi32(0x7f80_0000));
        let (sign_mask, nan_code) = (_mm512_set1_epi32(0x80), _mm512_set1_epi32(0x7f));
        for (x, c) in row.chunks_exact(16).zip(codes.chunks_exact_mut(16)) {
            // SAFETY: 16 floats read from x and 16 bytes written to c, both
            // exactly that long (chunks_exact).
            unsafe {
                let bits = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x.as_ptr()), s));
                let a = _mm512_and_si512(bits, abs_mask);
                let scaled = _mm512_mul_ps(_mm512_castsi512_ps(a), m512);
                let subnormal = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(scaled, magic), magic));
                let lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), one);
                let rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, half), lsb), 20);
                let normal = _mm512_min_epu32(_mm512_sub_epi32(rounded, bias), max_code);
                let is_sub = _mm512_cmplt_epu32_mask(a, min_normal);
                let code = _mm512_mask_blend_epi32(is_sub, normal, subnormal);
                let sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), sign_mask);
                let code = _mm512_or_si512(code, sign);
                let is_nan = _mm512_cmpgt_epu32_mask(a, nan);
                let code = _mm512_mask_blend_epi32(is_nan, code, nan_code);
                _mm_storeu_si128(c.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(code));
            }
        }
    }

    /// `out[i] = table[codes[i]] · scale (+ add[i])`, sixteen at a time:
    /// the scalar decode's products and sums, exactly.
    ///
    /// # Safety
    /// AVX-512F must be available; `codes`, `out` (and `add`) of one length,
    /// a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn decode(table: &[f32; 256], codes: &[u8], scale: f32, add: Option<&[f32]>, out: &mut [f32]) {
        let s = _mm512_set1_ps(scale);
        for (j, (c, o)) in codes.chunks_exact(16).zip(out.chunks_exact_mut(16)).enumerate() {
            // SAFETY: 16 bytes read from c, 16 floats written to o and read
            // from add (all exactly that long); the gather's indices are
            // bytes, within the 256-entry table.
            unsafe {
                let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(c.as_ptr().cast()));
                let mut x = _mm512_mul_ps(_mm512_i32gather_ps::<4>(idx, table.as_ptr()), s);
                if let Some(add) = add {
                    x = _mm512_add_ps(x, _mm512_loadu_ps(add.as_ptr().add(16 * j)));
                }
                _mm512_storeu_ps(o.as_mut_ptr(), x);
            }
        }
    }
}

/// `q · R(p)·o` for one query head `q` and a KV head's offset `o`, at any
/// key position p. RoPE turns pair (i, i + d/2) of the first `rot_dim`
/// channels by p·θᵢ, so
/// `q · R(p)·o = Σᵢ aᵢ cos(p·θᵢ) + bᵢ sin(p·θᵢ) + Σ_tail q_j o_j` with
/// `aᵢ = qᵢ oᵢ + q_{i+h} o_{i+h}` and `bᵢ = q_{i+h} oᵢ − qᵢ o_{i+h}`
/// (h = rot_dim / 2): d multiply-adds a key, from per-row coefficients.
#[derive(Debug, Clone)]
pub struct OffsetScore {
    a: Vec<f32>,
    b: Vec<f32>,
    /// The channels RoPE leaves alone (partial rotary): their dot product.
    tail: f32,
}

impl OffsetScore {
    pub fn new(q: &[f32], o: &[f32], rot_dim: usize) -> Self {
        let h = rot_dim / 2;
        let (a, b) = (0..h).map(|i| (q[i] * o[i] + q[i + h] * o[i + h], q[i + h] * o[i] - q[i] * o[i + h])).unzip();
        let tail = q[rot_dim..].iter().zip(&o[rot_dim..]).map(|(x, y)| x * y).sum();
        OffsetScore { a, b, tail }
    }

    /// The term at the position whose (cos, sin) per frequency are given
    /// (as [`crate::rope::Rope::cos_sin`] makes them).
    pub fn at(&self, cos: &[f32], sin: &[f32]) -> f32 {
        let pairs: f32 =
            self.a.iter().zip(&self.b).zip(cos.iter().zip(sin)).map(|((a, b), (c, s))| a * c + b * s).sum();
        pairs + self.tail
    }
}

#[cfg(test)]
mod tests {
    use inferscale_model::{RopeConfig, RopeScaling};

    use super::*;
    use crate::rope::{Rope, TABLE_POSITIONS};
    use crate::sampling::Rng;

    /// `n` values uniform in ±`scale`.
    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale).collect()
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn rotated(rope: &Rope, x: &[f32], position: u32) -> Vec<f32> {
        let (mut c, mut s) = (Vec::new(), Vec::new());
        rope.cos_sin(position, &mut c, &mut s);
        let mut y = x.to_vec();
        rope.rotate(&mut y, &c, &s);
        y
    }

    fn cos_sin(rope: &Rope, position: u32) -> (Vec<f32>, Vec<f32>) {
        let (mut c, mut s) = (Vec::new(), Vec::new());
        rope.cos_sin(position, &mut c, &mut s);
        (c, s)
    }

    #[test]
    fn offsets_need_a_calibration_write_of_sixteen_tokens() {
        let dim = 4;
        let keys: Vec<f32> = (0..CALIBRATION_TOKENS * dim).map(|i| (i % dim) as f32 + (i / dim) as f32).collect();
        assert_eq!(key_offsets(&keys[..(CALIBRATION_TOKENS - 1) * dim], dim), None);
        // Channel c of row r is c + r: means c + 7.5.
        assert_eq!(key_offsets(&keys, dim), Some(vec![7.5, 8.5, 9.5, 10.5]));
        let mut bad = keys.clone();
        bad[1] = f32::NAN;
        assert_eq!(key_offsets(&bad, dim), None);
    }

    /// The offset's term equals the dot product with the offset rotated to
    /// the key's position: from the table and past it, with channels RoPE
    /// leaves alone (partial rotary).
    #[test]
    fn offset_score_is_the_dot_product_with_the_rotated_offset() {
        for (head_dim, rot_dim) in [(64, 64), (64, 32)] {
            let rope = Rope::new(&RopeConfig { theta: 1_000_000.0, dim: rot_dim, scaling: RopeScaling::None });
            let (q, o) = (values(1, head_dim, 1.0), values(2, head_dim, 300.0));
            let term = OffsetScore::new(&q, &o, rot_dim);
            for p in [0, 1, 7, 1000, TABLE_POSITIONS as u32 + 5] {
                let (c, s) = cos_sin(&rope, p);
                let want = dot(&q, &rotated(&rope, &o, p));
                let got = term.at(&c, &s);
                assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "p {p}: {got} vs {want}");
            }
        }
    }

    /// A key with an offset channel (Qwen2.5's layer-0 keys hold one near
    /// −355 that varies by ±1.2): stored as codes of R(p)·(k − o) and scored
    /// as `q · code·scale + q · R(p)·o`, its score is within the residual's
    /// rounding — while the same key rounded as it is (one scale for the
    /// row) misses by the offset channel's rounding step, far more.
    #[test]
    fn a_key_scores_through_its_offset_within_the_residuals_rounding() {
        let (head_dim, tokens) = (64, CALIBRATION_TOKENS);
        let rope = Rope::new(&RopeConfig { theta: 1_000_000.0, dim: head_dim, scaling: RopeScaling::None });
        let mut keys = values(3, tokens * head_dim, 1.0);
        for (t, row) in keys.chunks_exact_mut(head_dim).enumerate() {
            row[5] = -355.0 + 1.2 * ((t as f32) * 0.7).sin();
        }
        let o = key_offsets(&keys, head_dim).unwrap_or_else(|| panic!("16 tokens calibrate"));
        let q = values(4, head_dim, 1.0);
        let (mut offset_err, mut plain_err) = (0f32, 0f32);
        let mut codes = vec![0u8; head_dim];
        let mut back = vec![0f32; head_dim];
        for (t, k) in keys.chunks_exact(head_dim).enumerate() {
            let p = 100 + t as u32;
            let (c, s) = cos_sin(&rope, p);
            let rk = rotated(&rope, k, p);
            let want = dot(&q, &rk);

            let scale = encode_key_row(&rk, &rotated(&rope, &o, p), &mut back, &mut codes);
            decode_row(&codes, scale, &mut back);
            let got = dot(&q, &back) + OffsetScore::new(&q, &o, head_dim).at(&c, &s);
            offset_err = offset_err.max((got - want).abs());

            let scale = encode_row(&rk, &mut codes);
            decode_row(&codes, scale, &mut back);
            plain_err = plain_err.max((dot(&q, &back) - want).abs());
        }
        // The residual is ~1 per channel: e4m3 keeps it to a few hundredths
        // (measured: 0.11 against 1.8 for plain rounding).
        assert!(offset_err < 0.5, "offset form: score error {offset_err}");
        assert!(plain_err > 10.0 * offset_err, "plain rounding {plain_err} against offset form {offset_err}");
    }

    /// The vector paths (AVX-512, where the CPU has it) give the scalar
    /// loops' codes and values exactly: rows with values across e4m3's
    /// range, subnormal ones, zeros of both signs, infinities and NaN.
    #[test]
    fn rows_encode_and_decode_as_the_scalar_loops_do() {
        let mut rng = Rng::new(11);
        for row in 0..200 {
            let mut x: Vec<f32> = (0..128)
                .map(|_| {
                    let e = (rng.next_f64() * 40.0) as i32 - 20;
                    (rng.next_f64() as f32 * 2.0 - 1.0) * 2f32.powi(e)
                })
                .collect();
            if row == 0 {
                x[..6].copy_from_slice(&[0.0, -0.0, 1e-12, -3e-3, f32::INFINITY, f32::NAN]);
            }
            let mut codes = vec![0u8; 128];
            let scale = encode_row(&x, &mut codes);
            let want: Vec<u8> = x.iter().map(|&v| f32_to_e4m3(v / scale)).collect();
            assert_eq!(codes, want, "row {row}: codes");
            let add = values(row as u64, 128, 3.0);
            let table = e4m3_table();
            let mut got = vec![0f32; 128];
            decode_row_adding(&codes, scale, Some(&add), &mut got);
            let want: Vec<f32> = codes.iter().zip(&add).map(|(&c, &r)| table[c as usize] * scale + r).collect();
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
            decode_row(&codes, scale, &mut got);
            let want: Vec<f32> = codes.iter().map(|&c| table[c as usize] * scale).collect();
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        }
    }

    #[test]
    fn rows_round_trip_within_e4m3_precision() {
        let row = values(5, 128, 3.0);
        let mut codes = vec![0u8; 128];
        let scale = encode_row(&row, &mut codes);
        let mut back = vec![0f32; 128];
        decode_row(&codes, scale, &mut back);
        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (x, y) in row.iter().zip(&back) {
            // Three mantissa bits: at most half a step, 1/16 of the value,
            // or half the smallest subnormal step at the bottom.
            assert!((x - y).abs() <= x.abs() / 16.0 + scale * 2f32.powi(-10), "{x} -> {y}");
        }
        let back_max = back.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!((back_max - amax).abs() <= 1e-6 * amax, "the largest value maps to 448: {back_max} vs {amax}");
        let mut zeros = vec![7u8; 4];
        assert_eq!(encode_row(&[0.0; 4], &mut zeros), 1.0);
        assert_eq!(zeros, [0; 4]);
    }
}
