//! Rotary position embedding: frequency tables with the model's scaling and
//! the rotation itself.
//!
//! Convention: HF's `rotate_half` — dimension `i` pairs with `i + rot/2`
//! (GGUF's interleaved Q/K rows are un-permuted at load, so one convention
//! serves every file). Angles are `position · inv_freq[i]` in f32, as HF
//! computes them, so our keys match the reference bit for bit in the angle.

use inferscale_model::{RopeConfig, RopeScaling};

/// Positions below this get their cos/sin from a table built once; the
/// table costs `2 · TABLE_POSITIONS · dim/2` floats (8 MiB at dim 128).
pub const TABLE_POSITIONS: usize = 8192;

/// Precomputed inverse frequencies for one model, and cos/sin of the first
/// [`TABLE_POSITIONS`] positions (the same f32 values computed on the fly
/// beyond, so results do not depend on which path served a position).
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Rotated dimensions per head (the leading `dim` of each head).
    dim: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &RopeConfig) -> Self {
        let dim = cfg.dim;
        let base: Vec<f32> = (0..dim / 2).map(|i| 1.0 / cfg.theta.powf((2 * i) as f32 / dim as f32)).collect();
        let inv_freq = match &cfg.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Divisors(d) => base.iter().zip(d).map(|(f, d)| f / d).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        let half = dim / 2;
        let (mut cos, mut sin) = (vec![0f32; TABLE_POSITIONS * half], vec![0f32; TABLE_POSITIONS * half]);
        for p in 0..TABLE_POSITIONS {
            for (i, &f) in inv_freq.iter().enumerate() {
                let a = p as f32 * f;
                cos[p * half + i] = a.cos();
                sin[p * half + i] = a.sin();
            }
        }
        Rope { inv_freq, dim, cos, sin }
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The cos and sin tables, `[TABLE_POSITIONS, dim/2]` each, for device
    /// backends to upload once (positions beyond are computed from
    /// [`Rope::inv_freq`] the same way).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// (cos, sin) of every frequency at `position`, appended to `cos` and `sin`.
    pub fn cos_sin(&self, position: u32, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        let p = position as usize;
        let half = self.dim / 2;
        if p < TABLE_POSITIONS {
            cos.extend_from_slice(&self.cos[p * half..(p + 1) * half]);
            sin.extend_from_slice(&self.sin[p * half..(p + 1) * half]);
            return;
        }
        for &f in &self.inv_freq {
            let a = position as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }

    /// Rotates one head vector in place to `position`.
    pub fn rotate(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.dim / 2;
        let (lo, hi) = head[..self.dim].split_at_mut(half);
        for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(&cos[..half]).zip(&sin[..half]) {
            let (x1, x2) = (*a, *b);
            *a = x1 * c - x2 * s;
            *b = x2 * c + x1 * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> RopeConfig {
        RopeConfig { theta: 500_000.0, dim: 16, scaling }
    }

    #[test]
    fn linear_divides_every_frequency() {
        let a = Rope::new(&cfg(RopeScaling::None));
        let b = Rope::new(&cfg(RopeScaling::Linear { factor: 2.0 }));
        for (x, y) in a.inv_freq().iter().zip(b.inv_freq()) {
            assert_eq!(*y, x / 2.0);
        }
    }

    #[test]
    fn llama3_keeps_high_and_scales_low_frequencies() {
        let plain = Rope::new(&cfg(RopeScaling::None));
        let s = Rope::new(&cfg(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        }));
        // Highest frequency (wavelength 2π < 16) untouched; lowest divided by 8.
        assert_eq!(s.inv_freq()[0], plain.inv_freq()[0]);
        assert_eq!(s.inv_freq()[7], plain.inv_freq()[7] / 8.0);
    }

    #[test]
    fn table_and_direct_angles_agree() {
        let r = Rope::new(&cfg(RopeScaling::None));
        let (mut c, mut s) = (vec![], vec![]);
        r.cos_sin(TABLE_POSITIONS as u32 - 1, &mut c, &mut s);
        let p = (TABLE_POSITIONS - 1) as f32;
        for (i, &f) in r.inv_freq().iter().enumerate() {
            assert_eq!((c[i], s[i]), ((p * f).cos(), (p * f).sin()));
        }
    }

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let r = Rope::new(&cfg(RopeScaling::None));
        let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut c, mut s) = (vec![], vec![]);
        r.cos_sin(0, &mut c, &mut s);
        let mut y = x.clone();
        r.rotate(&mut y, &c, &s);
        assert_eq!(x, y);
        let (mut c, mut s) = (vec![], vec![]);
        r.cos_sin(123, &mut c, &mut s);
        r.rotate(&mut y, &c, &s);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&y)).abs() < 1e-5);
    }
}
